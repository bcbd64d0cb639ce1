"""`ShardedGradCompStrategy(compress_across_nodes=True)` on 4 real Gloo ranks through the Trainer: the model sharded
over every rank, its gradient reduce-scatter dense inside a node and compressed between nodes, as 2 nodes of 2
(ranks 0-1, 2-3; `node_size=2`) and as 4 nodes of 1 (`node_size=1`). The harness runs every rank on one machine: the
nodes are emulated by the groups. One spawned world runs the configurations of the module fixture.
"""

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.compressors.blockint8 import BlockInt8
from tests.distributed.sharded_ranks import fit_configs, stalled_run
from tests.distributed.test_faults import collect_reports
from tests.distributed.test_site_faults import assert_the_others_stopped
from tests.harness import _context, run_ranks

pytestmark = pytest.mark.distributed

#: the model sharded over 2 emulated nodes of 2 ranks (`shard_size` is the world)
ACROSS: dict[str, Any] = {"shard_size": 4, "compress_across_nodes": True, "node_size": 2}
#: ... and over 4 nodes of 1 rank
ACROSS_4x1: dict[str, Any] = dict(ACROSS, node_size=1)

CONFIGS: list[dict[str, Any]] = [
    # stock FSDP2 over the same 4 ranks, no hook
    {"kind": "fsdp", "strategy": {"shard_size": 4}, "gather": True},
    {"strategy": dict(ACROSS, compressor="int8"), "gather": True},
    {"strategy": dict(ACROSS, compressor="fp32"), "gather": True},
    {"strategy": dict(ACROSS_4x1, compressor="fp32"), "gather": True},
    {"strategy": dict(ACROSS_4x1, compressor="int8"), "gather": True},
    {"strategy": dict(ACROSS, compressor="terngrad"), "gather": True},
    {"strategy": dict(ACROSS_4x1, compressor="qsgd"), "gather": True},
    # int4 with block scales (ZeRO++'s qgZ), passed as an instance
    {"strategy": dict(ACROSS, compressor=BlockInt8(bits=4)), "gather": True},
    # a NaN in rank 0's gradient at step 1: skipped on every rank, the int8 residuals rolled back
    {"strategy": dict(ACROSS, compressor="int8"), "nan_at": 1},
    # bad input, refused before the first step
    {"strategy": dict(ACROSS, compressor="graddrop")},
    {"strategy": dict(ACROSS, compressor="powersgd")},
    {"strategy": dict(ACROSS, compressor="int8", shard_size=2)},
    {"strategy": dict(ACROSS, compressor="int8", node_size=3)},
    {"strategy": dict(ACROSS, compressor="int8", node_size=4)},
]
(STOCK, INT8_2x2, FP32_2x2, FP32_4x1, INT8_4x1, TERN_2x2, QSGD_4x1, INT4_2x2, NAN, SPARSE, MULTIROUND, HSDP,
 BAD_NODES, ONE_NODE) = range(len(CONFIGS))

#: FSDP2's dim-0 pieces of the three Linear units over 4 ranks: 4 rows of 8 + 4 biases; 3 rows of 16 + 3; 1 (padded)
#: row of 12 + 1; between nodes each rank sends one piece per unit to each other node's peer
PIECES = (36, 51, 13)
#: the model's padded elements: 4 pieces per unit
NUMEL = 4 * sum(PIECES)


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(fit_configs, 4, CONFIGS, timeout=600.0)


def _run(results: list[list[dict[str, Any]]], i: int) -> list[dict[str, Any]]:
    return [results[r][i] for r in range(4)]


@pytest.mark.parametrize("run", [FP32_2x2, FP32_4x1])
def test_identity_equals_stock_fsdp2_bit_for_bit_every_step(results: list[list[dict[str, Any]]], run: int) -> None:
    """fp32 between nodes runs FSDP2's own reduce-scatter: stock FSDP2's shards bit for bit at every step, on every
    rank, on 2 nodes of 2 and 4 nodes of 1 (the ledger still records the dense bytes per link: below)."""
    stock, ours = _run(results, STOCK), _run(results, run)
    for rank in range(4):
        assert "error" not in ours[rank], ours[rank].get("error")
        assert len(ours[rank]["shards"]) == 4
        for step in range(4):
            assert torch.equal(stock[rank]["shards"][step], ours[rank]["shards"][step]), (run, rank, step)
    assert not torch.equal(ours[0]["shards"][0], ours[0]["shards"][-1]), "nothing trained"


