"""The Triton bodies of :mod:`lightning_gradcomp.kernels.triton_adacomp` (that module's docstring says what they
compute and which torch ops they match bit for bit).

Imported only by that module, once Triton is known to import (parameters carry Triton's annotations; mypy skips
these bodies, see pyproject.toml).

Every kernel runs one program per *tile of bins*: a row ``(layer, first bin)`` of an int64 ``[tiles, 2]`` table,
``BINS`` whole bins of one layer held as a ``[BINS, LPAD]`` block (``LPAD`` >= every L_T of the group), so a bin's
maximum and its selection are one program's reductions. A layer's row of the int64 ``[layers, META]`` table holds
its flat offset, numel, L_T, first bin in the group, bins, offset field bits, bytes per word and first word slot
(see ``triton_adacomp.Tables``).
"""

import triton
import triton.language as tl

#: columns of the per-layer table
META = tl.constexpr(8)


@triton.jit
def _bins(meta_ptr, tiles_ptr, BINS: tl.constexpr, LPAD: tl.constexpr):
    # the tile's layer row, its bins (numbered in the layer) and each element's place in the [BINS, LPAD] block
    pid = tl.program_id(0)
    layer = tl.load(tiles_ptr + 2 * pid)
    row = meta_ptr + layer * META
    offset = tl.load(row)
    numel = tl.load(row + 1)
    size = tl.load(row + 2)
    bins = tl.load(tiles_ptr + 2 * pid + 1) + tl.arange(0, BINS)
    j = tl.arange(0, LPAD)[None, :]
    local = bins[:, None] * size + j
    valid = (j < size) & (local < numel)
    # the bins' places in the group's bin vectors, and which are bins of the layer
    return layer, row, offset, size, tl.load(row + 3) + bins, bins < tl.load(row + 4), j, local, valid


@triton.jit
def bin_max_kernel(g_ptr, meta_ptr, tiles_ptr, gmax_ptr, BINS: tl.constexpr, LPAD: tl.constexpr):
    """Each bin's max |G|, NaN when the bin holds a NaN (as ``scatter_reduce`` amax propagates it): the maximum of
    the magnitudes' bits, as non-negative floats order as their bits do and a NaN's bits exceed infinity's."""
    layer, row, offset, size, at, in_layer, j, local, valid = _bins(meta_ptr, tiles_ptr, BINS, LPAD)
    m = tl.abs(tl.load(g_ptr + offset + local, mask=valid, other=0.0).to(tl.float32))
    top = tl.max(m.to(tl.int32, bitcast=True), axis=1)
    tl.store(gmax_ptr + at, top.to(tl.float32, bitcast=True), mask=in_layer)


