"""Sparse wire encodings: round trips and exact byte counts, including the edge cases of each layout."""

import pytest
import torch

from lightning_gradcomp.wire import sparse
from lightning_gradcomp.wire.sparse import IndexEncoding, ValueFormat


def _random_indices(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:k].sort().values


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("index", ["coo32", "delta16"])
def test_sparse_round_trip_and_exact_bytes(index: IndexEncoding, fmt: ValueFormat) -> None:
    # gaps beyond 65535 (escapes), adjacent indices, first and last positions
    n = 300_000
    idx = torch.cat((torch.tensor([0, 1, 2, 65536, 65537, 65537 + 65535, 200_000 + 131_071 - 31_072]), _random_indices(n, 50, 0)))
    idx = torch.unique(idx[idx < n])
    values = torch.randn(idx.numel())
    payload = sparse.encode_sparse(idx, values, index, fmt)
    assert payload.dtype == torch.uint8
    expected = sparse.coo32_nbytes(idx.numel(), fmt) if index == "coo32" else sparse.delta16_nbytes(idx, fmt)
    assert payload.numel() == expected
    got_idx, got_val = sparse.decode_sparse(payload, index, fmt)
    assert torch.equal(got_idx, idx)
    assert torch.equal(got_val, values.to(sparse.value_dtype(fmt)).float())


def test_byte_counts_by_formula() -> None:
    idx = torch.tensor([3, 70_000, 70_001])  # one gap needs one escape (70_000 - 3 - 1 >= 65535)
    assert sparse.coo32_nbytes(3) == 24 and sparse.coo32_nbytes(3, "bf16") == 18
    assert sparse.delta16_nbytes(idx, "fp32") == 4 + 3 * 4 + 2 * (3 + 1)
    assert sparse.delta16_nbytes(idx, "fp16") == 4 + 3 * 2 + 2 * (3 + 1)
    assert sparse.encode_coo32(idx[:0], torch.zeros(0)).numel() == 0  # nothing sent: nothing on the wire


@pytest.mark.parametrize("bin_size", [1, 50, 63, 64, 500, 16384])
def test_bin_relative_round_trip(bin_size: int) -> None:
    n = 400_000 if bin_size == 16384 else 200_000
    # dense runs, single entries, adjacent bins with falling and rising offsets, long empty stretches
    idx = torch.unique(torch.cat((_random_indices(n, 400, 1), torch.arange(0, min(n, 3 * bin_size)), torch.tensor([n - 1]))))
    codes = torch.randint(0, 3, (idx.numel(),), generator=torch.Generator().manual_seed(2))
    payload = sparse.encode_bin_relative(idx, codes, bin_size)
    assert payload.numel() == sparse.bin_relative_nbytes(idx, bin_size)
    got_idx, got_codes = sparse.decode_bin_relative(payload, bin_size)
    assert torch.equal(got_idx, idx) and torch.equal(got_codes, codes)


def test_bin_relative_word_counts() -> None:
    # L_T = 50 (8-bit words, 6-bit offsets): bin 0 {3, 7}; bin 1 {2} follows implicitly (2 <= 7); bin 2 {40}
    # needs a marker (40 > 2); bin 200 needs ceil(198 / 63) = 4 markers
    idx = torch.tensor([3, 7, 52, 140, 200 * 50 + 1])
    assert sparse.bin_word_bits(50) == 8 and sparse.bin_word_bits(64) == 16
    assert sparse.bin_relative_nbytes(idx, 50) == 5 + 1 + 4
    # L_T = 500 (16-bit words): bins 0, 0, 0, 0, 20: one marker before the last entry
    assert sparse.bin_relative_nbytes(idx, 500) == 2 * (5 + 1)
    with pytest.raises(ValueError, match="bin_size"):
        sparse.bin_word_bits(16385)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_codes_round_trip(bits: int) -> None:
    for n in (0, 1, 7, 8, 9, 1001):
        codes = torch.randint(0, 1 << bits, (n,))
        packed = sparse.pack_codes(codes, bits)
        assert packed.numel() == sparse.packed_codes_nbytes(n, bits)
        assert torch.equal(sparse.unpack_codes(packed, n, bits), codes)
