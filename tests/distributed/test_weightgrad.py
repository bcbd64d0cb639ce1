"""WeightGrad on 4 real Gloo ranks in 2 sites of 2 (one spawned world runs every configuration)."""

from typing import Any

import pytest
import torch

from tests.distributed.weightgrad_ranks import fit_configs, site_transport
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 7
CONFIGS: list[dict[str, Any]] = [
    # 0: the default system (TernGrad in site, dynamic G_thresh, loss-aware ternary WAN with Adam's v), T = 3
    {"model": "adam", "steps": STEPS, "weightgrad": {"site_size": 2, "staleness_bound": 3}},
    # 1-2: parity: threshold 0, T = 1, quantization off  vs  plain DDP over all 4 ranks
    {"steps": 5, "weightgrad": {"site_size": 2, "staleness_bound": 1, "threshold": 0.0, "compressor": "fp32",
                                "wan_quantization": "none"}},
    {"steps": 5, "strategy": "ddp"},
    # 3-4: serial per-worker application (Alg. 4) under plain SGD == DDP with the LR times the site size
    {"steps": 5, "momentum": 0.0, "weightgrad": {"site_size": 2, "staleness_bound": 1, "threshold": 0.0,
                                                 "compressor": "fp32", "wan_quantization": "none",
                                                 "aggregation": "serial"}},
    {"steps": 5, "momentum": 0.0, "lr": 0.2, "strategy": "ddp"},
    # 5: serial with TernGrad, stochastic ternary WAN, layer significance, significance trigger, time bound
    {"steps": STEPS, "weightgrad": {"site_sizes": [2, 2], "staleness_bound": 4, "aggregation": "serial",
                                    "wan_quantization": "terngrad", "significance": "element",
                                    "trigger": "significance", "staleness_seconds": 60.0}},
    # 6: the registered name with its defaults: one site per node (here one node, so one site of 4)
    {"steps": 3, "strategy": "weightgrad"},
]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(fit_configs, 4, CONFIGS, timeout=240.0)


def _check_sites(runs: list[dict[str, Any]], bound: int) -> int:
    """Workers of a site identical every step; all ranks identical after every WAN round. Returns the rounds."""
    rounds = 0
    for step in range(len(runs[0]["params"])):
        p = [runs[r]["params"][step] for r in range(4)]
        assert torch.equal(p[0], p[1]) and torch.equal(p[2], p[3]), f"site replicas differ at step {step}"
        staleness = int(runs[0]["stats"][step]["staleness"])
        assert staleness < bound
        if staleness == 0:
            rounds += 1
            assert torch.equal(p[0], p[2]), f"sites differ right after the round at step {step}"
    assert rounds == int(runs[0]["stats"][-1]["wan_rounds"])
    return rounds


def test_default_weightgrad_sites_agree(results: list[list[dict[str, Any]]]) -> None:
    runs = [results[r][0] for r in range(4)]
    rounds = _check_sites(runs, bound=3)
    assert rounds == STEPS // 3
    # between rounds the sites train on their own data and drift apart
    assert not torch.equal(runs[0]["params"][0], runs[2]["params"][0])
    round_step = max(i for i, s in enumerate(runs[0]["stats"]) if int(s["staleness"]) == 0)
    last = [runs[r]["stats"][round_step] for r in range(4)]
    wan = [int(s["wan_bytes"]) for s in last]
    assert all(int(runs[r]["stats"][round_step + 1]["wan_bytes"]) == 0 for r in range(4)), "no WAN between rounds"
    assert wan[0] > 0 and wan[2] > 0 and wan[1] == 0 and wan[3] == 0, "only leaders talk over the WAN"
    dense = 4 * runs[0]["params"][0].numel()
    assert wan[0] < dense / 8, "ternary WAN message should be far below fp32"
    assert all(int(s["lan_bytes"]) > 0 for s in last)
    fractions = [v for k, v in last[0].items() if k.startswith("fraction_significant/")]
    thresholds = [v for k, v in last[0].items() if k.startswith("g_thresh/")]
    assert fractions and all(0.0 <= float(f) <= 1.0 for f in fractions)
    assert thresholds and all(float(t) > 0 for t in thresholds)


