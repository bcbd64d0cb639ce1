"""`ShardedGradCompFabricStrategy(compress_across_nodes=True)` under ``lightning.fabric`` on 4 real Gloo ranks: the
model sharded over every rank, FSDP2's gradient reduce-scatter dense inside a node and compressed between nodes (the
Trainer's tests: ``test_sharded_across_nodes.py``). One spawned world runs every case.
"""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.fabric_sharded_ranks import across_nodes
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

#: FSDP2's dim-0 pieces of the three Linear units over 4 ranks (4 rows of 8 + 4; 3 rows of 16 + 3; 1 row of 12 + 1)
PIECES = (36, 51, 13)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(across_nodes, 4, str(tmp_path_factory.mktemp("fabric_across") / "ckpt"), timeout=400.0)


@pytest.mark.parametrize(("run", "pieces_out"), [("fp32_4x1", 3), ("fp32_2x2", 1)])
def test_fabric_identity_equals_fsdp2_bit_for_bit(results: list[dict[str, Any]], run: str, pieces_out: int) -> None:
    """fp32 across nodes runs FSDP2's own reduce-scatter: stock FSDP2's shards at every step, on 4 nodes of 1 and
    2 nodes of 2, with the dense bytes between nodes recorded (a piece per unit to each other node)."""
    for rank in range(4):
        ours, stock = results[rank][run], results[rank]["fsdp2"]
        assert "error" not in ours, ours.get("error")
        for step in range(4):
            assert torch.equal(ours["shards"][step], stock["shards"][step]), (run, rank, step)
        assert ours["strategy_bytes"] == ours["dense_bytes"] == 4 * pieces_out * sum(PIECES)
    assert not torch.equal(results[0]["fsdp2"]["shards"][0], results[0]["fsdp2"]["shards"][-1]), "nothing trained"


def test_fabric_int8_across_two_nodes_trains_one_model_with_its_bytes(results: list[dict[str, Any]]) -> None:
    for rank in range(4):
        run = results[rank]["int8_2x2"]
        assert "error" not in run, run.get("error")
        assert torch.equal(run["full"], results[0]["int8_2x2"]["full"]), rank
        assert run["strategy_bytes"] == sum(p + 4 for p in PIECES) == 112  # a piece per unit: codes + one scale
        assert run["dense_bytes"] == 4 * sum(PIECES)
    assert not torch.equal(results[0]["int8_2x2"]["shards"][0], results[0]["int8_2x2"]["shards"][-1])


def test_fabric_quantized_weights_train_one_model_and_join_the_bytes(results: list[dict[str, Any]]) -> None:
    """``quantize_weights=True``: every rank gathers the same parameters, which differ from the int8 reduce-scatter
    alone (the weights it computed with were int8-rounded); ``bytes_per_step()`` adds the all-gather's (each Linear
    unit gathered in forward and again in backward: 2 x 112) to the reduce-scatter's 112."""
    for rank in range(4):
        run = results[rank]["int8_weights_2x2"]
        assert "error" not in run, run.get("error")
        assert torch.equal(run["full"], results[0]["int8_weights_2x2"]["full"]), rank
        assert run["strategy_bytes"] == 112 + 2 * 112
        assert run["dense_bytes"] == 4 * sum(PIECES) + 2 * 4 * sum(PIECES)
    assert not torch.equal(results[0]["int8_weights_2x2"]["full"], results[0]["int8_2x2"]["full"])
    assert not torch.equal(results[0]["int8_weights_2x2"]["shards"][0], results[0]["int8_weights_2x2"]["shards"][-1])


def test_fabric_bad_input_is_refused_before_the_first_step(results: list[dict[str, Any]]) -> None:
    for rank in range(4):
        error = results[rank]["bad_nodes"].get("error", "")
        assert "Expected `node_size` to divide the world size (4 ranks), but got 3" in error and "Fix:" in error
        error = results[rank]["sparse"].get("error", "")
        assert "Expected a compressor that encodes every element of a piece" in error and "GradientDropping" in error


def test_fabric_save_and_load_resume_exactly(results: list[dict[str, Any]]) -> None:
    """3 steps, ``fabric.save`` (a ``torch.distributed.checkpoint`` directory, every rank's int8 residuals in its
    compression state), a fresh Fabric's ``fabric.load``, 3 more: bit for bit the 6 uninterrupted steps; without
    the residuals (``resume_compression="reset"``) it differs."""
    for rank in range(4):
        out = results[rank]
        assert out["exact_step"] == 3
        assert torch.equal(out["exact"], out["straight"]), f"rank {rank}: the resumed run differs"
        assert not torch.equal(out["reset"], out["straight"]), f"rank {rank}: the residuals made no difference"


def test_fabric_checkpoint_keeps_every_ranks_residuals_per_unit_and_piece(results: list[dict[str, Any]]) -> None:
    """The ``torch.distributed.checkpoint`` directory's metadata holds every rank's state between nodes: its
    residuals, one per unit and node's piece (``"<unit>/node<m>"``), each a piece of that unit."""
    ckpt = Path(results[0]["path"])
    assert (ckpt / ".metadata").is_file() and (ckpt / "meta.pt").is_file()
    saved = torch.load(ckpt / "meta.pt", weights_only=True)["gradcomp"]
    assert saved["world_size"] == 4 and len(saved["ranks"]) == 4
    for entry in saved["ranks"]:
        memory = entry["extra"]["reduce_scatter"]["memory"]
        assert {k: v.numel() for k, v in memory.items()} == {
            f"{unit}/node{m}": piece for unit, piece in zip(("0", "2", "4"), PIECES) for m in range(2)}
