"""The sharded strategy under ``lightning.fabric`` (``ShardedGradCompFabricStrategy``) on 4 real Gloo ranks.

One spawned world (2 replicas x 2 shards) runs every configuration and the resume runs (spawns are expensive).
"""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.fabric_sharded_ranks import fit_configs
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

CONFIGS: list[dict[str, Any]] = [
    {"kind": "native"},  # stock Fabric ModelParallelStrategy, FSDP2 over the 2-D mesh (HSDP)
    {"strategy": {"compressor": "fp32", "shard_size": 2}},
    # with the replica check after every step: each rank's shard against the same shard of the other replica
    {"strategy": {"compressor": "terngrad", "shard_size": 2, "check_replicas_every": 1}},
    # a NaN in rank 0's gradient of one bias element at step 2: it lands in shard 0 only; every rank must skip
    {"strategy": {"compressor": "graddrop", "shard_size": 2}, "nan_at": 2},
    # bad input, refused on every rank before the first step
    {"strategy": {"compressor": "terngrad", "shard_size": 3}},
    {"kind": "unsharded", "strategy": {"compressor": "terngrad", "shard_size": 2}},
    {"kind": "whole_mesh", "strategy": {"compressor": "terngrad", "shard_size": 2}},
    {"kind": "optimizer_first", "strategy": {"compressor": "terngrad", "shard_size": 2}},
    # no parallelize_fn (as `Fabric(strategy="sharded_fp32")`): each block of an nn.ModuleList, then the root
    {"kind": "default_fn", "strategy": {"compressor": "fp32", "shard_size": 2}},
    # one replica of 4 shards (the registered names' default on one node): nothing between replicas, FSDP2 alone
    {"strategy": {"compressor": "terngrad", "shard_size": 4}},
]
(NATIVE, FP32, TERNGRAD, NAN, BAD_SIZE, UNSHARDED, WHOLE_MESH, OPTIMIZER_FIRST, DEFAULT_FN,
 ONE_REPLICA) = range(len(CONFIGS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("fabric_sharded") / "ckpt")
    return run_ranks(fit_configs, 4, CONFIGS, path, timeout=400.0)


def _run(results: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    return [results[r]["runs"][i] for r in range(4)]


def test_fabric_identity_equals_stock_fabric_hsdp_bit_for_bit(results: list[dict[str, Any]]) -> None:
    native, ours = _run(results, NATIVE), _run(results, FP32)
    assert native[0]["strategy"] == "ModelParallelStrategy" and ours[0]["strategy"] == "ShardedGradCompFabricStrategy"
    for rank in range(4):
        assert len(ours[rank]["shards"]) == 4
        for step, (a, b) in enumerate(zip(native[rank]["shards"], ours[rank]["shards"])):
            assert torch.equal(a, b), f"rank {rank} differs from stock Fabric HSDP at step {step}"
        # the hook sent each rank's fp32 shard between the replicas, and nothing else
        assert ours[rank]["bytes"][-1] == 4 * ours[rank]["shard_numel"]
    assert not torch.equal(ours[0]["shards"][0], ours[0]["shards"][-1]), "nothing trained"


def test_fabric_terngrad_keeps_the_replicas_identical_every_step(results: list[dict[str, Any]]) -> None:
    runs = _run(results, TERNGRAD)
    for step in range(4):
        for rank in (0, 1):
            assert torch.equal(runs[rank]["shards"][step], runs[rank + 2]["shards"][step]), (
                f"rank {rank} and rank {rank + 2} hold different copies of shard {rank} at step {step}")
    assert not torch.equal(runs[0]["shards"][0], runs[1]["shards"][0])  # two different shards
    assert all(0 < r["bytes"][-1] < 4 * r["shard_numel"] / 8 for r in runs)  # 2-bit payloads: the hook ran


def test_fabric_a_nonfinite_shard_skips_the_step_on_every_rank(results: list[dict[str, Any]]) -> None:
    runs = _run(results, NAN)
    for rank in range(4):
        assert runs[rank]["skipped"] == [0, 0, 1, 1], rank
        assert torch.equal(runs[rank]["shards"][1], runs[rank]["shards"][2]), f"rank {rank} stepped at the NaN step"
        assert not torch.equal(runs[rank]["shards"][2], runs[rank]["shards"][3])
        assert torch.isfinite(runs[rank]["shards"][3]).all()
    for rank in (0, 1):
        assert torch.equal(runs[rank]["shards"][3], runs[rank + 2]["shards"][3])


def test_fabric_default_parallelize_fn_shards_each_block_then_the_root(results: list[dict[str, Any]]) -> None:
    runs = _run(results, DEFAULT_FN)
    assert [r["units"] for r in runs] == [3] * 4  # two blocks and the root (which holds the head)
    for step in range(4):
        for rank in (0, 1):
            assert torch.equal(runs[rank]["shards"][step], runs[rank + 2]["shards"][step]), (rank, step)
    assert not torch.equal(runs[0]["shards"][0], runs[0]["shards"][-1]), "nothing trained"


def test_fabric_one_replica_trains_with_fsdp2_alone(results: list[dict[str, Any]]) -> None:
    runs = _run(results, ONE_REPLICA)
    for rank in range(4):
        assert "error" not in runs[rank] and len(runs[rank]["shards"]) == 4, runs[rank].get("error")
        assert torch.isfinite(runs[rank]["shards"][-1]).all()
        assert not torch.equal(runs[rank]["shards"][0], runs[rank]["shards"][-1])
        assert runs[rank]["bytes"] == [0, 0, 0, 0], "one replica: nothing crosses a link, nothing compressed"


def test_fabric_bad_input_is_refused_before_the_first_step(results: list[dict[str, Any]]) -> None:
    expected = {
        BAD_SIZE: "Expected `shard_size` to divide the world size (4 ranks), but got 3",
        UNSHARDED: "Expected the model to be sharded with FSDP2 in `parallelize_fn`",
        WHOLE_MESH: "Expected every trainable parameter to be sharded over `device_mesh['shard']`",
        OPTIMIZER_FIRST: "Expected the optimizer to hold the sharded model's parameters",
    }
    for i, message in expected.items():
        for rank in range(4):
            error = results[rank]["runs"][i].get("error", "")
            assert message in error and "Fix:" in error, (i, rank, error)


def test_fabric_save_and_load_resume_exactly(results: list[dict[str, Any]]) -> None:
    """3 steps, ``fabric.save`` (distributed checkpoint plus every rank's residuals), a fresh Fabric's
    ``fabric.load``, 3 more steps: bit for bit the 6 uninterrupted steps on every rank; without the compression
    state (``resume_compression="reset"``) it differs."""
    for rank in range(4):
        out = results[rank]["resume"]
        assert out["exact_remainder"] == [] and out["exact_step"] == 3  # the `gradcomp` entry is consumed
        assert torch.equal(out["exact"], out["straight"]), f"rank {rank}: the resumed run differs"
        assert not torch.equal(out["reset"], out["straight"]), f"rank {rank}: the residuals made no difference"
    for rank in (0, 1):
        assert torch.equal(results[rank]["resume"]["exact"], results[rank + 2]["resume"]["exact"])


def test_fabric_checkpoint_is_a_distributed_checkpoint_with_sharded_residuals(
        results: list[dict[str, Any]]) -> None:
    ckpt = Path(results[0]["resume"]["path"])
    assert (ckpt / ".metadata").is_file() and (ckpt / "meta.pt").is_file()  # torch.distributed.checkpoint's layout
    saved = torch.load(ckpt / "meta.pt", weights_only=True)["gradcomp"]
    assert saved["world_size"] == 4 and len(saved["ranks"]) == 4
    # every rank's residuals, by parameter name, cover its own shard: half of the first layer's 16 rows
    for entry in saved["ranks"]:
        assert entry["memory"]["0.weight"].shape == (8, 8)
