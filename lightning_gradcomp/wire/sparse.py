"""Sparse wire encodings with exact byte counts: which entries of a flat tensor were sent, and their values.

Every encoding is a flat ``uint8`` tensor (the hook gathers bytes; every rank produces the same dtype).
Indices are flat, ascending positions in the tensor's row-major (``reshape(-1)``) order. Multi-byte fields
are written in the machine's native byte order (little-endian on every platform torch supports here).

* ``coo32`` (Marian's gradient dropping, Aji & Heafield 2017): ``[int32 index x K][value x K]``,
  ``K * (4 + value bytes)`` bytes; K is implied by the length, so an empty set is 0 bytes.
* ``delta16``: ``[uint32 K][value x K][uint16 gap code x (K + E)]``, ``4 + K * value bytes + 2 * (K + E)``
  bytes. The position starts at -1; a code ``c < 65535`` moves it by ``c + 1`` and marks an entry there,
  the escape code 65535 moves it by 65535 without an entry. E escapes are needed only where two
  consecutive sent indices are more than 65535 apart, so E <= numel / 65535.
* bin-relative codes (AdaComp's wire, Chen et al. 2018): one 8- or 16-bit word per entry, the top 2 bits a
  value code and the rest the entry's offset within its bin of ``bin_size`` elements. See
  :func:`encode_bin_relative`.

Values travel as ``fp32``, ``bf16`` or ``fp16``; the narrow forms are exact to subtract (``x - fp16(x)`` is
representable), so error feedback stays exact with them.
"""

from typing import Literal

import torch
from torch import Tensor

IndexEncoding = Literal["coo32", "delta16"]
INDEX_ENCODINGS: tuple[str, ...] = ("coo32", "delta16")
ValueFormat = Literal["fp32", "bf16", "fp16"]
VALUE_FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16")

_VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ESCAPE16 = 0xFFFF
_DELTA16_STEP = 0xFFFF  # how far an escape moves the position


def value_dtype(fmt: ValueFormat) -> torch.dtype:
    """The torch dtype a value format puts on the wire."""
    return _VALUE_DTYPES[fmt]


def value_nbytes(fmt: ValueFormat) -> int:
    """Bytes per value of a value format."""
    return 4 if fmt == "fp32" else 2


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _read(raw: Tensor, dtype: torch.dtype) -> Tensor:
    # a slice of a gathered byte buffer may be misaligned for wider dtypes: copy before reinterpreting
    return raw.clone().view(dtype)


# -- coo32 --------------------------------------------------------------------------------------------------
def coo32_nbytes(count: int, values: ValueFormat = "fp32") -> int:
    """Exact bytes of :func:`encode_coo32` for ``count`` entries."""
    return count * (4 + value_nbytes(values))


def encode_coo32(indices: Tensor, values: Tensor, fmt: ValueFormat = "fp32") -> Tensor:
    """Absolute 32-bit indices followed by the values (the original gradient-dropping layout)."""
    idx = indices.reshape(-1).to(torch.int32)
    val = values.reshape(-1).to(_VALUE_DTYPES[fmt])
    return torch.cat((_bytes(idx), _bytes(val)))


def decode_coo32(payload: Tensor, fmt: ValueFormat = "fp32") -> tuple[Tensor, Tensor]:
    """Inverse of :func:`encode_coo32`: int64 indices and float32 values."""
    per = 4 + value_nbytes(fmt)
    if payload.numel() % per:
        raise ValueError(f"Expected a coo32 payload of a multiple of {per} bytes, but got {payload.numel()}.")
    k = payload.numel() // per
    idx = _read(payload[: 4 * k], torch.int32).long()
    val = _read(payload[4 * k :], _VALUE_DTYPES[fmt]).float()
    return idx, val


# -- delta16 ------------------------------------------------------------------------------------------------
def _delta16_codes(indices: Tensor) -> Tensor:
    """uint16-range gap codes (as int64), escapes included, for ascending ``indices``."""
    idx = indices.reshape(-1).long()
    if idx.numel() == 0:
        return idx
    prev = torch.cat((idx.new_full((1,), -1), idx[:-1]))
    gap = idx - prev - 1  # >= 0
    escapes = torch.div(gap, _DELTA16_STEP, rounding_mode="floor")
    last = gap - escapes * _DELTA16_STEP  # in [0, 65534]
    # each entry k becomes escapes[k] escape codes followed by its own code
    per_entry = escapes + 1
    codes = torch.full((int(per_entry.sum()),), _ESCAPE16, dtype=torch.int64, device=idx.device)
    ends = torch.cumsum(per_entry, 0) - 1
    codes[ends] = last
    return codes


