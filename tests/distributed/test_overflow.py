"""Finite gradients that overflow inside compression (issue 21): the guard sees what is decoded, on real Gloo ranks.

fp16 cannot carry |g| / world size beyond 65504, so rank 1's gradient of ~1e6 decodes to Inf on every rank; QSGD's
float32 norm overflowed for gradients of ~1e20 (its squares exceed float32) and decoded to NaN. Either used to
leave non-finite parameters on every rank and every later step skipped, silently.
"""

from typing import Any

import pytest
import torch

from tests.distributed.overflow_ranks import overflow_runs
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

CASES = [("fp16", 1e7), ("qsgd", 1e21)]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(overflow_runs, 2, CASES, timeout=400.0)


def _ok(runs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    for rank, run in enumerate(runs):
        assert "error" not in run[key], f"rank {rank}:\n{run[key]['error']}"
    return [run[key] for run in runs]


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_an_overflowing_gradient_leaves_every_rank_finite(runs: list[dict[str, Any]], name: str) -> None:
    first, second = _ok(runs, name)
    for a, b in zip(first["history"], second["history"]):
        assert torch.equal(a, b), "replicas diverged"
    history = first["history"]
    assert all(bool(torch.isfinite(h).all()) for h in history), "non-finite parameters"
    if name == "fp16":  # Inf after the cast: the step is skipped on every rank, and training goes on
        assert first["skipped"] == second["skipped"] == 1
        assert torch.equal(history[0], history[1]) and not torch.equal(history[2], history[3])
        for run in (first, second):
            kind, message = run["raised"]
            assert kind == "NonFiniteGradientError" and "Compression turned finite gradients" in message, message
    else:  # QSGD's norm is now summed in float64: the huge gradient arrives, finite (and wrecks the model, whose
        # later losses are non-finite and skipped: the guard's ordinary business)
        assert not torch.equal(history[0], history[1])


def test_a_run_whose_steps_keep_being_skipped_warns_then_stops_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for run in _ok(runs, "__persistent__"):
        assert run["finite"]
        assert len(run["warnings"]) == 1 and "the last 2 steps were all skipped" in run["warnings"][0]
        kind, message = run["raised"]
        assert kind == "NonFiniteGradientError" and "The last 4 steps were all skipped" in message, message
        assert run["steps"] == 3  # the 4th skipped step raised before its batch ended
