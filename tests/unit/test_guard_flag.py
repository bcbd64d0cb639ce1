"""The non-finite guard's per-rank flag: one sum pass, exact even when a sum of finite values overflows."""

import pytest
import torch

from lightning_gradcomp.guard import _flag

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_buckets_are_not_flagged_even_when_their_sum_overflows(dtype: torch.dtype) -> None:
    assert _flag(torch.randn(1000).to(dtype), rank=2).item() == 0
    # the sum is +inf in every dtype, yet every element is finite: the exact check must clear it
    assert _flag(torch.full((10,), torch.finfo(dtype).max, dtype=dtype), rank=2).item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_any_nan_or_inf_is_flagged_with_the_rank(dtype: torch.dtype, bad: float) -> None:
    x = torch.randn(1000).to(dtype)
    x[500] = bad
    assert _flag(x, rank=2).item() == 3  # rank + 1


def test_opposite_infinities_do_not_cancel() -> None:
    x = torch.zeros(8)
    x[1], x[2] = float("inf"), -float("inf")
    assert _flag(x, rank=0).item() == 1
