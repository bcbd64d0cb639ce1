"""A rank that stops answering inside a site exchange (hierarchy, DiLoCo, WeightGrad) ends every other rank with
the library's message within the strategy's `timeout`: every group the library creates takes that timeout."""

import pytest

from tests.distributed.site_fault_ranks import SITE_STRATEGIES, stalled_site_run
from tests.distributed.test_faults import collect_reports
from tests.harness import _context

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
    assert set(reports) == {0, 1, 3}, f"not every other rank reported: {reports}"
    for rank, (status, outcome) in reports.items():
        assert status == "ok", outcome
        raised = outcome["raised"]  # type: ignore[index]
        assert raised is not None, f"rank {rank} waited for the stalled rank and trained on: {outcome}"
        assert "another rank died or stopped answering" in raised[1], f"rank {rank}: {raised}"
        assert outcome["seconds"] < WITHIN_S, f"rank {rank} stopped after {outcome['seconds']:.1f} s"  # type: ignore[index]
