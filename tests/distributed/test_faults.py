"""A rank that dies mid-training: the survivors stop with a clear error, well within two minutes."""

import pickle
import time
from collections.abc import Callable
from typing import Any, Optional

import pytest

from tests.distributed.reliability_ranks import survivor_run, unused_layer_run
from tests.harness import _context, _worker, free_port

pytestmark = pytest.mark.distributed

#: the issue's bound for survivors to exit once a peer died (measured inside the survivor)
EXIT_WITHIN_S = 120.0
#: hard timeout of the whole run: start-up of the spawned ranks (slow on a busy 2-core machine) plus the bound
HARD_TIMEOUT_S = 120.0 + EXIT_WITHIN_S


def collect_reports(
    fn: Callable[..., Any], world_size: int, args: tuple, wanted: int, context: Optional[Any] = None
) -> dict[int, tuple[str, object]]:
    """Start ``world_size`` ranks of ``fn`` (forked from the harness's fork server, or from ``context``); collect the
    first ``wanted`` ranks' reports under a hard timeout."""
    # the fork server's preloaded imports: a spawned rank would import torch and Lightning anew (seconds of CPU each)
    ctx = context if context is not None else _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, {}, queue, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + HARD_TIMEOUT_S
    try:
        while len(reports) < wanted and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                break
            reports[rank] = (status, pickle.loads(value) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()
    return reports


def run_with_victim(
    world_size: int, victim: int, timeout_s: float, stall_s: Optional[float] = None
) -> dict[int, tuple[str, object]]:
    """The survivors' reports of :func:`survivor_run` (the victim's never comes)."""
    return collect_reports(survivor_run, world_size, ("fp32", victim, timeout_s, stall_s), world_size - 1)


def _survivor_error(reports: dict, survivor: int) -> tuple[dict, str]:
    """The survivor's outcome and error message; fails unless only it reported and it stopped with our message."""
    assert set(reports) == {survivor}, f"the survivor did not report within {HARD_TIMEOUT_S}s: {reports}"
    status, outcome = reports[survivor]
    assert status == "ok", outcome
    assert outcome["raised"] is not None, "the survivor finished training as if nothing happened"
    _, message = outcome["raised"]
    assert "another rank died or stopped answering" in message, message
    return outcome, message


def test_survivor_of_a_killed_rank_stops_with_a_clear_error() -> None:
    """Rank 0 (which also hosts the rendezvous store) is SIGKILLed at step 2; rank 1 must stop by itself."""
    outcome, message = _survivor_error(run_with_victim(2, victim=0, timeout_s=60), survivor=1)
    assert outcome["seconds"] < EXIT_WITHIN_S


def test_survivor_of_a_stalled_rank_times_out_with_the_gradcomp_message() -> None:
    """Rank 1 stops answering (alive, connections open) at step 2: rank 0's collective times out after
    `timeout`, and Gloo's "Timed out waiting ... for recv" is reported as a peer that stopped answering."""
    outcome, message = _survivor_error(run_with_victim(2, victim=1, timeout_s=3, stall_s=60), survivor=0)
    assert "timed out" in message.lower(), message
    assert outcome["seconds"] < EXIT_WITHIN_S


#: collective timeout of the unused-layer runs: no rank may wait for it
UNUSED_TIMEOUT_S = 90.0


@pytest.mark.parametrize(
    ("name", "options"),
    [("fp32", {}), ("terngrad", {"static_graph": True})],
    ids=["fp32-find_unused_false", "terngrad-static_graph"],
)
def test_a_layer_unused_on_one_rank_fails_fast_on_every_rank(name: str, options: dict[str, Any]) -> None:
    """Rank 1 skips a layer at step 2 (stock DDP: the others wait in that bucket's collective until the timeout).
    Rank 1 stops at once naming the layer and the fix (and nothing else); its exit ends rank 0's wait, well before
    the timeout."""
    reports = collect_reports(unused_layer_run, 2, (name, options, UNUSED_TIMEOUT_S), 2)
    assert set(reports) == {0, 1}, f"not every rank reported within {HARD_TIMEOUT_S}s: {reports}"
    outcomes = {}
    for rank, (status, outcome) in reports.items():
        assert status == "ok", outcome
        assert outcome["raised"] is not None, f"rank {rank} finished training"  # type: ignore[index]
        assert outcome["seconds"] < UNUSED_TIMEOUT_S, f"rank {rank} waited for the collective timeout"  # type: ignore[index]
        outcomes[rank] = outcome["raised"][1]  # type: ignore[index]
    assert "extra.weight" in outcomes[1] and "find_unused_parameters=True" in outcomes[1], outcomes[1]
    # the rank at fault shows its own diagnosis only, not the peer-failure message meant for the others
    assert "another rank died" not in outcomes[1] and outcomes[1].startswith("gradcomp: rank 1 computed"), outcomes[1]
    assert "another rank died or stopped answering" in outcomes[0], outcomes[0]