@pytest.mark.parametrize("run", [INT8_2x2, FP32_2x2, FP32_4x1, INT8_4x1, TERN_2x2, QSGD_4x1, INT4_2x2])
def test_every_rank_holds_the_same_model(results: list[list[dict[str, Any]]], run: int) -> None:
    """Every rank gathers the same parameters (FSDP2 makes them identical: each shard is written by its owner alone)
    and the runs move the model the way stock FSDP2 does: the cosine of their updates after 4 steps above 0.9 for
    fp32, int8 and int4, above 0.2 for the stochastic TernGrad and QSGD (AdamW steps by about lr per element whatever a
    gradient's size, so their random sign on small elements shows in full)."""
    runs, stock = _run(results, run), _run(results, STOCK)
    for rank in range(4):
        assert "error" not in runs[rank], runs[rank].get("error")
        assert torch.equal(runs[rank]["full"], runs[0]["full"]), (run, rank)
        assert not any("Expected at least 2 replicas" in w for w in runs[rank]["warnings"])
    start = torch.cat([stock[r]["shards"][0] for r in range(4)])
    ours = torch.cat([runs[r]["shards"][-1] for r in range(4)]) - start
    theirs = torch.cat([stock[r]["shards"][-1] for r in range(4)]) - start
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0)
    assert cosine > (0.2 if run in (TERN_2x2, QSGD_4x1) else 0.9), (run, cosine)