def test_threshold_zero_bound_one_unquantized_matches_ddp(results: list[list[dict[str, Any]]]) -> None:
    for r in range(4):
        ours, ddp = results[r][1]["params"], results[r][2]["params"]
        for step, (a, b) in enumerate(zip(ours, ddp)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {r} step {step}")
    _check_sites([results[r][1] for r in range(4)], bound=1)


def test_serial_application_is_one_step_per_worker(results: list[list[dict[str, Any]]]) -> None:
    for r in range(4):
        for a, b in zip(results[r][3]["params"], results[r][4]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_serial_terngrad_with_significance_trigger(results: list[list[dict[str, Any]]]) -> None:
    runs = [results[r][5] for r in range(4)]
    rounds = _check_sites(runs, bound=4)
    assert rounds >= STEPS // 4
    # a step's bytes between sites: the trigger's two flag bytes from each leader every step, plus the round's
    for r in range(4):
        for step, s in enumerate(runs[r]["stats"]):
            flags = 2 if r % 2 == 0 else 0
            round_bytes = int(s.get("bytes_per_round", 0)) if int(s["staleness"]) == 0 else 0
            assert int(s["wan_bytes"]) == flags + round_bytes, f"rank {r} step {step}"


def test_registered_name_defaults_to_one_site_per_node(results: list[list[dict[str, Any]]]) -> None:
    runs = [results[r][6] for r in range(4)]
    for step in range(3):
        assert all(torch.equal(runs[0]["params"][step], runs[r]["params"][step]) for r in range(4))
    assert int(runs[0]["stats"][-1]["wan_bytes"]) == 0  # a single site has nobody to talk to over a WAN


def test_site_leaders_transport_is_the_flat_collectives_over_the_sites() -> None:
    """On 2 sites of 2 Gloo ranks, each site's data on its leader: max, sum, the size table and the gather give what
    the flat collectives over the sites give (site 0's and site 1's values combined, in site order), bit-identical on
    every rank; the hook's exchange over the transport averages the sites' WAN messages, sending one int64 length
    ahead of each; leaders count what they broadcast inside their site."""
    results = run_ranks(site_transport, 4, timeout=120.0)
    sites = [torch.arange(5.0) * (1 + s) - 3 * s for s in range(2)]
    for rank, out in enumerate(results):
        assert (out["site"], out["world_size"], out["rank"]) == (rank // 2, 2, rank // 2)
        assert torch.equal(out["max"], torch.maximum(sites[0], sites[1]))
        assert torch.equal(out["sum"], sites[0] + sites[1])
        assert torch.equal(out["sizes"], torch.stack([s[:3] for s in sites]).to(torch.int64))
        assert torch.equal(out["gather"], torch.stack([s[:4] for s in sites]))
        assert torch.equal(out["mean"], (results[0]["own"] + results[2]["own"]) / 2)
        for key in ("max", "sum", "sizes", "gather", "mean"):
            assert torch.equal(out[key], results[0][key]), f"rank {rank} {key}"
        leader = rank % 2 == 0
        # the leader's broadcasts: max and sum (5 fp32), the size table (2 x 3 int64), the gathered rows (2 x 4 fp32)
        assert out["lan_collectives"] == (20 + 20 + 48 + 32 if leader else 0)
        longest = max(results[0]["message_bytes"], results[2]["message_bytes"])
        assert out["lan_round"] == (2 * 8 + 2 * longest if leader else 0)
        assert out["wan_bytes"] == out["message_bytes"] + 8  # the message and its int64 length
    assert results[0]["message_bytes"] != results[2]["message_bytes"]  # the sites' messages differ in length
