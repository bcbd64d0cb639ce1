"""The non-finite guard's per-rank flag: a cheap sum pass, and the exact element check that settles overflows.

``bucket_is_nonfinite`` runs the exact check on every rank whenever any rank's cheap flag fired; the
distributed tests (``tests/distributed/test_reliability.py``) cover the agreement across ranks.
"""

import pytest
import torch

from lightning_gradcomp.exchange.guard import _flag

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_buckets_are_not_flagged_even_when_their_sum_overflows(dtype: torch.dtype) -> None:
    assert _flag(torch.randn(1000).to(dtype), rank=2).item() == 0
    # every element finite, yet the sum overflows (fp16 is summed in float32, where it does not): the cheap flag
    # fires, the exact one clears it
    huge = torch.full((10,), torch.finfo(dtype).max, dtype=dtype)
    assert _flag(huge, rank=2).item() == (0 if dtype == torch.float16 else 3)
    assert _flag(huge, rank=2, exact=True).item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_any_nan_or_inf_is_flagged_with_the_rank(dtype: torch.dtype, bad: float) -> None:
    x = torch.randn(1000).to(dtype)
    x[500] = bad
    assert _flag(x, rank=2).item() == 3  # rank + 1
    assert _flag(x, rank=2, exact=True).item() == 3


def test_opposite_infinities_do_not_cancel() -> None:
    x = torch.zeros(8)
    x[1], x[2] = float("inf"), -float("inf")
    assert _flag(x, rank=0).item() == 1
    assert _flag(x, rank=0, exact=True).item() == 1


def test_an_overflowing_but_finite_bucket_does_not_skip_the_step() -> None:
    from lightning_gradcomp.compressors.identity import Identity
    from lightning_gradcomp.exchange.guard import bucket_is_nonfinite
    from lightning_gradcomp.exchange.hook import GradCompState

    state = GradCompState(compressor=Identity(), names={})
    huge = torch.full((10,), torch.finfo(torch.float32).max)
    assert not bucket_is_nonfinite(state, huge, [huge], ["w"])
    assert not state.guard.step_nonfinite and state.guard.skipped_steps == 0
    bad = huge.clone()
    bad[3] = float("nan")
    assert bucket_is_nonfinite(state, bad, [bad], ["w"])
    assert state.guard.step_nonfinite and state.guard.skipped_steps == 1
