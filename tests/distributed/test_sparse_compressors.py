"""Gradient Dropping and AdaComp through the hook on real Gloo ranks (one spawn runs every configuration)."""

import pytest
import torch

from tests.distributed.sparse_ranks import sparse_suite
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def suite() -> list[dict[str, dict]]:
    return run_ranks(sparse_suite, 2, 4)


def test_replicas_bit_identical(suite: list[dict[str, dict]]) -> None:
    for key, run in suite[0].items():
        for step, (a, b) in enumerate(zip(run["params"], suite[1][key]["params"])):
            assert torch.equal(a, b), f"{key}: rank 1 diverged at step {step}"
        if key != "plain":
            assert not torch.equal(run["params"][0], run["params"][-1]), f"{key}: nothing moved"


def test_drop_ratio_zero_matches_plain_ddp(suite: list[dict[str, dict]]) -> None:
    plain, ours = suite[0]["plain"], suite[0]["graddrop_ratio0"]
    for a, b in zip(plain["params"], ours["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours["collectives"]["allgather_sizes"] > 0 and ours["collectives"]["allgather"] > 0


def test_compressors_really_compress(suite: list[dict[str, dict]]) -> None:
    dense = suite[0]["graddrop"]["dense_bytes"]
    # 1% of the values at 8 bytes each, about 50x; smaller tensors (biases) need a few entries each
    assert dense / suite[0]["graddrop"]["bytes"][-1] > 20
    assert dense / suite[0]["graddrop_global_delta16"]["bytes"][-1] > 20
    assert dense / suite[0]["adacomp"]["bytes"][-1] > 5
    assert not torch.allclose(suite[0]["graddrop"]["params"][-1], suite[0]["plain"]["params"][-1])


@pytest.mark.parametrize("key", ["graddrop_quiet", "adacomp_quiet"])
def test_a_rank_that_sends_nothing(suite: list[dict[str, dict]], key: str) -> None:
    quiet = suite[1][key]
    assert all(b == 0 for b in quiet["bytes"]), "the quiet rank put bytes on the wire"
    if key == "graddrop_quiet":  # drop ratio 0: rank 0 sends every value, so the average is its gradient / 2
        for got, own in zip(suite[0][key]["grads"], suite[0][key]["local_grads"]):
            assert torch.equal(got, own / 2)


@pytest.mark.parametrize("key", ["graddrop", "graddrop_strided", "adacomp_ternary"])
def test_fused_and_torch_backends_train_identically(suite: list[dict[str, dict]], key: str) -> None:
    # "graddrop": the default random sample (backend "auto", fused where the kernels compile): both backends draw it
    # from the same counter-based streams
    for rank in (0, 1):
        fused, ref = suite[rank][key if key == "graddrop" else f"{key}_fused"], suite[rank][f"{key}_torch"]
        assert ref["bytes"] == fused["bytes"]
        for step, (a, b) in enumerate(zip(fused["params"], ref["params"])):
            assert torch.equal(a, b), f"{key}: the backends differ on rank {rank} at step {step}"
