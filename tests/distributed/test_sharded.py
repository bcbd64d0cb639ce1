"""The sharded strategy (FSDP2 inside a replica, compressed shards between replicas) on 4 real Gloo ranks.

Ranks form a (2, 2) mesh ("replicate", "shard"): ranks 0 and 1 shard replica 0, ranks 2 and 3 replica 1, so rank r
and rank r + 2 hold the same shard. One spawned world runs every configuration (spawns are expensive).
"""

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.registry import compressor_names
from tests.distributed.sharded_ranks import fit_configs, stalled_run
from tests.distributed.test_faults import collect_reports
from tests.distributed.test_site_faults import assert_the_others_stopped
from tests.harness import _context, run_ranks

pytestmark = pytest.mark.distributed

#: the optimizer each method is meant for (DeMo's sign step; DGC's and 1-bit SGD's momentum SGD), AdamW elsewhere
OPTIMIZER = {"demo": "sign", "dgc": "sgd", "onebit": "sgd"}
COMPRESSORS = compressor_names()

CONFIGS: list[dict[str, Any]] = [
    {"kind": "native", "strategy": {"shard_size": 2}},
    *({"strategy": {"compressor": name, "shard_size": 2}, "optimizer": OPTIMIZER.get(name, "adamw")}
      for name in COMPRESSORS),
    # 4 replicas of 1 shard (FSDP2 with a 1-rank shard group: the exchange alone averages)
    {"strategy": {"compressor": "terngrad", "shard_size": 1}},
    # a NaN in rank 0's gradient of one bias element: it lands in shard 0 only; every rank must skip the step
    {"strategy": {"compressor": "graddrop", "shard_size": 2}, "nan_at": 2},
    # bad input, refused on every rank before the first step
    {"strategy": {"compressor": "terngrad", "shard_size": 3}},
    {"kind": "unsharded", "strategy": {"compressor": "terngrad", "shard_size": 2}},
    # the same model under our DDP strategy, for the memory comparison
    {"kind": "ddp", "strategy": {"compressor": "graddrop"}},
    # the replica check compares each shard with its copies in the other replicas (not the two different shards)
    {"strategy": {"compressor": "terngrad", "shard_size": 2, "check_replicas_every": 1}},
    # the default shard size on one node: 1 replica of 4 shards (`strategy="sharded_terngrad"`), and its reference,
    # stock FSDP2 over the same 4 ranks with no hook
    {"strategy": {"compressor": "terngrad"}},
    {"kind": "fsdp", "strategy": {"shard_size": 4}},
    # one replica, a NaN at step 1: the guard still skips the step on every rank (no compressor runs)
    {"strategy": {"compressor": "graddrop"}, "nan_at": 1, "steps": 3},
    # DeMo with SGD momentum instead of its sign step: warned before the first step, as under DDP
    {"strategy": {"compressor": "demo", "shard_size": 2}, "optimizer": "sgd", "steps": 1},
    # one replica with a transform that only the exchange would run: refused before the first step
    {"strategy": {"compressor": "dgc"}, "momentum_correction": 0.9},
]
NATIVE, FIRST = 0, 1
ONE_SHARD = FIRST + len(COMPRESSORS)
NAN, BAD_SIZE, UNSHARDED, DDP, CHECKED, ONE_REPLICA, FSDP, ONE_REPLICA_NAN, DEMO_SGD, ONE_REPLICA_MOMENTUM = (
    ONE_SHARD + k for k in range(1, 11))


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(fit_configs, 4, CONFIGS, timeout=600.0)


def _run(results: list[list[dict[str, Any]]], i: int) -> list[dict[str, Any]]:
    return [results[r][i] for r in range(4)]


def test_identity_equals_native_hsdp_bit_for_bit(results: list[list[dict[str, Any]]]) -> None:
    native, ours = _run(results, NATIVE), _run(results, FIRST + COMPRESSORS.index("fp32"))
    for rank in range(4):
        assert len(ours[rank]["shards"]) == 4
        for step, (a, b) in enumerate(zip(native[rank]["shards"], ours[rank]["shards"])):
            assert torch.equal(a, b), f"rank {rank} differs from stock HSDP at step {step}"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_every_compressor_keeps_the_replicas_identical_every_step(results: list[list[dict[str, Any]]], name: str) -> None:
    runs = _run(results, FIRST + COMPRESSORS.index(name))
    for step in range(4):
        for rank in (0, 1):
            assert torch.equal(runs[rank]["shards"][step], runs[rank + 2]["shards"][step]), (
                f"{name}: rank {rank} and rank {rank + 2} hold different copies of shard {rank} at step {step}")
    # the shards of one replica are different parts of the model, and the model trains
    assert runs[0]["shards"][0].numel() + runs[1]["shards"][0].numel() == runs[0]["shard_numel"] + runs[1]["shard_numel"]
    assert not torch.equal(runs[0]["shards"][0], runs[0]["shards"][-1])


