"""The quantized weight all-gather across nodes on 4 real Gloo ranks: 2 nodes of 2 (ranks 0-1, 2-3), and 4 nodes
of 1; directly (``QuantizedAllGather``) and through the Trainer (``ShardedGradCompStrategy(quantize_weights=True)``).

One spawned world runs every configuration (spawns are expensive).
"""

from typing import Any

import pytest
import torch

from tests.distributed.fsdp_all_gather_ranks import dequantized, run_configs
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

#: the strategy across 2 emulated nodes of 2 ranks (the harness runs every rank on one node)
ACROSS: dict[str, Any] = {"compressor": "int8", "compress_across_nodes": True, "node_size": 2,
                          "resume_compression": "reset"}

CONFIGS: list[dict[str, Any]] = [
    {"node_size": 2, "ag": True},
    {"node_size": 1, "ag": True},
    {"node_size": 2, "ag": True, "rs": "int8"},
    {},  # stock FSDP2
    # bad input, refused before step 0
    {"node_size": 3, "ag": True},
    {"node_size": 2, "ag": True, "hsdp": True},
    {"node_size": 2, "ag": True, "mixed": True},
    {"node_size": 2, "ag": True, "reshard": 2},
    # through the Trainer: the option on (long enough to see the loss fall), off, and unset
    {"strategy": dict(ACROSS, quantize_weights=True), "steps": 40},
    {"strategy": dict(ACROSS, quantize_weights=False)},
    {"strategy": ACROSS},
    {"strategy": dict(ACROSS, quantize_weights=True, node_size=4)},
]
AG_2x2, AG_4x1, BOTH_2x2, STOCK, BAD_NODES, HSDP, MIXED, PARTIAL_RESHARD, TRAINER_ON, TRAINER_OFF, TRAINER_UNSET, ONE_NODE = range(
    len(CONFIGS))
#: FSDP2's dim-0 pieces of the three Linear units over 4 ranks (4 rows of 8 + 4 biases; 3 rows of 16 + 3; one row of
#: 12 + 1), the all-gather's input on every rank: 100 elements in all
PIECES = (36, 51, 13)


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(run_configs, 4, CONFIGS, timeout=600.0)


def test_every_rank_computes_with_the_same_dequantized_master_shards(results: list[list[dict[str, Any]]]) -> None:
    """In every forward, every rank's whole weights are bit for bit the same, and equal to each rank's master shard
    (the full-precision one the optimizer holds) quantized blockwise and decoded; the master shard is not
    quantized, and the optimizer steps it with the gradient at full precision."""
    for run in (AG_2x2, AG_4x1, BOTH_2x2):
        for step in range(3):
            for unit in range(3):
                seen = [results[rank][run]["weights"][step][unit] for rank in range(4)]
                assert all(torch.equal(seen[0], s) for s in seen), (run, step, unit)
                # the unit's whole weights, expected: each rank's piece (its weight rows, then its bias), decoded
                pieces = [torch.cat([t.reshape(-1) for t in results[rank][run]["masters"][step][2 * unit:2 * unit + 2]])
                          for rank in range(4)]
                # the layer's parameters in FSDP2's layout: weight rows of every rank, then bias of every rank
                decoded = [dequantized(p) for p in pieces]
                rows = results[0][run]["masters"][step][2 * unit].numel()
                expected = torch.cat([d[:rows] for d in decoded] + [d[rows:] for d in decoded])
                numel = seen[0].numel()
                assert torch.equal(seen[0], expected[:numel]), (run, step, unit)
                assert not torch.equal(seen[0], torch.cat([p[:rows] for p in pieces] + [p[rows:] for p in pieces])[
                    :numel]), "the weights were not quantized"
        for rank in range(4):
            r = results[rank][run]
            for step in range(2):
                for before, grad, after in zip(r["masters"][step], r["grads"][step], r["masters"][step + 1]):
                    assert torch.equal(after, torch.add(before, grad, alpha=-0.05)), (run, rank, step)


def test_quantized_weights_train_close_to_stock_fsdp2(results: list[list[dict[str, Any]]]) -> None:
    start = torch.cat(results[0][STOCK]["weights"][0])  # what stock FSDP2 computed with at step 0: the whole model
    stock, ours = results[0][STOCK]["full"], results[0][AG_2x2]["full"]
    moved = (stock - start).abs().max()
    assert not torch.equal(stock, ours)
    assert (stock - ours).abs().max() < 0.1 * moved