def delta16_nbytes(indices: Tensor, values: ValueFormat = "fp32") -> int:
    """Exact bytes of :func:`encode_delta16` for these (ascending) indices."""
    return 4 + indices.numel() * value_nbytes(values) + 2 * _delta16_codes(indices).numel()


def encode_delta16(indices: Tensor, values: Tensor, fmt: ValueFormat = "fp32") -> Tensor:
    """Entry count, values, then 16-bit gaps between ascending indices (escapes for gaps beyond 65535)."""
    codes = _delta16_codes(indices).to(torch.int32).to(torch.uint16)
    count = torch.tensor([indices.numel()], dtype=torch.int32, device=indices.device)
    val = values.reshape(-1).to(_VALUE_DTYPES[fmt])
    return torch.cat((_bytes(count), _bytes(val), _bytes(codes)))


def decode_delta16(payload: Tensor, fmt: ValueFormat = "fp32") -> tuple[Tensor, Tensor]:
    """Inverse of :func:`encode_delta16`: int64 indices and float32 values."""
    k = int(_read(payload[:4], torch.int32)[0])
    vb = value_nbytes(fmt)
    val = _read(payload[4 : 4 + vb * k], _VALUE_DTYPES[fmt]).float()
    codes = _read(payload[4 + vb * k :], torch.uint16).to(torch.int64)
    is_entry = codes != _ESCAPE16
    steps = torch.where(is_entry, codes + 1, torch.full_like(codes, _DELTA16_STEP))
    positions = torch.cumsum(steps, 0) - 1
    return positions[is_entry], val


# -- dispatch -----------------------------------------------------------------------------------------------
def encode_sparse(indices: Tensor, values: Tensor, index: IndexEncoding, fmt: ValueFormat) -> Tensor:
    """Encode ascending ``indices`` and their ``values`` with the chosen index encoding."""
    if index == "coo32":
        return encode_coo32(indices, values, fmt)
    return encode_delta16(indices, values, fmt)


