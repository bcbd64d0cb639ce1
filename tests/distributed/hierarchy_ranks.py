"""Rank bodies of the hierarchical-exchange tests: 4 Gloo ranks as 2 sites of 2 (``site_sizes=[2, 2]``)."""

import csv
import os
import traceback
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning.pytorch.loggers import CSVLogger

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.sites.hierarchy import share_bounds
from tests.distributed.lightning_ranks import comm_state
from tests.distributed.reliability_ranks import (
    PROBES,
    InjectingClassifier,
    StepDataClassifier,
    fit,
    flat_params,
    step_loader,
)

SITES = [2, 2]


class ParameterTrace(pl.Callback):
    """The flattened parameters after every optimizer step, and the hook's byte counts after the last one."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.steps.append(flat_params(module))


def _strategy(name: str, **kwargs: Any) -> GradCompStrategy:
    compressor = PROBES[name]() if name in PROBES else name
    return GradCompStrategy(compressor=compressor, **kwargs)


def module_parameters(trainer: pl.Trainer) -> list[torch.Tensor]:
    return [p for p in trainer.lightning_module.parameters() if p.requires_grad]


def _run(world_size: int, strategy: Any, steps: int, callbacks: Sequence[pl.Callback] = (), **options: Any) -> dict[str, Any]:
    trace = ParameterTrace()
    model, trainer = fit(world_size, strategy, steps, StepDataClassifier(momentum=0.9), loader=step_loader(steps),
                         callbacks=[trace, *callbacks], **options)
    out: dict[str, Any] = {"steps": torch.stack(trace.steps)}
    state = getattr(trainer.strategy, "comm_state", None)
    if state is not None:
        out["wan_bytes"] = state.bytes_per_step()
        out["lan_bytes"] = state.ledger.lan_bytes_per_step()
        out["collectives"] = dict(state.ledger.collectives)
        out["dense_bytes"] = sum(4 * p.numel() for p in module_parameters(trainer))
        numels = [p.numel() for p in module_parameters(trainer)]
        out["share_numels"] = [sum(numels[a:b]) for a, b in share_bounds([4 * n for n in numels], SITES[0])]
    return out


def monitored_run(world_size: int, steps: int, tmp: str) -> dict[str, Any]:
    """Hierarchical TernGrad under a CompressionMonitor writing to a CSV logger: the logged byte counts."""
    logger = CSVLogger(tmp, name="hier")
    run = _run(world_size, _strategy("terngrad", site_sizes=SITES), steps,
               callbacks=[CompressionMonitor(logging_interval=1)], logger=logger)
    logged: dict[str, float] = {}
    if trainer_rank() == 0:
        with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        logged = {k: float(v) for k, v in rows[-1].items() if k.startswith("gradcomp/") and "bytes/total" in k and v}
    return {"logged": logged, "wan_bytes": run["wan_bytes"], "lan_bytes": run["lan_bytes"]}


class FirstTensorNaN(InjectingClassifier):
    """On ``bad_rank`` at ``bad_step`` only the first parameter's gradient is NaN. The first parameter is in share 0
    (shares follow the model's order), so when ``bad_rank`` owns share 1, the other cross-site group (that of share
    0's owners) sees the NaN in its data and this rank's own group learns of it only through the flag slots."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = StepDataClassifier.training_step(self, batch, batch_idx)
        if self.global_rank == self.bad_rank and self.trainer.global_step == self.bad_step:
            first = next(p for p in self.parameters() if p.requires_grad)
            self._poison = first.register_hook(lambda g: g * float("nan"))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        poison = getattr(self, "_poison", None)
        if poison is not None:
            poison.remove()
            self._poison = None
        super().on_train_batch_end(outputs, batch, batch_idx)


#: compressors of each kind (shared scaler, stateless, multi-round, residuals) for the guard under the hierarchy
GUARDED = ["terngrad", "fp32", "powersgd", "memory_probe"]


def guarded_run(world_size: int, name: str) -> dict[str, Any]:
    """A NaN gradient of the first parameter (share 0) on rank 3 (site 1, owner of share 1) at step 2 with
    ``nonfinite='skip'``: parameters after every step, skips; then the same with ``nonfinite='raise'``: what each
    rank raised."""
    try:
        model, trainer = fit(world_size, _strategy(name, site_sizes=SITES), 5, FirstTensorNaN(3, 2),
                             loader=step_loader(10))
    except Exception:
        return {"error": traceback.format_exc()}
    state = comm_state(trainer.strategy)
    out: dict[str, Any] = {"history": model.history, "skipped": state.guard.skipped_steps,
           "residuals_finite": all(bool(torch.isfinite(r).all()) for r in state.memory.residuals.values())}
    try:
        fit(world_size, _strategy(name, site_sizes=SITES, nonfinite="raise"), 5, FirstTensorNaN(3, 2),
            loader=step_loader(10))
        out["raised"] = None
    except Exception as exc:  # the type is asserted by the test
        out["raised"] = (type(exc).__name__, str(exc))
    return out


def refused_run(world_size: int) -> dict[str, Any]:
    """A layout the world size cannot take: the error, and how many steps ran before it."""
    trace = ParameterTrace()
    try:
        fit(world_size, _strategy("terngrad", site_size=3), 2, StepDataClassifier(), loader=step_loader(2),
            callbacks=[trace])
    except ValueError as exc:
        return {"error": str(exc), "steps": len(trace.steps)}
    return {"error": None, "steps": len(trace.steps)}


def trainer_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def replica_runs(rank: int, world_size: int, names: list[str], steps: int, tmp: str) -> dict[str, Any]:
    """Per compressor: the hierarchical run's parameters after every step and its bytes, and the flat run's bytes;
    plus plain DDP's trace for the identity comparison."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            hier = _run(world_size, _strategy(name, site_sizes=SITES), steps)
            flat = _run(world_size, _strategy(name), steps)
            out[name] = {"hier": hier, "flat_wan_bytes": flat["wan_bytes"], "dense_bytes": hier["dense_bytes"]}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    out["ddp"] = _run(world_size, "ddp", steps)
    out["monitored"] = monitored_run(world_size, steps, tmp)
    out["bad"] = refused_run(world_size)
    out["guard"] = {name: guarded_run(world_size, name) for name in GUARDED}
    out["planner"] = _run(world_size, _strategy("terngrad", site_sizes=SITES, link="100mbit"), steps)
    return out
