"""Rank bodies of the reliability tests: several Trainer runs per spawned group, to keep the spawn count low.

Each body loops over compressors and catches per-compressor failures, so one broken compressor reports
itself instead of hiding the others (a hang still fails the whole group through the harness timeout).
"""

import os
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy, registry
from tests.distributed.lightning_ranks import TinyClassifier, random_loader
from tests.distributed.memory_probe import MemoryProbe

#: compressors every reliability test covers: all registered names, plus the test-only stateful probe
PROBES: dict[str, Callable[[], Any]] = {"memory_probe": MemoryProbe}


def compressors_under_test() -> list[str]:
    return registry.compressor_names() + sorted(PROBES)


class StepDataClassifier(TinyClassifier):
    """Draws its batch from (rank, global step) instead of the loader: the data of step t is the same whether or
    not the run was interrupted before t (Lightning restores a loader's position only for stateful loaders)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * self.global_rank + self.trainer.global_step)
        x = torch.randn(16, 20, generator=gen)
        return super().training_step((x, x[:, :5].argmax(dim=1)), batch_idx)


def step_loader(batches: int = 6) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(batches * 2, 1)), batch_size=1)


def make_strategy(name: str, **kwargs: Any) -> GradCompStrategy:
    compressor = PROBES[name]() if name in PROBES else name
    return GradCompStrategy(compressor=compressor, **kwargs)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def fit(
    world_size: int,
    strategy: Any,
    max_steps: int,
    model: Optional[pl.LightningModule] = None,
    loader: Optional[DataLoader] = None,
    ckpt_path: Optional[str] = None,
    save_to: Optional[str] = None,
    **trainer_kwargs: Any,
) -> tuple[pl.LightningModule, pl.Trainer]:
    model = model if model is not None else TinyClassifier(momentum=0.9)
    options: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(trainer_kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=max_steps, **options)
    trainer.fit(model, loader if loader is not None else random_loader(128, 16), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return model, trainer


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception:
        return {"error": traceback.format_exc()}


# -- checkpoint / resume ------------------------------------------------------------------------------------
def resume_runs(rank: int, world_size: int, names: list[str], tmpdir: str, total: int, at: int) -> dict[str, Any]:
    """Per compressor: parameters of an uninterrupted run, of a run stopped at ``at`` and resumed, of a resume
    that drops the compression state, and the error of resuming a checkpoint claiming another world size."""
    out: dict[str, Any] = {}
    for name in names:

        def one() -> dict[str, Any]:
            res: dict[str, Any] = {}
            # the uninterrupted run writes a checkpoint at step `at` (mid-epoch), as a run that then crashed would
            folder = os.path.join(tmpdir, name)
            saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=at, save_top_k=-1)
            run = dict(loader=step_loader())
            full, _ = fit(world_size, make_strategy(name), total, StepDataClassifier(momentum=0.9),
                          enable_checkpointing=True, callbacks=[saver], **run)
            res["full"] = flat_params(full)
            path = os.path.join(folder, f"epoch=0-step={at}.ckpt")
            resumed, trainer = fit(world_size, make_strategy(name), total, StepDataClassifier(momentum=0.9),
                                   ckpt_path=path, **run)
            res["resumed"] = flat_params(resumed)
            res["global_step"] = trainer.global_step
            saved = torch.load(path, weights_only=False)["gradcomp"]
            res["saved_ranks"] = len(saved["ranks"])
            res["saved_memory"] = sorted(saved["ranks"][rank]["memory"])
            reset, _ = fit(world_size, make_strategy(name, resume_compression="reset"), total,
                           StepDataClassifier(momentum=0.9), ckpt_path=path, **run)
            res["reset"] = flat_params(reset)
            # a checkpoint that claims a third rank: refused (or accepted when it holds no per-rank state)
            if rank == 0:
                checkpoint = torch.load(path, weights_only=False)
                checkpoint["gradcomp"]["world_size"] = world_size + 1
                checkpoint["gradcomp"]["ranks"].append(checkpoint["gradcomp"]["ranks"][-1])
                torch.save(checkpoint, path + ".other")
            torch.distributed.barrier()
            try:
                fit(world_size, make_strategy(name), total, StepDataClassifier(momentum=0.9),
                    ckpt_path=path + ".other", **run)
                res["other_world_error"] = None
            except ValueError as exc:
                res["other_world_error"] = str(exc)
            return res

        out[name] = _guarded(one)
    return out
