"""The hierarchical exchange on real Gloo ranks: 4 ranks as 2 sites of 2 (``site_sizes=[2, 2]``), every compressor.

One spawned group runs, per compressor, a hierarchical and a flat fit of the same steps, and plain DDP once.
"""

import tempfile
from typing import Any

import pytest
import torch

from lightning_gradcomp import registry
from tests.distributed.hierarchy_ranks import GUARDED, PROBES, SITES, replica_runs
from tests.distributed.reliability_ranks import compressors_under_test
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

COMPRESSORS = compressors_under_test()
STEPS = 3
WORLD = sum(SITES)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(replica_runs, WORLD, COMPRESSORS, STEPS, tmp, timeout=600)


def _ok(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, result in enumerate(runs):
        assert "error" not in result[name], f"rank {rank}, {name}:\n{result[name]['error']}"
    return [r[name] for r in runs]


@pytest.mark.parametrize("name", COMPRESSORS)
def test_hierarchical_replicas_are_bit_identical_every_step(runs: list[dict[str, Any]], name: str) -> None:
    traces = [r["hier"]["steps"] for r in _ok(runs, name)]
    assert traces[0].shape[0] == STEPS
    initial_moved = not torch.equal(traces[0][0], traces[0][-1])
    assert initial_moved, "the parameters did not change: nothing was exchanged"
    for rank, trace in enumerate(traces[1:], start=1):
        for step in range(STEPS):
            assert torch.equal(trace[step], traces[0][step]), f"rank {rank} differs from rank 0 after step {step + 1}"


def test_hierarchical_identity_equals_plain_ddp(runs: list[dict[str, Any]]) -> None:
    hier = _ok(runs, "fp32")[0]["hier"]["steps"]
    ddp = runs[0]["ddp"]["steps"]
    torch.testing.assert_close(hier, ddp, rtol=1e-5, atol=1e-6)


def _fixed_size(name: str) -> bool:
    return (PROBES[name]() if name in PROBES else registry.make_compressor(name)).fixed_size


@pytest.mark.parametrize("name", COMPRESSORS)
def test_each_rank_puts_one_kth_of_the_flat_bytes_on_the_wan(runs: list[dict[str, Any]], name: str) -> None:
    """The k ranks of a site together send what one rank sends in the flat exchange: 1/k each on average (a share
    holds whole parameters, so the split is as even as the parameter sizes allow). Compressors whose payload size
    follows the data (sparse selection) see other data (the site's mean) and are compared per site only loosely."""
    results = _ok(runs, name)
    k = SITES[0]
    for site, start in enumerate(range(0, WORLD, k)):
        wan = [results[r]["hier"]["wan_bytes"] for r in range(start, start + k)]
        flat = results[start]["flat_wan_bytes"]
        assert all(b > 0 for b in wan), f"site {site}: a rank sent nothing between sites: {wan}"
        if _fixed_size(name):
            assert sum(wan) == flat, f"site {site}: {wan} sum to {sum(wan)}, flat sends {flat} per rank"
            assert sum(wan) / k == pytest.approx(flat / k)
        else:
            assert sum(wan) < 2 * flat, f"site {site}: {wan} against flat {flat}"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_each_rank_sends_the_bucket_once_inside_its_site(runs: list[dict[str, Any]], name: str) -> None:
    """Inside a site each rank sends the other shares to their owners and its own decoded share to the k - 1
    others, each share with its flag slot: for k = 2 the bucket's fp32 bytes plus two slots, however unevenly the
    shares split the bucket (here one weight holds most parameters), half of two all-reduces. One bucket."""
    results = _ok(runs, name)
    k = SITES[0]
    for rank, result in enumerate(results):
        hier = result["hier"]
        lengths = hier["share_numels"]
        me = rank % k
        expected = sum(n + 1 for j, n in enumerate(lengths) if j != me) + (k - 1) * (lengths[me] + 1)
        assert hier["lan_bytes"] == 4 * expected, f"rank {rank}"
        assert hier["lan_bytes"] == hier["dense_bytes"] + 4 * 2, f"rank {rank}"
    assert max(lengths) > 2 * min(lengths), "the shares are even: the test would not see padding"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_hierarchical_collectives_per_bucket(runs: list[dict[str, Any]], name: str) -> None:
    """One dense reduce to the shares' owners and one gather from them per bucket on every rank, whatever the
    compressor."""
    results = _ok(runs, name)
    for kind in ("site_reduce", "site_gather"):
        counts = [r["hier"]["collectives"][kind] for r in results]
        assert counts == [STEPS] * WORLD, f"{kind}: {counts}"
    assert all("site_allreduce" not in r["hier"]["collectives"] for r in results)


def test_the_monitor_logs_wan_and_lan_bytes(runs: list[dict[str, Any]]) -> None:
    """`CompressionMonitor` logs the bytes rank 0 put between sites (its share's) and inside its site."""
    run = runs[0]["monitored"]
    logged = run["logged"]
    assert logged["gradcomp/wan_bytes/total"] == run["wan_bytes"] > 0
    assert logged["gradcomp/lan_bytes/total"] == run["lan_bytes"] > 0
    flat = _ok(runs, "terngrad")[0]["flat_wan_bytes"]
    assert logged["gradcomp/wan_bytes/total"] < flat


def test_a_layout_the_world_cannot_take_fails_before_the_first_step(runs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(runs):
        bad = result["bad"]
        assert bad["steps"] == 0, f"rank {rank} trained before refusing"
        assert bad["error"] is not None and "`site_size`" in bad["error"] and "divide the world size 4" in bad["error"]
        assert "Fix:" in bad["error"]


@pytest.mark.parametrize("name", GUARDED)
def test_nan_on_one_rank_of_one_site_skips_the_step_on_every_rank(runs: list[dict[str, Any]], name: str) -> None:
    """Every share's segment in the site's reduce carries the flag slot: a NaN in share 0's gradient on rank 3 (site
    1, owner of share 1) reaches both cross-site groups, so all 4 ranks skip step 2, keep finite residuals, and
    train on identically."""
    results = [r["guard"][name] for r in runs]
    for rank, run in enumerate(results):
        assert "error" not in run, f"rank {rank}:\n{run['error']}"
        history = run["history"]
        assert run["skipped"] == 1 and run["residuals_finite"]
        assert torch.equal(history[1], history[2]), f"rank {rank}: the skipped step changed the parameters"
        assert not torch.equal(history[2], history[3]), "training did not go on after the skipped step"
        for step in range(len(history)):
            assert torch.equal(history[step], results[0]["history"][step]), f"rank {rank} differs after step {step + 1}"


@pytest.mark.parametrize("name", GUARDED)
def test_nan_on_one_rank_of_one_site_raises_on_every_rank_when_asked(runs: list[dict[str, Any]], name: str) -> None:
    """With ``nonfinite='raise'`` the flag slots make every rank of both sites stop at step 2 with the guard's error
    (none hangs waiting for a rank that stopped)."""
    for rank, result in enumerate(runs):
        run = result["guard"][name]
        assert "error" not in run, f"rank {rank}:\n{run['error']}"
        assert run["raised"] is not None, f"rank {rank} did not stop"
        kind, message = run["raised"]
        assert kind == "NonFiniteGradientError" and "Fix:" in message, message


def test_the_planner_works_inside_the_hierarchy(runs: list[dict[str, Any]]) -> None:
    """With `link=` (the link between sites) the planner decides per share on the cross-site group: replicas stay
    identical and training goes on."""
    traces = [r["planner"]["steps"] for r in runs]
    for rank, trace in enumerate(traces):
        assert torch.equal(trace, traces[0]), f"rank {rank} differs from rank 0"
    assert not torch.equal(traces[0][0], traces[0][-1])
