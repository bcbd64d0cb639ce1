"""Rank bodies for DiLoCo's run-time behaviour: the end of fit, replica checks by site, resume warnings, misuse.

One spawned world runs every scenario in turn (spawns are expensive); scenarios that raise do so on every rank
at the same point, so the world stays in step for the next one.
"""

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp import GradCompStrategy, WeightGradStrategy
from lightning_gradcomp.callbacks.progress import PROGRESS_BAR_KEY
from lightning_gradcomp.outer import DiLoCoStrategy
from tests.distributed.lightning_ranks import random_loader
from tests.distributed.weightgrad_ranks import AdamClassifier


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit(world_size: int, strategy: Any, steps: int, model: Any = None, ckpt_path: Any = None,
         callbacks: Any = (), checkpointing: bool = False, **trainer_kwargs: Any) -> dict[str, Any]:
    """One fit; returns the weights when it returned, what it warned and logged, or the error it raised
    (``trainer_kwargs``: further Trainer arguments, e.g. ``max_epochs``)."""
    model = model or AdamClassifier()
    handler = _Logs()
    logger = logging.getLogger("lightning_gradcomp")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    out: dict[str, Any] = {"error": None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                                 enable_progress_bar=False, enable_model_summary=False,
                                 enable_checkpointing=checkpointing, callbacks=list(callbacks), **trainer_kwargs)
            try:
                trainer.fit(model, random_loader(), ckpt_path=ckpt_path)
                out["progress_bar"] = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
                out["bytes_per_step"] = getattr(trainer.strategy, "bytes_per_step", lambda: None)()
                outer = getattr(trainer.strategy, "outer", None)
                out["rounds"] = None if outer is None else outer.rounds
            except Exception as exc:  # the type is asserted by the test
                out["error"] = (type(exc).__name__, str(exc))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["params"] = _flat(model)
    out["warnings"] = [str(w.message) for w in caught]
    out["logs"] = handler.lines
    return out


class AtStep(Callback):
    """Runs ``action(strategy, module)`` on ``rank`` before the optimizer step of ``step`` (0-based)."""

    def __init__(self, rank: int, step: int, action: Callable[[Any, pl.LightningModule], object]) -> None:
        self.rank, self.step, self.action = rank, step, action

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                self.action(trainer.strategy, pl_module)


def _perturb_anchor(strategy: Any, module: pl.LightningModule) -> None:
    name = next(iter(strategy.outer.anchor))
    strategy.outer.anchor[name].add_(1e-3)


