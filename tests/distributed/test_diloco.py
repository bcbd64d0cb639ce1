"""DiLoCo on 4 real Gloo ranks: 2 sites of 2 and 4 sites of 1 (one spawned world runs every configuration)."""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.diloco_ranks import fit_configs, resume, resume_with_another_layout
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

PLAIN = {"outer_lr": 1.0, "outer_momentum": 0.0, "compressor": "fp32", "sync_every": 1}
CONFIGS: list[dict[str, Any]] = [
    # 0: 2 sites of 2, AdamW-style inner steps, dense DiLoCo (Nesterov 0.7/0.9), H = 3
    {"model": "adam", "steps": 7, "diloco": {"site_size": 2, "sync_every": 3}},
    # 1: 4 sites of 1, int8 pseudo-gradients (all-reduce with a shared scale), H = 2
    {"model": "adam", "steps": 6, "diloco": {"sync_every": 2, "compressor": "int8"}},
    # 2-4: H = 1, identity, outer SGD lr 1 without momentum == plain DDP (inner SGD without momentum)
    {"steps": 5, "diloco": dict(PLAIN)},
    {"steps": 5, "diloco": dict(PLAIN, site_size=2)},
    {"steps": 5, "strategy": "ddp"},
    # 5: 2 sites of 2, SparseLoCo's top-k with 2-bit values and error feedback, PowerSGD-free gather path
    {"model": "adam", "steps": 6, "diloco": {"site_size": 2, "sync_every": 2, "compressor": "sparseloco",
                                             "outer_lr": 1.0, "outer_momentum": 0.0}},
    # 6: 4 sites of 1, TernGrad (shared max scaler), multi-round PowerSGD in 7
    {"model": "adam", "steps": 4, "diloco": {"sync_every": 2, "compressor": "terngrad"}},
    {"model": "adam", "steps": 4, "diloco": {"site_size": 2, "sync_every": 2, "compressor": "powersgd"}},
    # 8: streaming: 3 strided fragments (one per Linear), H = 6 (syncs at 2, 4, 6 of each window), each landing
    # one step after its launch, mixing 0.5
    {"model": "adam", "steps": 8, "diloco": {"sync_every": 6, "fragments": 3, "sync_delay": 1, "mixing": 0.5}},
    # 9: the monitor logs the outer statistics
    {"model": "adam", "steps": 4, "monitor": True, "diloco": {"sync_every": 2, "compressor": "int8"}},
    # 10-11: the replica check every step on 2 sites of 2: ranks of a site every step, every rank after each round;
    # in 11 rank 1 leaves its site's weights before step 1's update, so every rank raises there
    {"model": "adam", "steps": 4, "diloco": {"site_size": 2, "sync_every": 3, "check_replicas_every": 1}},
    {"model": "adam", "steps": 4, "perturb": (1, 1),
     "diloco": {"site_size": 2, "sync_every": 3, "check_replicas_every": 1}},
]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(fit_configs, 4, CONFIGS, timeout=400.0)


def _runs(results: list[list[dict[str, Any]]], i: int) -> list[dict[str, Any]]:
    return [results[r][i] for r in range(4)]


def _check(runs: list[dict[str, Any]], site_size: int, sync_every: int) -> None:
    """Ranks of a site identical every step; every rank identical right after every round; between rounds the
    sites drift apart; the outer group talks only at rounds, the inner DDP only inside the site."""
    steps = len(runs[0]["params"])
    for step in range(steps):
        p = [runs[r]["params"][step] for r in range(4)]
        for first in range(0, 4, site_size):
            for r in range(first, first + site_size):
                assert torch.equal(p[first], p[r]), f"rank {r} differs from its site's rank {first} at step {step}"
        synced = (step + 1) % sync_every == 0
        if synced:
            assert all(torch.equal(p[0], p[r]) for r in range(4)), f"sites differ right after the round at step {step}"
            assert int(runs[0]["stats"][step]["inner_steps_since_sync"]) == 0
        elif step > 0 and sync_every > 1:
            assert not torch.equal(p[0], p[site_size]), f"sites identical between rounds at step {step}"
        before = runs[0]["outer_collectives"][step - 1] if step else 0
        assert (runs[0]["outer_collectives"][step] > before) == synced, f"outer collectives at inner step {step}"
        assert runs[0]["inner_world"][step] == site_size
    assert int(runs[0]["stats"][-1]["rounds"]) == steps // sync_every


def test_two_sites_of_two_agree_inside_and_after_every_round(results: list[list[dict[str, Any]]]) -> None:
    runs = _runs(results, 0)
    _check(runs, site_size=2, sync_every=3)
    # only leaders put bytes between sites: dense fp32 is 4 bytes per element per round
    numel = runs[0]["params"][0].numel()
    assert int(runs[0]["stats"][2]["bytes_per_round"]) == 4 * numel
    assert int(runs[1]["stats"][2]["bytes_per_round"]) == 0