@triton.jit
def select_kernel(g_ptr, dw_ptr, factor, meta_ptr, tiles_ptr, gmax_ptr, scale_ptr, counts_ptr, first_ptr, last_ptr,
                  words_ptr, used_ptr, TERNARY: tl.constexpr, BINS: tl.constexpr, LPAD: tl.constexpr):
    """AdaComp's selection |H| >= gmax(bin), G != 0 (and 2|G| >= scale for the ternary quantizer) with H = G +
    ``factor`` dW, written as the element word slots of the wire (two bytes per slot: the word's low and high byte,
    and whether each is sent); per bin its count and first and last sent offsets (``LPAD``, -1 when none)."""
    layer, row, offset, size, at, in_layer, j, local, valid = _bins(meta_ptr, tiles_ptr, BINS, LPAD)
    bits = tl.load(row + 5)
    wide = tl.load(row + 6) == 2
    first_slot = tl.load(row + 7)
    g = tl.load(g_ptr + offset + local, mask=valid, other=0.0).to(tl.float32)
    dw = tl.load(dw_ptr + offset + local, mask=valid, other=0.0).to(tl.float32)
    h = g + factor * dw  # two roundings (fma off), as the torch ops' product then sum
    gmax = tl.load(gmax_ptr + at, mask=in_layer, other=0.0)
    send = (tl.abs(h) >= gmax[:, None]) & (g != 0.0) & valid
    if TERNARY:
        send = send & (2.0 * tl.abs(g) >= tl.load(scale_ptr + layer))
    sent = send.to(tl.int32)
    tl.store(counts_ptr + at, tl.sum(sent, axis=1).to(tl.int64), mask=in_layer)
    tl.store(first_ptr + at, tl.min(tl.where(send, j, LPAD), axis=1).to(tl.int64), mask=in_layer)
    tl.store(last_ptr + at, tl.max(tl.where(send, j, -1), axis=1).to(tl.int64), mask=in_layer)
    code = tl.where(g > 0.0, 2, 0).to(tl.int64)  # sign(G) + 1 of a sent entry (G != 0)
    word = (code << bits) | j
    slot = 2 * (first_slot + 2 + (local // size) * (size + 1) + j + 1)  # after the scale's two slots and the bin's marker
    tl.store(words_ptr + slot, (word & 0xFF).to(tl.uint8), mask=valid)
    tl.store(words_ptr + slot + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=valid)
    tl.store(used_ptr + slot, sent.to(tl.uint8), mask=valid)
    tl.store(used_ptr + slot + 1, (send & wide).to(tl.uint8), mask=valid)


@triton.jit
def _words(payload_ptr, starts_ptr, nbytes_ptr, meta_ptr, tiles_ptr, BLOCK: tl.constexpr):
    # a tile of a layer's word bytes (after its 4 scale bytes) of one rank's payload: per byte whether a word starts
    # there, its code and offset field, whether it is a marker, and how far it advances the running bin (a marker by
    # its field, an entry whose offset does not increase over the previous entry's by one)
    pid = tl.program_id(0)
    layer = tl.load(tiles_ptr + 2 * pid)
    row = meta_ptr + layer * META
    bits = tl.load(row + 5)
    width = tl.load(row + 6)
    start = tl.load(starts_ptr + layer)
    n = tl.load(nbytes_ptr + layer)
    rel = 4 + tl.load(tiles_ptr + 2 * pid + 1) + tl.arange(0, BLOCK)
    # a word's high byte only for 16-bit words (the width compared as a block: the interpreter refuses a mask made
    # with a scalar bool)
    wide = (tl.zeros([BLOCK], tl.int64) + width) == 2
    field_mask = (1 << bits) - 1
    starts_word = (rel < n) & ((rel - 4) % width == 0)
    at = payload_ptr + start + rel
    word = tl.load(at, mask=starts_word, other=0).to(tl.int64)
    word |= tl.load(at + 1, mask=starts_word & wide, other=0).to(tl.int64) << 8
    code = word >> bits
    field = word & field_mask
    is_marker = starts_word & (code == 3)
    has_previous = starts_word & (rel - width >= 4)
    previous = tl.load(at - width, mask=has_previous, other=0).to(tl.int64)
    previous |= tl.load(at - width + 1, mask=has_previous & wide, other=0).to(tl.int64) << 8
    prev_marker = ~has_previous | ((previous >> bits) == 3)
    implicit = starts_word & ~is_marker & ~prev_marker & (field <= (previous & field_mask))
    advance = tl.where(is_marker, field, implicit.to(tl.int64))
    return row, start, n, code, field, starts_word & ~is_marker, advance


@triton.jit
def advance_kernel(payload_ptr, starts_ptr, nbytes_ptr, meta_ptr, tiles_ptr, sums_ptr, BLOCK: tl.constexpr):
    """How far each tile of word bytes advances its layer's running bin (the first pass of the decode's scan)."""
    row, start, n, code, field, entry, advance = _words(payload_ptr, starts_ptr, nbytes_ptr, meta_ptr, tiles_ptr, BLOCK)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(advance, axis=0))


@triton.jit
def decode_add_kernel(payload_ptr, starts_ptr, nbytes_ptr, meta_ptr, tiles_ptr, carry_ptr, out_ptr,
                      BLOCK: tl.constexpr):
    """A tile of one rank's word bytes decoded and added into ``out`` (``out[index] += value``), its running bin
    starting from ``carry`` (the layer's tiles before it). A rank's indices are distinct, so no two lanes touch one
    element: no atomics."""
    row, start, n, code, field, entry, advance = _words(payload_ptr, starts_ptr, nbytes_ptr, meta_ptr, tiles_ptr, BLOCK)
    head = tl.arange(0, 4)
    scale_bytes = tl.load(payload_ptr + start + head, mask=head < n, other=0).to(tl.int32)
    scale = tl.sum(scale_bytes << (8 * head), axis=0).to(tl.float32, bitcast=True)
    running = tl.load(carry_ptr + tl.program_id(0)) + tl.cumsum(advance, axis=0)
    element = out_ptr + tl.load(row) + running * tl.load(row + 2) + field
    value = (code - 1).to(tl.float32) * scale
    tl.store(element, tl.load(element, mask=entry, other=0.0) + value, mask=entry)
