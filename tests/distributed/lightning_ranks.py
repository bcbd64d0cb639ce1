"""Rank bodies that run a Lightning ``Trainer`` (joined through torchrun-style environment variables)."""

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import OptimizerLRScheduler
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.exchange.hook import GradCompState
from lightning_gradcomp.strategies.wiring import HookWiring


def comm_state(strategy: object) -> GradCompState:
    """The hook state of a Trainer's or Fabric's compressing DDP strategy, once its setup has run."""
    assert isinstance(strategy, HookWiring) and strategy.comm_state is not None, (
        f"Expected a strategy with the compression hook installed but got {type(strategy).__name__}"
    )
    return strategy.comm_state


class TinyClassifier(pl.LightningModule):
    def __init__(self, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
        self.lr, self.momentum = lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> OptimizerLRScheduler:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def random_loader(n: int = 256, batch_size: int = 16, shard: tuple[int, int] = (0, 1)) -> DataLoader:
    """Deterministic data; ``shard=(r, N)`` keeps samples r, r+N, ... (what tower r of N sees)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 20, generator=gen)
    y = (x[:, :5].argmax(dim=1)).long()
    r, world = shard
    return DataLoader(TensorDataset(x[r::world], y[r::world]), batch_size=batch_size)


def fit_tiny(
    rank: int,
    world_size: int,
    strategy: Any,
    max_steps: int = 5,
    callbacks: Optional[list] = None,
    batch_size: int = 16,
    devices: Optional[int] = None,
    shard_by_rank: bool = False,
) -> dict[str, Any]:
    model = TinyClassifier()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size if devices is None else devices,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        use_distributed_sampler=not shard_by_rank,
    )
    shard = (rank, world_size) if shard_by_rank else (0, 1)
    trainer.fit(model, random_loader(batch_size=batch_size, shard=shard))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = getattr(trainer.strategy, "comm_state", None)
    return {
        "params": params,
        "strategy": type(trainer.strategy).__name__,
        "compressor": type(getattr(trainer.strategy, "compressor", None)).__name__,
        "bytes_per_step": state.bytes_per_step() if state else None,
        "dense_bytes": state.dense_bytes_per_step() if state else None,
    }
