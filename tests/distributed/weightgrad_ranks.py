"""Rank bodies for the WeightGrad tests: several Trainer fits in one spawned world (spawns are expensive)."""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.weightgrad import WeightGradStrategy
from tests.distributed.lightning_ranks import TinyClassifier, random_loader


class AdamClassifier(TinyClassifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Recorder(Callback):
    """Parameters and WeightGrad statistics after every optimizer step (after the WAN step)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.stats: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.params.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))
        stats = getattr(trainer.strategy, "stats", {})
        self.stats.append({k: v.clone() for k, v in stats.items()})


def _fit(world_size: int, strategy: Any, model: pl.LightningModule, max_steps: int) -> Recorder:
    recorder = Recorder()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(model, random_loader())
    return recorder


def fit_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run each config (``strategy``: ``"ddp"`` or WeightGrad kwargs; ``model``: ``"sgd"``/``"adam"``) in turn."""
    out = []
    for config in configs:
        kwargs = dict(config.get("weightgrad", {}))
        strategy: Any = config["strategy"] if "strategy" in config else WeightGradStrategy(**kwargs)
        lr, momentum = config.get("lr", 0.1), config.get("momentum", 0.9)
        model = AdamClassifier() if config.get("model") == "adam" else TinyClassifier(lr=lr, momentum=momentum)
        recorder = _fit(world_size, strategy, model, config.get("steps", 6))
        out.append({"params": recorder.params, "stats": recorder.stats})
    return out
