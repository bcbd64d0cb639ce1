"""Rank bodies of the overflow tests: finite gradients that a compressor's encoding turns non-finite."""

import warnings
from typing import Any

import torch

from lightning_gradcomp.exchange import guard
from tests.distributed.lightning_ranks import comm_state
from tests.distributed.reliability_ranks import StepDataClassifier, _guarded, fit, flat_params, make_strategy, step_loader


class ScaledClassifier(StepDataClassifier):
    """Rank 1's loss times ``scale`` at ``bad_steps`` (every step when ``None``): finite gradients far beyond the
    others. Records the parameters after every step."""

    def __init__(self, scale: float, bad_steps: "set[int] | None") -> None:
        super().__init__(momentum=0.9)
        self.scale, self.bad_steps = scale, bad_steps
        self.history: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and (self.bad_steps is None or self.trainer.global_step in self.bad_steps):
            loss = loss * self.scale
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.history.append(flat_params(self))


def _raised(fn: Any) -> Any:
    try:
        fn()
        return None
    except Exception as exc:
        return type(exc).__name__, str(exc)


def overflow_runs(rank: int, world_size: int, cases: list[tuple[str, float]]) -> dict[str, Any]:
    """Per (compressor, scale): rank 1's gradient scaled at step 1 of 4, with ``nonfinite='skip'`` (parameters
    after each step, skipped count) and ``'raise'``; then fp16 overflowing at every step, with the consecutive-skip
    limits lowered to warn after 2 and raise after 4 skipped steps."""
    out: dict[str, Any] = {}
    for name, scale in cases:

        def one() -> dict[str, Any]:
            model, trainer = fit(world_size, make_strategy(name), 4, ScaledClassifier(scale, {1}), loader=step_loader())
            raised = _raised(lambda: fit(world_size, make_strategy(name, nonfinite="raise"), 4,
                                         ScaledClassifier(scale, {1}), loader=step_loader()))
            return {"history": model.history, "skipped": comm_state(trainer.strategy).guard.skipped_steps, "raised": raised}

        out[name] = _guarded(one)

    def persistent() -> dict[str, Any]:
        guard.WARN_AFTER_SKIPS, guard.RAISE_AFTER_SKIPS = 2, 4
        model = ScaledClassifier(1e7, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            raised = _raised(lambda: fit(world_size, make_strategy("fp16"), 8, model, loader=step_loader()))
        return {
            "raised": raised,
            "steps": len(model.history),
            "warnings": [str(w.message) for w in caught if "steps were all skipped" in str(w.message)],
            "finite": all(bool(torch.isfinite(h).all()) for h in model.history),
        }

    out["__persistent__"] = _guarded(persistent)
    return out
