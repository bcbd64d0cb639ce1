"""Sites under faults and misuse: a rank that stops answering inside a site exchange (hierarchy, DiLoCo, WeightGrad)
ends every other rank with the library's message within the strategy's `timeout` (every group the library creates
takes that timeout); a checkpoint of the flat exchange is refused by the hierarchical one, and back; a NaN on one of
WeightGrad's sites is skipped, or raised, by every site alike."""

import tempfile

import pytest
import torch

from tests.distributed.site_fault_ranks import (
    SITE_STRATEGIES,
    cross_exchange_resume,
    stalled_site_run,
    weightgrad_nan_on_one_site,
)
from tests.distributed.test_faults import collect_reports
from tests.harness import _context, run_ranks

pytestmark = pytest.mark.distributed

#: the strategies' collective timeout
TIMEOUT_S = 3.0
#: how long the victim sleeps: far beyond the timeout, so a rank that waits for it shows
STALL_S = 40.0
#: the bound on each other rank's stop, from the start of the stalled step: the timeout plus a loaded machine's delays
WITHIN_S = 20.0


@pytest.mark.parametrize("name", sorted(SITE_STRATEGIES))
def test_a_rank_stalled_in_a_site_exchange_stops_every_other_rank_within_the_timeout(name: str) -> None:
    """4 ranks in 2 sites of 2; rank 2 (site 1's leader: in a site group, the leaders' group and a cross-site group)
    sleeps at step 2. Each other rank stops with "another rank died or stopped answering", well before it wakes."""
    reports = collect_reports(stalled_site_run, 4, (name, 2, TIMEOUT_S, STALL_S), 3, context=_context())
    assert_the_others_stopped(reports, {0, 1, 3}, WITHIN_S)


def assert_the_others_stopped(reports: dict[int, tuple[str, object]], others: set[int], within_s: float) -> None:
    """Every rank in ``others`` reported, stopped with the library's peer-failure message, within ``within_s``."""
    assert set(reports) == others, f"not every other rank reported: {reports}"
    for rank, (status, outcome) in reports.items():
        assert status == "ok", outcome
        raised = outcome["raised"]  # type: ignore[index]
        assert raised is not None, f"rank {rank} waited for the stalled rank and trained on: {outcome}"
        assert "another rank died or stopped answering" in raised[1], f"rank {rank}: {raised}"
        assert outcome["seconds"] < within_s, f"rank {rank} stopped after {outcome['seconds']:.1f} s"  # type: ignore[index]


def test_a_checkpoint_of_another_exchange_is_refused_before_the_first_step() -> None:
    """A flat run's compression state holds every parameter's residual on every rank; under 2 sites of 2 a rank keeps
    its share's only and its compressor averages over sites. Resuming one with the other fails on every rank with a
    ValueError naming both exchanges and the fix, before any step."""
    with tempfile.TemporaryDirectory() as tmpdir:
        runs = run_ranks(cross_exchange_resume, 4, tmpdir, timeout=300)
    for rank, run in enumerate(runs):
        flat_to_sites, sites_to_flat = run["flat_to_sites"], run["sites_to_flat"]
        for label, outcome in run.items():
            assert outcome["error"] is not None, f"rank {rank}, {label}: resumed silently ({outcome['steps']} steps)"
            # refused while the checkpoint is read: the loops were never restored (step 2) nor run
            assert outcome["steps"] == 0, f"rank {rank}, {label}: stopped at step {outcome['steps']}"
            assert "resume_compression='reset'" in outcome["error"], outcome["error"]
        assert "this run (`site_sizes=[2, 2]`)" in flat_to_sites["error"], flat_to_sites["error"]
        assert "written by the flat exchange" in flat_to_sites["error"], flat_to_sites["error"]
        assert "Fix: resume with no `hierarchy`/`site_size`/`site_sizes`" in flat_to_sites["error"]
        assert "written by the hierarchical exchange with sites [2, 2]" in sites_to_flat["error"], sites_to_flat["error"]
        assert "Fix: resume with `site_sizes=[2, 2]`" in sites_to_flat["error"], sites_to_flat["error"]


def test_a_nan_on_one_weightgrad_site_is_skipped_or_raised_by_every_site_alike() -> None:
    """2 sites of 1 rank; rank 1's gradient is NaN at step 2. `skip`: both sites skip that step (neither moves) and
    are identical after the WAN round; `raise`: both raise NonFiniteGradientError (not one raising while the other
    trains on into a peer failure)."""
    runs = run_ranks(weightgrad_nan_on_one_site, 2, timeout=300)
    for rank, run in enumerate(runs):
        skip = run["skip"]
        assert skip["raised"] is None, f"rank {rank}: {skip['raised']}"
        assert skip["skipped"] == 1, f"rank {rank} skipped {skip['skipped']} steps"
        history = skip["history"]
        assert torch.equal(history[2], history[1]), f"rank {rank} stepped at the step that was non-finite"
        assert not torch.equal(history[1], history[0]) and not torch.equal(history[3], history[2])  # the others moved
        assert torch.equal(history[3], runs[0]["skip"]["history"][3])  # one model after the WAN round
        raised = run["raise"]["raised"]
        assert raised is not None and raised[0] == "NonFiniteGradientError", f"rank {rank}: {raised}"
        assert "site of rank 1" in raised[1] and "nonfinite='skip'" in raised[1], raised[1]