def test_bytes_between_replicas_are_the_shard_payloads(results: list[list[dict[str, Any]]]) -> None:
    for name, width in (("fp32", 4), ("bf16", 2), ("fp16", 2)):
        runs = _run(results, FIRST + COMPRESSORS.index(name))
        for rank in range(4):
            assert runs[rank]["bytes"][-1] == width * runs[rank]["shard_numel"], (name, rank)
    native = _run(results, NATIVE)
    assert all(b == 0 for r in native for b in r["bytes"])  # stock HSDP: no hook, nothing counted by us
    # TernGrad's 2-bit payload per shard (plus its scalers) is far below the fp32 shard
    tern = _run(results, FIRST + COMPRESSORS.index("terngrad"))
    assert all(0 < r["bytes"][-1] < 4 * r["shard_numel"] / 8 for r in tern)


def test_four_replicas_of_one_shard(results: list[list[dict[str, Any]]]) -> None:
    runs = _run(results, ONE_SHARD)
    for step in range(4):
        assert all(torch.equal(runs[0]["shards"][step], runs[r]["shards"][step]) for r in range(4)), step


def test_a_nonfinite_shard_skips_the_step_on_every_rank(results: list[list[dict[str, Any]]]) -> None:
    runs = _run(results, NAN)
    for rank in range(4):
        assert runs[rank]["skipped"] == [0, 0, 1, 1], rank
        assert torch.equal(runs[rank]["shards"][1], runs[rank]["shards"][2]), f"rank {rank} stepped at the NaN step"
        assert not torch.equal(runs[rank]["shards"][2], runs[rank]["shards"][3])
        assert torch.isfinite(runs[rank]["shards"][3]).all()
    for rank in (0, 1):
        assert torch.equal(runs[rank]["shards"][3], runs[rank + 2]["shards"][3])


