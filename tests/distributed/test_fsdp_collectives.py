"""The compressed reduce-scatter across nodes on 4 real Gloo ranks: 2 nodes of 2 (ranks 0-1, 2-3), and 4 nodes of 1.

One spawned world runs every configuration (spawns are expensive).
"""

from typing import Any

import pytest
import torch

from lightning_gradcomp.compressors.blockint8 import BlockInt8
from tests.distributed.fsdp_collectives_ranks import run_configs
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

CONFIGS: list[dict[str, Any]] = [
    {"exact": True},  # stock FSDP2
    {"exact": True, "node_size": 2, "compressor": "fp32"},
    {},  # stock FSDP2, random data
    {"node_size": 1, "compressor": "fp32"},
    {"node_size": 2, "compressor": "fp32"},
    {"node_size": 2, "compressor": "int8"},
    {"node_size": 1, "compressor": "int8"},
    # bad input, refused before step 0
    {"node_size": 2, "compressor": "topk"},
    {"node_size": 2, "compressor": "powersgd"},
    {"node_size": 3, "compressor": "int8"},
    {"node_size": 2, "compressor": "int8", "hsdp": True},
    {"node_size": 2, "compressor": "int8", "permuted": True},
    # a NaN in rank 1's input at step 2 (the last)
    {"node_size": 2, "compressor": "int8", "nan_at": 2},
    # the library's compressors between nodes: TernGrad (summed as int8 ternaries or gathered, 2 bits an element),
    # QSGD (gathered), 1-bit SGD (gathered, with error feedback)
    {"node_size": 2, "compressor": "terngrad"},
    {"node_size": 1, "compressor": "terngrad"},
    {"node_size": 2, "compressor": "qsgd"},
    {"node_size": 1, "compressor": "qsgd"},
    {"node_size": 2, "compressor": "onebit"},
    # int4 with block scales (ZeRO++'s qgZ), one batch 8 times
    {"node_size": 2, "compressor": BlockInt8(bits=4), "fixed": True, "steps": 8},
]
(STOCK_EXACT, FP32_EXACT, STOCK, FP32_4x1, FP32_2x2, INT8_2x2, INT8_4x1, TOPK, POWERSGD, BAD_NODES, HSDP, PERMUTED, NAN,
 TERN_2x2, TERN_4x1, QSGD_2x2, QSGD_4x1, ONEBIT_2x2, INT4_2x2) = range(len(CONFIGS))
#: the model's parameters: 8*16+16 + 16*12+12 + 12*4+4
NUMEL = 400


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(run_configs, 4, CONFIGS, timeout=300.0)


def _run(results: list[list[dict[str, Any]]], i: int) -> list[dict[str, Any]]:
    return [results[r][i] for r in range(4)]


def test_identity_equals_stock_fsdp2_bit_for_bit(results: list[list[dict[str, Any]]]) -> None:
    """The identity between nodes runs FSDP2's own reduce-scatter: its gradients and shards are stock FSDP2's bit
    for bit at every step, on 2 nodes of 2 and 4 nodes of 1, on exact and on random data."""
    for stock, ours in ((STOCK_EXACT, FP32_EXACT), (STOCK, FP32_4x1), (STOCK, FP32_2x2)):
        for rank in range(4):
            a, b = results[rank][stock], results[rank][ours]
            assert len(b["local"]) == 3
            for step in range(3):
                assert torch.equal(a["grads"][step], b["grads"][step]), (ours, rank, step)
                assert torch.equal(a["local"][step], b["local"][step]), (ours, rank, step)
                assert torch.equal(a["full"][step], b["full"][step]), (ours, rank, step)
    # the exact run trains (its gradients are not all zero)
    assert not torch.equal(results[0][FP32_EXACT]["full"][0], results[0][FP32_EXACT]["full"][-1])


@pytest.mark.parametrize("run", [FP32_2x2, INT8_2x2, INT8_4x1, TERN_2x2, TERN_4x1, QSGD_2x2, QSGD_4x1, ONEBIT_2x2,
                                 INT4_2x2])
def test_every_rank_holds_the_same_model(results: list[list[dict[str, Any]]], run: int) -> None:
    runs = _run(results, run)
    for step in range(3):
        assert all(torch.equal(runs[0]["full"][step], r["full"][step]) for r in runs), step
    assert not torch.equal(runs[0]["full"][0], runs[0]["full"][-1])


def test_int8_is_close_to_stock_and_keeps_its_error(results: list[list[dict[str, Any]]]) -> None:
    stock, int8 = results[0][STOCK]["full"][-1], results[0][INT8_2x2]["full"][-1]
    start = results[0][STOCK]["full"][0]
    assert not torch.equal(stock, int8)  # quantized
    assert (int8 - stock).abs().max() < 0.05 * (stock - start).abs().max() + 1e-6
    assert all(results[0][INT8_2x2]["units"])  # a residual per unit