def test_bytes_between_and_inside_nodes_are_recorded_exactly(results: list[list[dict[str, Any]]]) -> None:
    """Per rank and training step: each unit is all-gathered twice (forward, and again in backward, as it reshards
    after forward). Between 2 nodes each rank sends its piece once to its peer, 1 byte an element and one 4-byte
    scale (each piece is one block of at most 256); between 4 nodes of 1, to 3 peers. Inside a node of 2, the node's
    2 decoded pieces in fp32 to the other rank. An evaluation forward (no gradients) after the last step gives
    the same weights as every rank's and is not counted."""
    per_call = sum(p + 4 for p in PIECES)
    assert per_call == 112
    for rank in range(4):
        runs = results[rank]
        assert runs[AG_2x2]["wan"] == [2 * per_call] * 3 and runs[AG_2x2]["mean"] == 2 * per_call
        assert runs[AG_2x2]["dense"] == [2 * 4 * 100] * 3
        assert runs[AG_2x2]["lan"] == [2 * 4 * 2 * 100] * 3
        assert runs[AG_4x1]["wan"] == [2 * 3 * per_call] * 3
        assert runs[AG_4x1]["dense"] == [2 * 4 * 3 * 100] * 3
        assert runs[AG_4x1]["lan"] == [0] * 3
        for run in (AG_2x2, AG_4x1):
            assert runs[run]["after_eval"] == (runs[run]["wan"][-1], runs[run]["mean"])
            assert all(torch.equal(a, b) for a, b in zip(runs[run]["eval_weights"], results[0][run]["eval_weights"]))


def test_bad_input_is_refused_before_the_first_step(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        error = results[rank][BAD_NODES]["error"]
        assert "Expected `node_size` to divide the world size (4 ranks), but got 3" in error
        error = results[rank][HSDP]["error"]
        assert "Expected every unit sharded over all 4 ranks (a 1-D mesh) for the quantized all-gather" in error
        error = results[rank][MIXED]["error"]
        assert "Expected the parameters of every `fully_shard` unit to share one floating dtype" in error
        assert "torch.float64" in error and "Fix:" in error
        error = results[rank][PARTIAL_RESHARD]["error"]
        assert "Expected `reshard_after_forward` to be True or False" in error and "resharding to 2 ranks" in error
        result = results[rank][ONE_NODE]
        assert result["steps_done"] == 0
        assert "Expected at least 2 nodes for the compressed reduce-scatter across nodes" in result["error"]


def test_the_trainer_trains_with_quantized_weights_and_reports_their_bytes(
    results: list[list[dict[str, Any]]],
) -> None:
    """The loss falls; every rank holds the same model; ``bytes_per_step()`` is the int8 reduce-scatter's 112 bytes
    plus the all-gather's 2 x 112, against fp32's 400 + 2 x 400. The loss is each epoch's (4 batches per rank, the
    same batches every epoch), summed over the ranks."""
    epochs = [sum(sum(results[rank][TRAINER_ON]["losses"][4 * e:4 * e + 4]) for rank in range(4)) for e in range(10)]
    assert all(b < a for a, b in zip(epochs, epochs[1:])) and epochs[-1] < 0.8 * epochs[0], epochs
    for rank in range(4):
        run = results[rank][TRAINER_ON]
        assert "error" not in run, run.get("error")
        assert torch.equal(run["full"], results[0][TRAINER_ON]["full"]), rank
        assert run["strategy_last"] == [112 + 2 * 112] * 40
        assert run["strategy_bytes"] == 336 and run["dense_bytes"] == 400 + 2 * 400


def test_the_option_off_is_the_current_path_bit_for_bit(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        off, unset = results[rank][TRAINER_OFF], results[rank][TRAINER_UNSET]
        assert "error" not in off and "error" not in unset
        assert all(torch.equal(a, b) for a, b in zip(off["shards"], unset["shards"]))
        assert torch.equal(off["full"], unset["full"])
        assert off["strategy_last"] == unset["strategy_last"] == [112] * 4
        on = results[rank][TRAINER_ON]
        assert not torch.equal(on["shards"][3], off["shards"][3])  # quantized weights give other gradients
