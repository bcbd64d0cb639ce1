"""The hook on real Gloo process groups (2 and 3 ranks), with plain torch DDP as the reference."""

import pytest
import torch

from tests.distributed.ranks import train_raw_ddp
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def _assert_identical_replicas(results: list[dict]) -> None:
    for step, reference in enumerate(results[0]["params"]):
        for rank, other in enumerate(results[1:], start=1):
            assert torch.equal(reference, other["params"][step]), f"rank {rank} diverged at step {step}"


def test_identity_matches_plain_ddp() -> None:
    plain = run_ranks(train_raw_ddp, 2, None)
    ours = run_ranks(train_raw_ddp, 2, "fp32")
    _assert_identical_replicas(ours)
    for a, b in zip(plain[0]["params"], ours[0]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours[0]["hook_calls"] > 4, "expected several buckets per step"


@pytest.mark.parametrize("world_size", [2, 3])
def test_terngrad_replicas_bit_identical(world_size: int) -> None:
    results = run_ranks(train_raw_ddp, world_size, "terngrad", 4)
    _assert_identical_replicas(results)
    # the replicas moved, and not like plain DDP (the compressor really ran)
    assert not torch.equal(results[0]["params"][0], results[0]["params"][-1])
    assert results[0]["collectives"]["allgather"] > 0
    assert results[0]["collectives"]["allreduce_max"] > 0


def test_terngrad_int8_allreduce_equals_allgather() -> None:
    """Same ternaries, two collectives: integer sums are exact, so the replicas must agree bit for bit."""
    gathered = run_ranks(train_raw_ddp, 2, "terngrad", 3, {"collective": "allgather"})
    summed = run_ranks(train_raw_ddp, 2, "terngrad", 3, {"collective": "allreduce_int8"})
    _assert_identical_replicas(summed)
    assert summed[0]["collectives"].get("allreduce_int8", 0) > 0 and "allgather" not in summed[0]["collectives"]
    for a, b in zip(gathered[0]["params"], summed[0]["params"]):
        assert torch.equal(a, b)


def test_variable_size_gather_with_an_empty_rank() -> None:
    """Sizes travel first; a rank that sends nothing neither hangs nor corrupts the average."""
    results = run_ranks(train_raw_ddp, 2, "sparse_probe", 2)
    _assert_identical_replicas(results)
    assert results[0]["collectives"]["allgather_sizes"] > 0
    # rank 0 sends every entry, rank 1 nothing: the average is rank 0's gradient / 2
    torch.testing.assert_close(results[0]["grads"], results[0]["local_grads"] / 2)


@pytest.mark.parametrize(
    ("compressor", "kwargs", "channel"),
    [
        ("terngrad", {"collective": "allgather"}, "allgather"),
        ("terngrad", {"collective": "allreduce_int8"}, "allreduce_int8"),
        ("graddrop", {}, "allgather"),  # variable-size payloads: sizes are exchanged per group
    ],
)
def test_pipelined_groups_give_identical_replicas_and_results(compressor: str, kwargs: dict, channel: str) -> None:
    """One bucket holding every parameter, sent whole or in one group per parameter: the same bits."""
    whole = run_ranks(train_raw_ddp, 2, compressor, 3, kwargs, 25.0, None)
    piped = run_ranks(train_raw_ddp, 2, compressor, 3, kwargs, 25.0, 1)
    _assert_identical_replicas(piped)
    for a, b in zip(whole[0]["params"], piped[0]["params"]):
        assert torch.equal(a, b)
    # 6 parameters in one bucket: 6 payload collectives per step instead of 1
    assert piped[0]["collectives"][channel] == 6 * whole[0]["collectives"][channel]
