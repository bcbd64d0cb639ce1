"""The replica checksum sees a flipped lowest bit (one ulp) and swapped values, for every parameter dtype."""

import pytest
import torch

from lightning_gradcomp.strategies.replicas import checksums

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_checksum_sees_a_one_ulp_change_and_a_swap(dtype: torch.dtype) -> None:
    p = torch.randn(1000).to(dtype)
    base = checksums([p])
    nudged = p.clone()
    nudged.view(_INT[p.element_size()])[17] ^= 1  # the lowest mantissa bit of one element
    swapped = p.clone()
    swapped[[3, 500]] = p[[500, 3]]
    assert not torch.equal(p, nudged) and not torch.equal(p, swapped)
    assert torch.equal(base, checksums([p.clone()]))
    assert not torch.equal(base, checksums([nudged]))
    assert not torch.equal(base, checksums([swapped]))
    assert base.dtype == torch.int64 and base.numel() == 2