def test_bytes_between_and_inside_nodes_are_recorded_exactly(results: list[list[dict[str, Any]]]) -> None:
    """Per rank and step, the sum over units of what leaves the rank. Each unit's gradients are split into 4 pieces
    (FSDP2's dim-0 shards: 36, 51 and 13 elements per piece for the three Linear units, 100 in all). Between 2 nodes,
    one piece to the other peer: fp32 4 bytes an element, int8 1 byte plus one fp32 scale per started block of 256;
    between 4 nodes of 1, three pieces. Inside a node of 2, the two pieces of the other local rank (one per node)."""
    pieces = [36, 51, 13]
    assert 4 * sum(pieces) == NUMEL
    int8 = sum(p + 4 * -(-p // 256) for p in pieces)
    for rank in range(4):
        runs = results[rank]
        assert runs[FP32_2x2]["wan"] == [4 * 100] * 3
        assert runs[FP32_2x2]["lan"] == [4 * 2 * 100] * 3
        assert runs[INT8_2x2]["wan"] == [int8] * 3 == [112] * 3
        assert runs[INT8_2x2]["lan"] == [4 * 2 * 100] * 3
        # the fp32 reference of the same exchange
        assert runs[INT8_2x2]["dense"] == runs[FP32_2x2]["dense"] == runs[FP32_2x2]["wan"]
        assert runs[INT8_4x1]["dense"] == [4 * 3 * 100] * 3
        assert runs[INT8_4x1]["wan"] == [3 * int8] * 3
        assert runs[INT8_4x1]["lan"] == [0] * 3


def test_int4_sends_half_a_byte_an_element_and_trains(results: list[list[dict[str, Any]]]) -> None:
    """int4 with block scales between 2 nodes of 2: per rank and step, one piece per unit to the other node's peer,
    two codes a byte plus one fp32 scale per started block of 256 (pieces 36, 51, 13: 18 + 26 + 7 + 3 * 4 bytes),
    dense inside a node; every rank holds the same model; the loss of one batch falls at every one of 8 steps; a residual per
    unit and piece (error feedback)."""
    pieces = [36, 51, 13]
    int4 = sum(-(-p // 2) + 4 * -(-p // 256) for p in pieces)
    assert int4 == 63
    for rank in range(4):
        run = results[rank][INT4_2x2]
        assert "error" not in run, run.get("error")
        assert run["wan"] == [int4] * 8, (rank, run["wan"])
        assert run["lan"] == [4 * 2 * 100] * 8
        assert run["dense"] == [4 * 100] * 8
        assert run["residual_numels"] == {f"{u}/node{m}": p for u, p in zip("024", pieces) for m in range(2)}
    losses = [sum(results[rank][INT4_2x2]["loss"][step] for rank in range(4)) for step in range(8)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("run", [TERN_2x2, TERN_4x1, QSGD_2x2, QSGD_4x1, ONEBIT_2x2])
def test_the_library_compressors_train_close_to_stock_with_their_bytes(
    results: list[list[dict[str, Any]]], run: int,
) -> None:
    """TernGrad, QSGD and 1-bit SGD between nodes through the group step: 3 steps move the model the way stock
    FSDP2's do (cosine above 0.5), each piece's packet recorded (a rank's own piece is not: it never leaves), far
    below the fp32 reference."""
    stock, ours = results[0][STOCK]["full"], results[0][run]["full"]
    assert not torch.equal(stock[-1], ours[-1])
    assert torch.nn.functional.cosine_similarity(ours[-1] - stock[0], stock[-1] - stock[0], dim=0) > 0.5
    for rank in range(4):
        runs = results[rank]
        assert all(0 < b < d / 4 for b, d in zip(runs[run]["wan"], runs[run]["dense"])), (run, rank, runs[run]["wan"])
        assert runs[run]["dense"] == runs[INT8_4x1 if runs[run]["lan"] == [0] * 3 else INT8_2x2]["dense"]


def test_error_feedback_is_kept_per_piece(results: list[list[dict[str, Any]]]) -> None:
    """Compressors with error feedback (blockwise int8, 1-bit SGD) keep one residual per unit and piece of this
    rank (its node's sum for every owner): nodes x piece elements per unit; the others keep none."""
    pieces = {"0": 36, "2": 51, "4": 13}
    for rank in range(4):
        for run, nodes in ((INT8_2x2, 2), (INT8_4x1, 4), (ONEBIT_2x2, 2)):
            numels = results[rank][run]["residual_numels"]
            assert numels == {f"{u}/node{m}": p for u, p in pieces.items() for m in range(nodes)}, (run, numels)
        assert results[rank][QSGD_2x2]["residual_numels"] == {}


def test_bad_input_is_refused_before_the_first_step(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        error = results[rank][TOPK]["error"]
        assert "Expected a compressor that encodes every element of a piece for the compressed reduce-scatter, but " \
            "got TopK" in error and "Fix:" in error
        error = results[rank][POWERSGD]["error"]
        assert "Expected a one-round compressor for the compressed reduce-scatter, but got PowerSGD" in error
        assert "Fix:" in error
        error = results[rank][BAD_NODES]["error"]
        assert "Expected `node_size` to divide the world size (4 ranks), but got 3" in error
        error = results[rank][HSDP]["error"]
        assert "Expected every unit sharded over all 4 ranks" in error and "sharded over 2" in error
        error = results[rank][PERMUTED]["error"]
        assert "Expected the mesh of `fully_shard` to list the ranks in order (0 .. 3)" in error
        assert "[1, 0, 3, 2]" in error


def test_a_nonfinite_gradient_reaches_every_rank_non_finite_and_spares_the_residuals(
    results: list[list[dict[str, Any]]],
) -> None:
    """As under stock FSDP2, a NaN in one rank's gradients is not hidden by the int8 codes (its block's scale travels
    NaN); the residual of that step is dropped, not kept NaN."""
    for rank in range(4):
        run = results[rank][NAN]
        assert all(torch.isfinite(g).all() for g in run["grads"][:2]), rank
        assert not torch.isfinite(run["grads"][2]).all(), rank
        assert run["residuals_finite"], rank