def test_bytes_per_link_are_recorded_exactly(results: list[list[dict[str, Any]]]) -> None:
    """Per rank and step, from the reduce-scatter's ledger: between nodes, one piece per unit to each other node
    (int8: 1 byte an element plus a 4-byte scale per block, each piece one block here; int4: half a byte an element,
    rounded up, plus the scale; fp32: 4 bytes an element;
    a rank's own piece never leaves it), against the same exchange in fp32; inside a node of 2, the other local
    rank's piece of every node, fp32 (none with one rank per node). The replica exchange sends nothing."""
    int8 = sum(p + 4 for p in PIECES)
    int4 = sum(-(-p // 2) + 4 for p in PIECES)
    fp32 = 4 * sum(PIECES)
    expected = {INT8_2x2: (int8, fp32, 4 * 2 * sum(PIECES)), INT4_2x2: (int4, fp32, 4 * 2 * sum(PIECES)),
                FP32_2x2: (fp32, fp32, 4 * 2 * sum(PIECES)),
                INT8_4x1: (3 * int8, 3 * fp32, 0), FP32_4x1: (3 * fp32, 3 * fp32, 0)}
    for run, (wan, dense, lan) in expected.items():
        for rank, r in enumerate(_run(results, run)):
            assert r["strategy_last"] == [wan] * 4, (run, rank, r["strategy_last"])
            assert r["strategy_bytes"] == wan and r["dense_bytes"] == dense, (run, rank)
            assert r["lan"] == [lan] * 4, (run, rank, r["lan"])
            assert r["bytes"] == [0] * 4
    assert (int4, int8, fp32, NUMEL) == (63, 112, 400, 400)  # 6.3x and 3.6x fewer bytes between nodes
    # TernGrad's 2-bit (or summed int8) pieces and QSGD's 4-bit ones: well below fp32
    for run in (TERN_2x2, QSGD_4x1):
        for r in _run(results, run):
            assert all(0 < b < d / 2 for b, d in zip(r["strategy_last"], [r["dense_bytes"]] * 4)), (run, r)


def test_a_nonfinite_step_is_skipped_on_every_rank_and_its_residuals_rolled_back(
    results: list[list[dict[str, Any]]],
) -> None:
    """Rank 0's NaN reaches one rank's shard through the int8 codes (its block's scale is NaN); the guard on that
    shard skips the step on every rank, and training goes on finite (the residuals of the skipped step rolled back)."""
    runs = _run(results, NAN)
    for rank in range(4):
        assert "error" not in runs[rank], runs[rank].get("error")
        assert runs[rank]["skipped"] == [0, 1, 1, 1], rank
        assert torch.equal(runs[rank]["shards"][0], runs[rank]["shards"][1]), f"rank {rank} stepped at the NaN step"
        assert not torch.equal(runs[rank]["shards"][1], runs[rank]["shards"][3])
        assert torch.isfinite(runs[rank]["shards"][3]).all()
        residuals = runs[rank]["across_residuals"]
        assert torch.equal(residuals[0], residuals[1]), f"rank {rank} kept the skipped step's residuals"
        assert not torch.equal(residuals[1], residuals[2]) and torch.isfinite(residuals[3]).all()


def test_bad_input_is_refused_before_the_first_step(results: list[list[dict[str, Any]]]) -> None:
    expected = {
        SPARSE: "Expected a compressor that encodes every element of a piece for the compressed reduce-scatter, but "
                "got GradientDropping",
        MULTIROUND: "Expected a one-round compressor for the compressed reduce-scatter, but got PowerSGD",
        HSDP: "Expected `shard_size` to be the world size (4 ranks) or None with `compress_across_nodes=True`",
        BAD_NODES: "Expected `node_size` to divide the world size (4 ranks), but got 3",
        ONE_NODE: "Expected at least 2 nodes for the compressed reduce-scatter across nodes, but got one",
    }
    for run, message in expected.items():
        for rank in range(4):
            result = results[rank][run]
            assert result.get("steps_done") == 0, (run, rank, result)
            assert message in result["error"] and "Fix:" in result["error"], (run, rank, result["error"])


def test_resume_is_exact(tmp_path: Path) -> None:
    """8 steps straight against 4 steps, the checkpoint of the first epoch's end (a `torch.distributed.checkpoint`
    directory, every rank's residuals of the reduce-scatter in its compression state), and 4 more: the shards match
    bit for bit at every resumed step on every rank, for blockwise int8 (error feedback) on 2 nodes of 2 and TernGrad
    (its random streams) on 4 nodes of 1, with momentum SGD. The same int8 checkpoint resumed with
    `resume_compression="reset"` differs (the residuals made a difference); resumed with `node_size=1` it is refused
    before the first step, naming both node layouts."""
    configs: list[dict[str, Any]] = []
    for name, strategy in (("int8", dict(ACROSS, compressor="int8")), ("tern", dict(ACROSS_4x1, compressor="terngrad"))):
        path = str(tmp_path / name)
        resume = str(tmp_path / name / "epoch=0-step=4.ckpt")
        configs += [
            {"strategy": strategy, "optimizer": "sgd", "steps": 8},
            {"strategy": strategy, "optimizer": "sgd", "steps": 4, "save": path},
            {"strategy": strategy, "optimizer": "sgd", "steps": 8, "resume": resume},
        ]
    configs.append({"strategy": dict(configs[0]["strategy"], resume_compression="reset"), "optimizer": "sgd",
                    "steps": 8, "resume": configs[2]["resume"]})
    # the int8 checkpoint of 2 nodes of 2 on 4 nodes of 1: each residual is another piece's, refused
    configs.append({"strategy": dict(configs[0]["strategy"], node_size=1), "optimizer": "sgd", "steps": 8,
                    "resume": configs[2]["resume"]})
    results = run_ranks(fit_configs, 4, configs, timeout=500.0)
    for rank in range(4):
        for first in (0, 3):
            straight, resumed = results[rank][first]["shards"], results[rank][first + 2]
            assert "error" not in resumed, resumed.get("error")
            assert len(resumed["shards"]) == 4
            for step in range(4):
                assert torch.equal(straight[4 + step], resumed["shards"][step]), (first, rank, 4 + step)
            assert resumed["strategy_bytes"] == results[rank][first]["strategy_bytes"], rank
        assert not torch.equal(results[rank][0]["shards"][4], results[rank][6]["shards"][0]), "residuals unused"
        refused = results[rank][7]
        assert refused.get("steps_done") == 0, (rank, refused)
        assert ("Expected the checkpoint's reduce-scatter state to come from nodes [1, 1, 1, 1] (`node_size=1`) as "
                "this run, but got one written with nodes [2, 2]") in refused["error"], refused["error"]
        assert "Fix: resume with `node_size=2`" in refused["error"]


def test_a_stalled_rank_stops_every_other_rank_within_the_timeout() -> None:
    """Rank 2 sleeps 40 s at step 2 with `timeout` 3 s: the node and peer groups of the reduce-scatter, and the
    mesh's, were made with that timeout, so every other rank stops with the library's message within 20 s instead of
    torch's 30-minute default."""
    options = dict(ACROSS, compressor="int8")
    reports = collect_reports(stalled_run, 4, (2, 3.0, 40.0, options), 3, context=_context())
    assert_the_others_stopped(reports, {0, 1, 3}, within_s=20.0)


def test_a_killed_rank_stops_every_other_rank_within_the_timeout() -> None:
    """Rank 2 is SIGKILLed at step 2 (TernGrad between 4 nodes of 1, `timeout` 30 s): every other rank stops with
    the library's message well within the timeout (the dead rank's connections close)."""
    options = dict(ACROSS_4x1, compressor="terngrad")
    reports = collect_reports(stalled_run, 4, (2, 30.0, 0.0, options, True), 3, context=_context())
    assert_the_others_stopped(reports, {0, 1, 3}, within_s=20.0)
