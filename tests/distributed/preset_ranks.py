"""Rank bodies for the presets (``strategy="terngrad_lm"``) and the paper-default warning, under the Trainer and
Fabric: what each setup warned, which parameters went in fp32 or through a compressor of their own, the hook's bytes of the first step and the dense
steps a preset's warm-up resolved to."""

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.callbacks import CompressionSchedule
from tests.distributed.lightning_ranks import comm_state, random_loader


class _Embedded(nn.Module):
    """A token embedding (bucketed inputs), a hidden layer and an output layer: the presets' ``nn.Embedding``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embedding = nn.Embedding(16, 8)
        self.net = nn.Sequential(nn.Linear(20 * 8, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x.clamp(-2, 2) * 3.9 + 8).long()  # 20 features -> 20 tokens of 16
        return self.net(self.embedding(tokens).flatten(1))


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.1)


class _Module(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.model = _Embedded()
        self.optimizer_name = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.optimizer_name, self.parameters())


def _run(rank: int, world_size: int, api: str, strategy: Any, optimizer: str) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if api == "trainer":
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(_Module(optimizer), random_loader())
            used: object = trainer.strategy
            schedules = [c for c in trainer.callbacks if isinstance(c, CompressionSchedule)]  # type: ignore[attr-defined]
            dense = schedules[0].steps_dense if schedules else None
        else:
            fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
            fabric.launch()
            model = _Embedded()
            model, opt = fabric.setup(model, _optimizer(optimizer, model.parameters()))
            x, y = next(iter(random_loader(shard=(rank, world_size))))
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            used = fabric.strategy
            dense = None
    state = comm_state(used)
    return {"warnings": [str(w.message) for w in caught], "strategy": type(used).__name__,
            "float_names": sorted(state.float_names), "bytes": state.bytes_per_step(),
            "own": {n: c.describe() for n, c in sorted(state.router.layer_compressors.items())},
            "dense_bytes": state.dense_bytes_per_step(), "dense_steps": dense}


def setups(rank: int, world_size: int, cases: list[tuple[str, Any, str]]) -> list[dict[str, Any]]:
    """One short run per ``(api, strategy, optimizer)`` case, in turn (one spawned world)."""
    return [_run(rank, world_size, *case) for case in cases]
