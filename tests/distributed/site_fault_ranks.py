"""Rank bodies of the site tests: one rank stops answering inside a site strategy's exchange; a checkpoint of the
flat exchange resumed by the hierarchical one, and back; a NaN gradient on one of WeightGrad's sites."""

import os
import time
from datetime import timedelta
from typing import Any, Callable, Optional

from lightning_gradcomp import DiLoCoStrategy, GradCompStrategy, WeightGradStrategy
from tests.distributed.lightning_ranks import comm_state
from tests.distributed.reliability_ranks import (
    DyingClassifier,
    InjectingClassifier,
    StepDataClassifier,
    fit,
    make_strategy,
    step_loader,
)

#: the strategies whose exchanges run on groups the library creates (sites, leaders, cross-site), 2 sites of 2 ranks
SITE_STRATEGIES: dict[str, Callable[[timedelta], Any]] = {
    "hierarchy": lambda timeout: GradCompStrategy(compressor="terngrad", site_size=2, timeout=timeout),
    "diloco": lambda timeout: DiLoCoStrategy(sync_every=2, site_size=2, timeout=timeout),
    "weightgrad": lambda timeout: WeightGradStrategy(site_size=2, staleness_bound=2, timeout=timeout),
}


class StallingClassifier(DyingClassifier):
    """Rank ``victim`` sleeps ``stall_s`` at the start of step ``at`` (alive, connections open); every rank records
    when that step began."""

    def __init__(self, victim: int, at: int, stall_s: float) -> None:
        super().__init__(victim, at, stall_s)
        self.stalled_at: Optional[float] = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.at and self.stalled_at is None:
            self.stalled_at = time.perf_counter()
        super().on_train_batch_start(batch, batch_idx)


def stalled_site_run(
    rank: int, world_size: int, name: str, victim: int, timeout_s: float, stall_s: float
) -> dict[str, Any]:
    """Train ``name`` until rank ``victim`` stalls at step 2; report how this rank stopped and how long after that
    step began."""
    model = StallingClassifier(victim, 2, stall_s)
    try:
        fit(world_size, SITE_STRATEGIES[name](timedelta(seconds=timeout_s)), 8, model, loader=step_loader(8))
        outcome: dict[str, Any] = {"raised": None}
    except BaseException as exc:  # the test asserts what came out
        outcome = {"raised": (type(exc).__name__, str(exc))}
    outcome["seconds"] = None if model.stalled_at is None else time.perf_counter() - model.stalled_at
    return outcome


def cross_exchange_resume(rank: int, world_size: int, tmpdir: str) -> dict[str, Any]:
    """4 ranks, a compressor with residuals (``memory_probe``): a flat run's checkpoint resumed with
    ``site_sizes=[2, 2]``, and a hierarchical run's resumed flat; each resume's error (``None`` if it trained) and
    the steps it trained."""
    out: dict[str, Any] = {}
    for label, written_by, resumed_by in (("flat_to_sites", {}, {"site_sizes": [2, 2]}),
                                          ("sites_to_flat", {"site_sizes": [2, 2]}, {})):
        path = os.path.join(tmpdir, f"{label}.ckpt")
        fit(world_size, make_strategy("memory_probe", **written_by), 2, StepDataClassifier(), loader=step_loader(),
            save_to=path)
        model = StepDataClassifier()
        try:
            _, trainer = fit(world_size, make_strategy("memory_probe", **resumed_by), 4, model, loader=step_loader(),
                             ckpt_path=path)
            out[label] = {"error": None, "steps": trainer.global_step}
        except ValueError as exc:
            out[label] = {"error": str(exc), "steps": model.trainer.global_step}
    return out


def weightgrad_nan_on_one_site(rank: int, world_size: int) -> dict[str, Any]:
    """WeightGrad with a site per rank (WAN round every 4 steps); rank 1's gradient is NaN at step 2, under
    ``nonfinite='skip'`` and ``'raise'``: what each rank skipped, its parameters after every step, what it raised."""
    out: dict[str, Any] = {}
    for mode in ("skip", "raise"):  # "raise" last: a rank that raises alone would leave the others nothing to join
        model = InjectingClassifier(1, 2)
        strategy = WeightGradStrategy(site_size=1, allow_single_rank_sites=True, staleness_bound=4, nonfinite=mode)
        try:
            _, trainer = fit(world_size, strategy, 4, model, loader=step_loader())
            out[mode] = {"raised": None, "skipped": comm_state(trainer.strategy).guard.skipped_steps, "history": model.history}
        except Exception as exc:  # the test asserts the type and the message
            out[mode] = {"raised": (type(exc).__name__, str(exc))}
    return out
