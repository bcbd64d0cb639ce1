"""The non-finite guard riding in the statistics all-reduce (no transforms, no residuals), on real Gloo ranks."""

import pytest
import torch

from tests.distributed.guard_ranks import shared_flag_run
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def test_terngrad_flag_shares_the_statistics_collective_and_still_skips_on_every_rank() -> None:
    results = run_ranks(shared_flag_run, 2, "terngrad")
    for step in range(3):
        assert torch.equal(results[0]["params"][step], results[1]["params"][step]), f"diverged at step {step}"
    assert results[0]["skipped"] == results[1]["skipped"] == 1
    assert torch.equal(results[0]["params"][0], results[0]["params"][1])  # the NaN step changed nothing
    assert not torch.equal(results[0]["params"][1], results[0]["params"][2])  # and training went on
    first = results[0]["collectives"][0]
    # one blocking round trip per bucket: the statistics' max all-reduce carries the flag
    assert first.get("allreduce_nonfinite", 0) == 0 and first["allreduce_max"] >= 1


def test_a_compressor_with_residuals_keeps_the_flag_in_its_own_collective() -> None:
    results = run_ranks(shared_flag_run, 2, "graddrop")
    assert results[0]["skipped"] == results[1]["skipped"] == 1
    for step in range(3):
        assert torch.equal(results[0]["params"][step], results[1]["params"][step]), f"diverged at step {step}"
    assert results[0]["collectives"][0]["allreduce_nonfinite"] >= 1