class StopAfter(Callback):
    """Stops ``fit`` after the optimizer step ``step`` (1-based), as early stopping does: not its last step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _nan_weight(strategy: Any, module: pl.LightningModule) -> None:
    next(module.parameters()).fill_(float("nan"))


def _last_checkpoint(world_size: int, strategy: DiLoCoStrategy, saver: ModelCheckpoint,
                     **trainer_kwargs: Any) -> dict[str, Any]:
    """A fit whose end falls between two rounds, saved by ``saver`` (``save_last``); the weights it returned, and
    what its last checkpoint holds as read on this rank: the model's weights and every rank's site weights."""
    model = AdamClassifier()
    out = _fit(world_size, strategy, trainer_kwargs.pop("steps", -1), model=model, callbacks=[saver],
               checkpointing=True, **trainer_kwargs)
    if out["error"] is None:
        # written by rank 0 before the barrier that ends its save: every rank reads the same file
        checkpoint = torch.load(saver.last_model_path, map_location="cpu", weights_only=False)
        names = [n for n, _ in model.named_parameters()]
        out["checkpoint_params"] = torch.cat([checkpoint["state_dict"][n].reshape(-1) for n in names])
        out["checkpoint_sites"] = [torch.cat([entry["extra"]["outer"]["params"][n].reshape(-1) for n in names])
                                   for entry in checkpoint["gradcomp"]["ranks"]]
        out["checkpoint_step"] = checkpoint["global_step"]
    return out


def runtime_scenarios(rank: int, world_size: int, tmpdir: str) -> dict[str, dict[str, Any]]:
    """Every scenario on ``world_size`` ranks (sites of one rank unless stated)."""
    out: dict[str, dict[str, Any]] = {}
    # a run shorter than H = 100: no round on schedule; the final round makes the replicas identical
    out["short"] = _fit(world_size, DiLoCoStrategy(check_replicas_every=1), 3)
    # streaming: fragments in flight and mixing at the end of fit
    out["streaming"] = _fit(world_size, DiLoCoStrategy(sync_every=4, fragments=3, sync_delay=1, mixing=0.5), 5)
    # rounds on schedule with the replica check every step: only the sites' own ranks must agree between rounds
    out["checked"] = _fit(world_size, DiLoCoStrategy(sync_every=2, check_replicas_every=1), 4)
    out["weightgrad_checked"] = _fit(
        world_size, WeightGradStrategy(site_size=1, allow_single_rank_sites=True, staleness_bound=2,
                                       check_replicas_every=1), 4)
    # a rank whose global weights differ right after a round: every rank raises, naming it
    out["anchor_perturbed"] = _fit(world_size, DiLoCoStrategy(sync_every=2, check_replicas_every=1), 4,
                                   callbacks=[AtStep(1, 1, _perturb_anchor)])
    # one site: nothing crosses; warned
    out["one_site"] = _fit(world_size, DiLoCoStrategy(site_size=world_size, sync_every=2), 2)
    # resume with another H than the checkpoint's
    saver = ModelCheckpoint(dirpath=os.path.join(tmpdir, "h"), every_n_train_steps=3, save_top_k=-1)
    _fit(world_size, DiLoCoStrategy(sync_every=2), 3, callbacks=[saver], checkpointing=True)
    out["other_h"] = _fit(world_size, DiLoCoStrategy(sync_every=3), 5,
                          ckpt_path=os.path.join(tmpdir, "h", "epoch=0-step=3.ckpt"))
    # resume from a plain DDP checkpoint
    saver = ModelCheckpoint(dirpath=os.path.join(tmpdir, "ddp"), every_n_train_steps=2, save_top_k=-1)
    _fit(world_size, "ddp", 2, callbacks=[saver], checkpointing=True)
    out["from_ddp"] = _fit(world_size, DiLoCoStrategy(sync_every=2), 4,
                           ckpt_path=os.path.join(tmpdir, "ddp", "epoch=0-step=2.ckpt"))
    # resume from a GradCompStrategy checkpoint: its compression state is not DiLoCo's (refused); 'reset' starts afresh
    saver = ModelCheckpoint(dirpath=os.path.join(tmpdir, "gradcomp"), every_n_train_steps=2, save_top_k=-1)
    _fit(world_size, GradCompStrategy(compressor="fp32"), 2, callbacks=[saver], checkpointing=True)
    path = os.path.join(tmpdir, "gradcomp", "epoch=0-step=2.ckpt")
    out["from_gradcomp"] = _fit(world_size, DiLoCoStrategy(sync_every=2), 4, ckpt_path=path)
    out["from_gradcomp_reset"] = _fit(world_size, DiLoCoStrategy(sync_every=2, resume_compression="reset"), 4,
                                      ckpt_path=path)
    # fits that end between two rounds, with a last checkpoint: written at the end of the epoch (DiLoCo, 8 steps,
    # rounds at 3 and 6) and at the last step (Streaming DiLoCo, 5 steps, fragments launched at 1, 2, 4 and landing
    # a step later, mixing 0.5)
    out["last_checkpoint"] = _last_checkpoint(
        world_size, DiLoCoStrategy(sync_every=3),
        ModelCheckpoint(dirpath=os.path.join(tmpdir, "last"), save_last=True), max_epochs=1)
    out["last_checkpoint_streaming"] = _last_checkpoint(
        world_size, DiLoCoStrategy(sync_every=4, fragments=3, sync_delay=1, mixing=0.5),
        ModelCheckpoint(dirpath=os.path.join(tmpdir, "last_streaming"), every_n_train_steps=5, save_last=True),
        steps=5)
    # a fit stopped before max_steps, between two rounds (at 2 and 4): the final round runs at on_train_end
    out["stopped"] = _fit(world_size, DiLoCoStrategy(sync_every=2), 6, callbacks=[StopAfter(3)])
    # last: a NaN weight on rank 1 before the round at step 2 (its pseudo-gradient is NaN)
    out["nan"] = _fit(world_size, DiLoCoStrategy(sync_every=2), 4, callbacks=[AtStep(1, 1, _nan_weight)])
    out["progress_bar_key"] = {"key": PROGRESS_BAR_KEY}
    return out