def decode_sparse(payload: Tensor, index: IndexEncoding, fmt: ValueFormat) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`encode_sparse`."""
    if index == "coo32":
        return decode_coo32(payload, fmt)
    return decode_delta16(payload, fmt)


def encode_indices(indices: Tensor, index: IndexEncoding) -> Tensor:
    """Indices alone, for values that travel separately (packed quantization codes).

    ``coo32``: int32 per entry; ``delta16``: the gap codes without a count (the caller stores the count and
    puts this section last in its payload, so the decoder knows where it ends).
    """
    if index == "coo32":
        return _bytes(indices.reshape(-1).to(torch.int32))
    return _bytes(_delta16_codes(indices).to(torch.int32).to(torch.uint16))


def decode_indices(raw: Tensor, count: int, index: IndexEncoding) -> Tensor:
    """Inverse of :func:`encode_indices`: ``raw`` is the whole index section, ``count`` its entry count."""
    if index == "coo32":
        return _read(raw[: 4 * count], torch.int32).long()
    codes = _read(raw, torch.uint16).to(torch.int64)
    is_entry = codes != _ESCAPE16
    steps = torch.where(is_entry, codes + 1, torch.full_like(codes, _DELTA16_STEP))
    return (torch.cumsum(steps, 0) - 1)[is_entry]


def indices_nbytes(indices: Tensor, index: IndexEncoding) -> int:
    """Exact bytes of :func:`encode_indices`."""
    if index == "coo32":
        return 4 * indices.numel()
    return 2 * _delta16_codes(indices).numel()


# -- bit packing of small codes -----------------------------------------------------------------------------
def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack codes in ``[0, 2**bits)`` (``bits`` in 1, 2, 4) into ``ceil(n * bits / 8)`` bytes, little end first."""
    per = 8 // bits
    n = codes.numel()
    m = -(-n // per)
    padded = torch.zeros(m * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes.reshape(-1).to(torch.uint8)
    grid = padded.view(m, per)
    out = torch.zeros(m, dtype=torch.uint8, device=codes.device)
    for j in range(per):
        out |= grid[:, j] << (bits * j)
    return out


def unpack_codes(packed: Tensor, count: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``count`` codes as int64."""
    per = 8 // bits
    mask = (1 << bits) - 1
    b = packed.to(torch.uint8)
    grid = torch.stack([(b >> (bits * j)) & mask for j in range(per)], dim=1)
    return grid.reshape(-1)[:count].long()


def packed_codes_nbytes(count: int, bits: int) -> int:
    """Exact bytes of :func:`pack_codes`."""
    return -(-count * bits // 8)


# -- bin-relative words (AdaComp) ---------------------------------------------------------------------------
#: value codes of bin-relative words: a ternary t travels as t + 1; 3 marks a bin advance
CODE_NEG, CODE_ZERO, CODE_POS, CODE_ADVANCE = 0, 1, 2, 3


def bin_word_bits(bin_size: int) -> int:
    """Word width of the bin-relative format: 8 bits for bins shorter than 64, else 16 (bins up to 16384)."""
    if bin_size < 64:
        return 8
    if bin_size <= 1 << 14:
        return 16
    raise ValueError(
        f"Expected `bin_size` to be at most 16384 for the bin-relative wire format, but got {bin_size}. "
        f"Fix: use a smaller bin size or the 'index32' wire format."
    )


def _bin_words(indices: Tensor, codes: Tensor, bin_size: int) -> Tensor:
    """Words (int64, before narrowing) for ascending ``indices`` with value ``codes`` in {0, 1, 2}."""
    bits = bin_word_bits(bin_size)
    field_bits = bits - 2
    max_advance = (1 << field_bits) - 1
    idx = indices.reshape(-1).long()
    if idx.numel() == 0:
        return idx
    bins = torch.div(idx, bin_size, rounding_mode="floor")
    offs = idx - bins * bin_size
    prev_bin = torch.cat((bins.new_zeros(1), bins[:-1]))
    prev_off = torch.cat((offs.new_full((1,), -1), offs[:-1]))
    advance = bins - prev_bin
    # moving to the next bin is implicit when the offset does not increase; anything else needs markers
    implicit = (advance == 1) & (offs <= prev_off)
    needs = (advance > 0) & ~implicit
    markers = torch.where(needs, torch.div(advance + max_advance - 1, max_advance, rounding_mode="floor"), 0)
    per_entry = markers + 1
    total = int(per_entry.sum())
    words = torch.full((total,), (CODE_ADVANCE << field_bits) | max_advance, dtype=torch.int64, device=idx.device)
    ends = torch.cumsum(per_entry, 0) - 1
    words[ends] = (codes.reshape(-1).long() << field_bits) | offs
    # the marker right before an entry carries the remainder of its advance
    has = markers > 0
    last_marker = ends[has] - 1
    remainder = advance[has] - (markers[has] - 1) * max_advance
    words[last_marker] = (CODE_ADVANCE << field_bits) | remainder
    return words


def encode_bin_relative(indices: Tensor, codes: Tensor, bin_size: int) -> Tensor:
    """AdaComp's words: per entry, the 2-bit value code and the offset within its bin.

    Entries are in ascending index order, starting in bin 0. The decoder moves to the next bin whenever an
    offset does not increase; where that is ambiguous (the next non-empty bin is not adjacent, or its first
    offset is larger than the previous entry's) a marker word (code 3) carries how many bins to advance
    (up to 63 or 16383 per marker). A word is 8 bits for ``bin_size < 64`` (6-bit offsets), else 16 bits
    (14-bit offsets, ``bin_size <= 16384``).

    Args:
        indices: ascending flat indices of the sent entries.
        codes: their value codes in {0, 1, 2} (ternary value + 1).
        bin_size: the bin length L_T.
    """
    words = _bin_words(indices, codes, bin_size)
    if bin_word_bits(bin_size) == 8:
        return words.to(torch.uint8)
    return _bytes(words.to(torch.int32).to(torch.uint16))


def bin_relative_nbytes(indices: Tensor, bin_size: int) -> int:
    """Exact bytes of :func:`encode_bin_relative` (entries plus the markers they need)."""
    words = _bin_words(indices, torch.zeros_like(indices), bin_size)
    return words.numel() * bin_word_bits(bin_size) // 8


def decode_bin_relative(payload: Tensor, bin_size: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`encode_bin_relative`: int64 indices and int64 value codes in {0, 1, 2}."""
    bits = bin_word_bits(bin_size)
    field_bits = bits - 2
    if bits == 8:
        words = payload.to(torch.int64)
    else:
        words = _read(payload, torch.uint16).to(torch.int64)
    if words.numel() == 0:
        return words, words
    code = words >> field_bits
    field = words & ((1 << field_bits) - 1)
    is_marker = code == CODE_ADVANCE
    # a bin advance happens at each marker (by its field) and at each entry whose offset does not increase
    # over the previous entry's in the same bin; markers reset "previous" so the next entry never advances
    prev_field = torch.cat((field.new_full((1,), -1), field[:-1]))
    prev_marker = torch.cat((is_marker.new_ones(1), is_marker[:-1]))
    implicit = ~is_marker & ~prev_marker & (field <= prev_field)
    advance = torch.where(is_marker, field, implicit.long())
    bins = torch.cumsum(advance, 0)
    entry = ~is_marker
    return bins[entry] * bin_size + field[entry], code[entry]
