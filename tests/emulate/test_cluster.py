"""The emulated cluster: ranks in network namespaces behind rate-limited links (needs root and iproute2)."""

import io
import re
import sys
from pathlib import Path

import pytest

from gradcomp_lab.emulate import (
    Cluster,
    EmulationUnavailable,
    RankFailed,
    check_available,
    list_namespaces,
    run_on_cluster,
)

try:
    check_available()
    _REASON = ""
except EmulationUnavailable as exc:
    _REASON = f"emulated cluster unavailable: {exc}"

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(bool(_REASON), reason=_REASON)]

SCRIPT = str(Path(__file__).with_name("allreduce_script.py"))
NUMEL = 2_000_000  # 8 MB: 0.64 s at 100 Mbit/s for 2 ranks (each sends half the vector twice)


def _run(cluster: Cluster, **env: str) -> list[float]:
    out = io.StringIO()
    root = str(Path(__file__).resolve().parents[2])
    run_on_cluster(cluster, [sys.executable, SCRIPT], timeout=120, env={"PYTHONPATH": root, **env}, out=out)
    found = re.findall(r"RESULT rank=(\d) value=(\S+) seconds=(\S+)", out.getvalue())
    assert sorted(int(r) for r, _, _ in found) == list(range(cluster.nproc)), out.getvalue()
    assert all(float(v) == cluster.nproc**2 for _, v, _ in found)  # two all-reduces of ones
    return [float(s) for _, _, s in found]


def test_two_ranks_rate_limit_and_cleanup() -> None:
    with Cluster(2, float("inf")) as fast:
        unlimited = max(_run(fast, NUMEL=str(NUMEL)))
        prefix = fast.prefix
        assert len(list_namespaces(prefix)) == 3  # 2 ranks + the switch
    with Cluster(2, 100e6) as slow:
        limited = max(_run(slow, NUMEL=str(NUMEL)))
    expected = 8 * 4 * NUMEL / 100e6
    assert 0.7 * expected < limited < 2.0 * expected, (limited, expected)
    assert limited > 4 * unlimited, (limited, unlimited)
    assert list_namespaces(prefix) == []


def test_failing_rank_kills_all_and_cleans_up() -> None:
    cluster = Cluster(2, 1e9)
    with pytest.raises(RankFailed, match="rank 1 exited with status 3"):
        with cluster:
            _run(cluster, FAIL_RANK="1")  # rank 0 would wait for rank 1 forever: it must be killed
    assert list_namespaces(cluster.prefix) == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="sites"):
        Cluster(3, 1e9, sites=2, wan_bandwidth=1e8)
    with pytest.raises(ValueError, match="wan_bandwidth"):
        Cluster(4, 1e9, sites=2)
