"""Rank bodies for DiLoCo over FSDP2 sites: several Trainer fits in one spawned world of 4 Gloo ranks (2 sites of 2)."""

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.outer import DiLoCoStrategy, ShardedDiLoCoStrategy
from tests.distributed.diloco_runtime_ranks import AtStep
from tests.distributed.sharded_ranks import ShardedRegressor, UnshardedRegressor, _loader, _local


class Steps(Callback):
    """After every optimizer step (after the outer round): each parameter as this rank holds it (its shard under
    FSDP2, the whole tensor under DDP) and the outer statistics."""

    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []
        self.stats: list[dict[str, torch.Tensor]] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.params.append([_local(p).detach().clone() for p in pl_module.parameters()])
        self.stats.append({k: v.clone() for k, v in getattr(trainer.strategy, "stats", {}).items()})


def _perturb_anchor(strategy: Any, module: pl.LightningModule) -> None:
    strategy.outer.anchor[next(iter(strategy.outer.anchor))].add_(1e-3)


def _strategy(config: dict[str, Any]) -> Any:
    kwargs = dict(config.get("strategy", {}))
    if kwargs.get("compressor") == "sparseloco":
        kwargs["compressor"] = TopK(ratio=0.05, value_dtype="int2", dense_1d=False)
    return (DiLoCoStrategy if config.get("kind") == "ddp" else ShardedDiLoCoStrategy)(**kwargs)


def fit(world_size: int, config: dict[str, Any], save: str = "", resume: str = "") -> dict[str, Any]:
    record = Steps()
    callbacks: list[Callback] = [record]
    if save:  # a checkpoint at the first epoch's end (4 batches per rank): mid-window for sync_every=3
        callbacks.append(ModelCheckpoint(dirpath=save, every_n_epochs=1, save_top_k=-1))
    if config.get("perturb") is not None:  # (rank, step): that rank's anchor shard moved before that step
        rank_, step_ = config["perturb"]
        callbacks.append(AtStep(rank_, step_, _perturb_anchor))
    trainer = pl.Trainer(strategy=_strategy(config), accelerator="cpu", devices=world_size,
                         max_steps=config.get("steps", 5), logger=False, enable_checkpointing=bool(save),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    model = (UnshardedRegressor if config.get("kind") in ("ddp", "unsharded") else ShardedRegressor)()
    trainer.fit(model, _loader(), ckpt_path=resume or None)
    strategy: Any = trainer.strategy
    return {
        "error": None,
        "params": record.params,
        "final": [_local(p).detach().clone() for p in model.parameters()],  # after the final round (on_train_end)
        "stats": record.stats,
        "bytes_per_step": strategy.bytes_per_step(),
        "dense_bytes_per_step": strategy.dense_bytes_per_step(),
        "rounds": strategy.outer.rounds,
        # what this rank holds of the outer state: the anchor and the outer momentum, per parameter
        "anchor_numel": sum(t.numel() for t in strategy.outer.anchor.values()),
        "momentum_numel": sum(v.numel() for s in strategy.outer.outer_optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0),
    }


def sharded_diloco_configs(rank: int, world_size: int, configs: list[dict[str, Any]], tmpdir: str) -> list[Any]:
    """Run each config (``strategy``: the strategy's kwargs; ``kind``: ``"ddp"`` for DiLoCoStrategy over the same
    model unsharded; ``resume``/``save``: a checkpoint directory under ``tmpdir``); an error before or during the
    fit is recorded as (type, message) on every rank."""
    out: list[Any] = []
    for config in configs:
        save = os.path.join(tmpdir, config["save"]) if config.get("save") else ""
        resume = os.path.join(tmpdir, config["resume"]) if config.get("resume") else ""
        try:
            out.append(fit(world_size, config, save, resume))
        except (ValueError, RuntimeError) as error:  # bad input (before step 0), a divergence: every rank alike
            out.append({"error": (type(error).__name__, str(error))})
    return out