def test_bad_input_is_refused_before_the_first_step(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        assert "Expected `shard_size` to divide the world size (4 ranks), but got 3" in results[rank][BAD_SIZE]["error"]
        error = results[rank][UNSHARDED]["error"]
        assert "Expected the model to be sharded with FSDP2 in `configure_model`" in error and "Fix:" in error


def test_residuals_and_optimizer_state_are_sharded(results: list[list[dict[str, Any]]]) -> None:
    """Per rank, Gradient Dropping with AdamW: parameters, AdamW's two moments and the residuals cover this rank's
    shard only under the sharded strategy, the whole model under DDP (bytes of the tensors each rank holds)."""
    sharded, ddp = _run(results, FIRST + COMPRESSORS.index("graddrop")), _run(results, DDP)
    whole = 4 * ddp[0]["shard_numel"]
    for rank in range(4):
        own = 4 * sharded[rank]["shard_numel"]
        assert sharded[rank]["memory"] == {"params": own, "optimizer": 2 * own, "residuals": own}, rank
        assert ddp[rank]["memory"] == {"params": whole, "optimizer": 2 * whole, "residuals": whole}, rank
    # a replica's two shards together are the model (the uneven split of a 3-row weight over 2 ranks included)
    assert sharded[0]["shard_numel"] + sharded[1]["shard_numel"] == ddp[0]["shard_numel"]


def test_replica_check_compares_the_copies_of_each_shard(results: list[list[dict[str, Any]]]) -> None:
    for rank, run in enumerate(_run(results, CHECKED)):
        assert "error" not in run and len(run["shards"]) == 4, (rank, run.get("error"))


def test_one_replica_is_plain_fsdp2_warned_at_setup_with_zero_bytes(results: list[list[dict[str, Any]]]) -> None:
    """`sharded_terngrad` on one node (the default shard size: 4 ranks, one replica): nothing crosses a link, so
    rank 0 warns before the first step naming `shard_size` and the value to use, TernGrad never runs (every shard
    equals stock FSDP2's at every step, bit for bit) and the strategy reports 0 bytes per step."""
    ours, stock = _run(results, ONE_REPLICA), _run(results, FSDP)
    for rank in range(4):
        assert "error" not in ours[rank], ours[rank].get("error")
        assert len(ours[rank]["shards"]) == 4
        for step, (a, b) in enumerate(zip(stock[rank]["shards"], ours[rank]["shards"])):
            assert torch.equal(a, b), f"rank {rank} differs from stock FSDP2 at step {step}"
        assert ours[rank]["bytes"] == [0, 0, 0, 0] and ours[rank]["strategy_bytes"] == 0, rank
        # no compressor's collective: only the 4-byte agreement on a skipped step over the shard group
        assert set(ours[rank]["collectives"]) == {"allreduce_nonfinite"}, ours[rank]["collectives"]
    assert not torch.equal(ours[0]["shards"][0], ours[0]["shards"][-1]), "nothing trained"
    warned = [w for w in ours[0]["warnings"] if "Expected at least 2 replicas" in w]
    assert len(warned) == 1, ours[0]["warnings"]
    for part in ("ShardedGradCompStrategy", "but got 1: `shard_size=4`", "TernGrad is not used",
                 "Fix: pass `shard_size=2`", "`bytes_per_step()` is 0"):
        assert part in warned[0], (part, warned[0])
    assert not any("Expected at least 2 replicas" in w for r in range(1, 4) for w in ours[r]["warnings"])
    two = _run(results, FIRST + COMPRESSORS.index("terngrad"))  # 2 replicas: no such warning
    assert not any("Expected at least 2 replicas" in w for w in two[0]["warnings"])


def test_one_replica_still_skips_a_nonfinite_step_on_every_rank(results: list[list[dict[str, Any]]]) -> None:
    runs = _run(results, ONE_REPLICA_NAN)
    for rank in range(4):
        assert runs[rank]["skipped"] == [0, 1, 1], rank
        assert torch.equal(runs[rank]["shards"][0], runs[rank]["shards"][1]), f"rank {rank} stepped at the NaN step"
        assert not torch.equal(runs[rank]["shards"][1], runs[rank]["shards"][2])
        assert torch.isfinite(runs[rank]["shards"][2]).all()
        assert runs[rank]["bytes"] == [0, 0, 0]


def test_one_replica_refuses_a_transform_it_would_never_run(results: list[list[dict[str, Any]]]) -> None:
    """MomentumCorrection's momentum runs in the exchange between replicas; with one replica nothing runs it, so the
    run would train without momentum: refused on every rank before the first step, naming the shard size to use."""
    for rank, run in enumerate(_run(results, ONE_REPLICA_MOMENTUM)):
        error = run.get("error", "")
        assert run.get("steps_done") == 0, (rank, run)
        assert "Expected no gradient transforms with one replica under ShardedGradCompStrategy" in error, error
        assert "['MomentumCorrect'] with `shard_size=4`" in error and "Fix: pass `shard_size=2`" in error, error


def test_demo_with_sgd_momentum_is_warned_as_under_ddp(results: list[list[dict[str, Any]]]) -> None:
    """The compressor's optimizer check (DeMo's: its update is a sign step) runs at setup under the sharded engine
    too; with SignSGD, DeMo's own optimizer, nothing is said."""
    warned = [w for w in _run(results, DEMO_SGD)[0]["warnings"] if "Expected DeMo's optimizer to be SignSGD" in w]
    assert len(warned) == 1 and "SGD with momentum=0.9" in warned[0], warned
    own = _run(results, FIRST + COMPRESSORS.index("demo"))[0]["warnings"]
    assert not any("Expected DeMo's optimizer" in w for w in own), own


def test_resume_is_exact(tmp_path: Path) -> None:
    """8 steps straight against 4 steps, the checkpoint of the first epoch's end (DCP, plus every rank's residuals),
    and 4 more: the shards match bit for bit at every resumed step (Gradient Dropping with momentum SGD: the residual
    carries most of the gradient, so a lost residual shows at once). The same checkpoint resumed with
    `shard_size=1` or `4` is refused on every rank before the first step, naming both shard sizes."""
    path = str(tmp_path / "ckpt")
    resume = str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    strategy = {"compressor": "graddrop", "shard_size": 2}
    configs = [
        {"strategy": strategy, "optimizer": "sgd", "steps": 8},
        {"strategy": strategy, "optimizer": "sgd", "steps": 4, "save": path},
        {"strategy": strategy, "optimizer": "sgd", "steps": 8, "resume": resume},
        # the same checkpoint with the compression state dropped: what a resume that lost the residuals would do
        {"strategy": dict(strategy, resume_compression="reset"), "optimizer": "sgd", "steps": 8, "resume": resume},
        # another shard size: each rank's residuals cover its shard of shard_size=2, refused before the first step
        *({"strategy": dict(strategy, shard_size=k), "optimizer": "sgd", "steps": 8, "resume": resume} for k in (1, 4)),
    ]
    results = run_ranks(fit_configs, 4, configs, timeout=400.0)
    for rank in range(4):
        straight, resumed = results[rank][0]["shards"], results[rank][2]["shards"]
        assert len(resumed) == 4
        for step in range(4):
            assert torch.equal(straight[4 + step], resumed[step]), f"rank {rank}, step {4 + step}"
        assert not torch.equal(straight[4], results[rank][3]["shards"][0]), "the residuals made no difference"
        for k, refused in zip((1, 4), results[rank][4:]):
            assert refused.get("steps_done") == 0, (rank, k, refused)
            assert (f"come from `shard_size={k}` as this run, but got one written with `shard_size=2`: the "
                    f"compression state is per shard") in refused["error"], (rank, refused["error"])
            assert "Fix: resume with `shard_size=2`" in refused["error"]


def test_a_stalled_rank_stops_every_other_rank_within_the_timeout() -> None:
    """Rank 2 sleeps 40 s at step 2 with `timeout` 3 s: its shard group (FSDP2's collectives) and its replicate group
    (the compressed exchange) were made by the strategy with that timeout, so every other rank stops with the
    library's message within 20 s instead of torch's 30-minute default."""
    reports = collect_reports(stalled_run, 4, (2, 3.0, 40.0), 3, context=_context())
    assert_the_others_stopped(reports, {0, 1, 3}, within_s=20.0)