def test_four_single_rank_sites_with_int8_pseudo_gradients(results: list[list[dict[str, Any]]]) -> None:
    runs = _runs(results, 1)
    _check(runs, site_size=1, sync_every=2)
    numel = runs[0]["params"][0].numel()
    # one int8 per element plus one float32 shared scale per tensor (6 tensors)
    assert int(runs[0]["stats"][1]["bytes_per_round"]) == numel + 4 * 6
    # per rank and inner step over the run, an int (ByteReport): 3 rounds over 6 steps, floored
    assert isinstance(runs[0]["bytes_per_step"], int) and runs[0]["bytes_per_step"] == 3 * (numel + 24) // 6


@pytest.mark.parametrize("index", [2, 3], ids=["4x1", "2x2"])
def test_sync_every_step_with_plain_averaging_equals_ddp(results: list[list[dict[str, Any]]], index: int) -> None:
    diloco, ddp = _runs(results, index), _runs(results, 4)
    for step in range(5):
        for r in range(4):
            torch.testing.assert_close(diloco[r]["params"][step], ddp[r]["params"][step], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index", [5, 6, 7], ids=["sparseloco", "terngrad", "powersgd"])
def test_compressed_pseudo_gradients_keep_sites_identical(results: list[list[dict[str, Any]]], index: int) -> None:
    runs = _runs(results, index)
    site_size = 2 if index in (5, 7) else 1
    _check(runs, site_size=site_size, sync_every=2)
    numel = runs[0]["params"][0].numel()
    assert 0 < int(runs[0]["stats"][1]["bytes_per_round"]) < 4 * numel / 3


@pytest.mark.parametrize(
    "options",
    [
        {"site_size": 2, "sync_every": 3, "compressor": "sparseloco"},
        # fragment 1 syncs at step 4 and lands at 5: the checkpoint at 4 holds an exchange in flight
        {"sync_every": 4, "fragments": 2, "sync_delay": 1, "mixing": 0.5, "compressor": "int8"},
    ],
    ids=["diloco-2x2-sparseloco", "streaming-4x1-in-flight"],
)
def test_diloco_resume_mid_window_is_bit_identical(tmp_path: Path, options: dict[str, Any]) -> None:
    results = run_ranks(resume, 4, str(tmp_path), 7, 4, options, timeout=400)
    for rank, r in enumerate(results):
        assert torch.equal(r["full"], r["resumed"]), f"rank {rank}: resume differs from the uninterrupted run"
    assert any(not torch.equal(r["full"], r["reset"]) for r in results)


def test_streaming_fragments_sync_staggered_and_land_after_the_delay(results: list[list[dict[str, Any]]]) -> None:
    runs = _runs(results, 8)
    # fragment p launches at 2(p+1) (+6k) and lands one step later: rounds counted when applied
    applied = [int(runs[0]["stats"][step]["rounds"]) for step in range(8)]
    assert applied == [0, 0, 1, 1, 2, 2, 3, 3]
    launched = runs[0]["outer_collectives"]
    assert [launched[s] > (launched[s - 1] if s else 0) for s in range(8)] == [
        False, True, False, True, False, True, False, True]
    # with mixing 0.5 a site keeps half of its own weights: sites stay apart, each site's ranks identical
    assert not torch.equal(runs[0]["params"][-1], runs[1]["params"][-1])


def test_monitor_logs_outer_bytes_rounds_norms_and_staleness(results: list[list[dict[str, Any]]]) -> None:
    logged = dict(results[0][9]["logged"])  # rank 0 logs; step -> metrics
    numel = results[0][9]["params"][0].numel()
    last = logged[max(logged)]
    assert last["gradcomp/diloco/rounds"] == 2
    assert last["gradcomp/diloco/bytes_per_round"] == numel + 24
    assert last["gradcomp/diloco/compression_ratio"] == pytest.approx(4 * numel / (numel + 24))
    assert last["gradcomp/diloco/inner_steps_since_sync"] == 0
    assert last["gradcomp/diloco/pseudo_gradient_norm/fragment_0"] > 0
    assert "gradcomp/diloco/sync_seconds/fragment_0" in last and "gradcomp/diloco/bytes_per_token" in last
    # tokens: the first integer tensor of a batch; the classifier's is its 16 labels per step
    assert last["gradcomp/diloco/bytes_per_token"] == pytest.approx(2 * (numel + 24) / (4 * 16))
    # between rounds the counter runs: logged at the step after a round
    assert any(m.get("gradcomp/diloco/inner_steps_since_sync") == 1 for m in logged.values())


def test_resume_with_another_site_layout_is_refused_on_every_rank(tmp_path: Path) -> None:
    messages = run_ranks(resume_with_another_layout, 4, str(tmp_path), timeout=300)
    for message in messages:
        assert "Expected the site layout [1, 1, 1, 1] of the checkpoint, but got [2, 2]" in message and "Fix:" in message


def test_replica_check_compares_the_ranks_of_each_site_and_every_rank_after_a_round(
        results: list[list[dict[str, Any]]]) -> None:
    checked = _runs(results, 10)
    assert all(r["error"] is None for r in checked), [r["error"] for r in checked]
    _check(checked, site_size=2, sync_every=3)
    for rank, r in enumerate(_runs(results, 11)):
        assert r["error"] is not None, f"rank {rank} did not raise"
        kind, message = r["error"]
        assert kind == "ReplicaDivergenceError", message
        assert "step 1" in message and "rank(s) [1] differs from rank 0" in message, message
        assert "the ranks of each site must hold the same parameters" in message, message
