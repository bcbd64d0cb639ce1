"""Rank bodies for the DiLoCo tests: several Trainer fits in one spawned world (spawns are expensive)."""

import os
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.outer import DiLoCoStrategy
from tests.distributed.diloco_runtime_ranks import AtStep
from tests.distributed.lightning_ranks import TinyClassifier, random_loader
from tests.distributed.weightgrad_ranks import AdamClassifier


class Recorder(Callback):
    """After every optimizer step (after the outer round): the parameters, the outer statistics, and how many
    collectives each level has issued so far."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.stats: list[dict[str, Any]] = []
        self.outer_collectives: list[int] = []
        self.inner_world: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.params.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))
        strategy = trainer.strategy
        self.stats.append({k: v.clone() for k, v in getattr(strategy, "stats", {}).items()})
        outer = getattr(strategy, "outer", None)
        self.outer_collectives.append(0 if outer is None else sum(outer.exchange.state.ledger.collectives.values()))
        state = getattr(strategy, "comm_state", None)
        self.inner_world.append(state.world_size if state else 0)


class MemoryLogger(Logger):
    """Keeps every logged metric dictionary with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.logged.append((step, dict(metrics)))


def _trainer(world_size: int, strategy: Any, max_steps: int, logger: Any = False, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=max_steps, logger=logger,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _model(config: dict[str, Any]) -> pl.LightningModule:
    if config.get("model") == "adam":
        return AdamClassifier()
    return TinyClassifier(lr=config.get("lr", 0.1), momentum=config.get("momentum", 0.0))


def _strategy(config: dict[str, Any]) -> Any:
    if "strategy" in config:
        return config["strategy"]
    kwargs = dict(config["diloco"])
    if kwargs.get("compressor") == "sparseloco":
        kwargs["compressor"] = TopK(ratio=0.02, value_dtype="int2", dense_1d=False)
    return DiLoCoStrategy(**kwargs)


def fit_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run each config (``strategy``: a name, or ``diloco``: DiLoCoStrategy kwargs) and record every step."""
    out = []
    for config in configs:
        recorder = Recorder()
        logger: Union[MemoryLogger, Literal[False]] = MemoryLogger() if config.get("monitor") else False
        callbacks: list[Callback] = [recorder] + ([CompressionMonitor(logging_interval=1)] if logger else [])
        if config.get("perturb") is not None:  # (rank, step): that rank's first weight moved before that step
            rank_, step_ = config["perturb"]
            callbacks.append(AtStep(rank_, step_, lambda strategy, module: next(module.parameters()).add_(1e-3)))
        trainer = _trainer(world_size, _strategy(config), config.get("steps", 6), logger=logger,
                           enable_checkpointing=False, callbacks=callbacks)
        error = None
        try:
            trainer.fit(_model(config), random_loader())
        except Exception as exc:  # only where the config expects one; the test asserts its type
            if config.get("perturb") is None:
                raise
            error = (type(exc).__name__, str(exc))
        out.append({"error": error, "params": recorder.params, "stats": recorder.stats, "outer_collectives": recorder.outer_collectives,
                    "inner_world": recorder.inner_world, "logged": logger.logged if logger else [],
                    "bytes_per_step": getattr(trainer.strategy, "bytes_per_step", lambda: None)()})
    return out


def resume(rank: int, world_size: int, tmpdir: str, total: int, at: int, options: dict[str, Any]) -> dict[str, Any]:
    """Uninterrupted vs resumed from a checkpoint at ``at`` (mid-window, maybe with an exchange in flight), and a
    resume that drops the per-rank outer state (the control: it must differ)."""
    def strategy(**extra: Any) -> DiLoCoStrategy:
        kwargs = {**options, **extra}
        if kwargs.get("compressor") == "sparseloco":
            kwargs["compressor"] = TopK(ratio=0.02, value_dtype="int2", dense_1d=False)
        return DiLoCoStrategy(**kwargs)

    def fit(s: DiLoCoStrategy, ckpt_path: Any = None, callbacks: Any = ()) -> torch.Tensor:
        model = AdamClassifier()
        trainer = _trainer(world_size, s, total, enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
        trainer.fit(model, random_loader(), ckpt_path=ckpt_path)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    saver = ModelCheckpoint(dirpath=tmpdir, every_n_train_steps=at, save_top_k=-1)
    full = fit(strategy(), callbacks=[saver])
    path = os.path.join(tmpdir, f"epoch=0-step={at}.ckpt")
    resumed = fit(strategy(), ckpt_path=path)
    reset = fit(strategy(resume_compression="reset"), ckpt_path=path)
    return {"full": full, "resumed": resumed, "reset": reset}


def resume_with_another_layout(rank: int, world_size: int, tmpdir: str) -> str:
    """Save as 4 sites of 1 mid-window, resume as 2 sites of 2: every rank must refuse, naming the layouts."""
    saver = ModelCheckpoint(dirpath=tmpdir, every_n_train_steps=3, save_top_k=-1)
    trainer = _trainer(world_size, DiLoCoStrategy(sync_every=2), 3, callbacks=[saver])
    trainer.fit(AdamClassifier(), random_loader())
    path = os.path.join(tmpdir, "epoch=0-step=3.ckpt")
    try:
        _trainer(world_size, DiLoCoStrategy(sync_every=2, site_size=2), 5, enable_checkpointing=False).fit(
            AdamClassifier(), random_loader(), ckpt_path=path)
    except ValueError as exc:
        return str(exc)
    return "resumed"
