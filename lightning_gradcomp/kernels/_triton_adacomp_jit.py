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
    # the tile's layer row, its bins (a column [BINS, 1], numbered in the layer) and each element's place
    pid = tl.program_id(0)
    layer = tl.load(tiles_ptr + 2 * pid)
    row = meta_ptr + layer * META
    offset = tl.load(row)
    numel = tl.load(row + 1)
    size = tl.load(row + 2)
    first_bin = tl.load(row + 3)
    nbins = tl.load(row + 4)
    b = tl.load(tiles_ptr + 2 * pid + 1) + tl.arange(0, BINS)[:, None]
    j = tl.arange(0, LPAD)[None, :]
    local = b * size + j
    valid = (j < size) & (local < numel)
    return layer, row, offset, size, first_bin, nbins, b, j, local, valid


@triton.jit
def bin_max_kernel(g_ptr, meta_ptr, tiles_ptr, gmax_ptr, BINS: tl.constexpr, LPAD: tl.constexpr):
    """Each bin's max |G|, NaN when the bin holds a NaN (as ``scatter_reduce`` amax propagates it)."""
    layer, row, offset, size, first_bin, nbins, b, j, local, valid = _bins(meta_ptr, tiles_ptr, BINS, LPAD)
    m = tl.abs(tl.load(g_ptr + offset + local, mask=valid, other=0.0).to(tl.float32))
    nan = tl.max((m != m).to(tl.int32), axis=1)
    top = tl.max(tl.where(m != m, 0.0, m), axis=1)
    bins = tl.sum(b, axis=1)  # the column as a vector
    tl.store(gmax_ptr + first_bin + bins, tl.where(nan > 0, float("nan"), top), mask=bins < nbins)


@triton.jit
def select_kernel(g_ptr, dw_ptr, factor, meta_ptr, tiles_ptr, gmax_ptr, scale_ptr, counts_ptr, first_ptr, last_ptr,
                  words_ptr, used_ptr, TERNARY: tl.constexpr, BINS: tl.constexpr, LPAD: tl.constexpr):
    """AdaComp's selection |H| >= gmax(bin), G != 0 (and 2|G| >= scale for the ternary quantizer) with H = G +
    ``factor`` dW, written as the element word slots of the wire (two bytes per slot: the word's low and high byte,
    and whether each is sent); per bin its count and first and last sent offsets (``LPAD``, -1 when none)."""
    layer, row, offset, size, first_bin, nbins, b, j, local, valid = _bins(meta_ptr, tiles_ptr, BINS, LPAD)
    bits = tl.load(row + 5)
    wide = tl.load(row + 6) == 2
    first_slot = tl.load(row + 7)
    g = tl.load(g_ptr + offset + local, mask=valid, other=0.0).to(tl.float32)
    dw = tl.load(dw_ptr + offset + local, mask=valid, other=0.0).to(tl.float32)
    h = g + factor * dw  # two roundings (fma off), as the torch ops' product then sum
    bins = tl.sum(b, axis=1)
    in_layer = bins < nbins
    gmax = tl.load(gmax_ptr + first_bin + bins, mask=in_layer, other=0.0)
    send = (tl.abs(h) >= gmax[:, None]) & (g != 0.0) & valid
    if TERNARY:
        send = send & (2.0 * tl.abs(g) >= tl.load(scale_ptr + layer))
    sent = send.to(tl.int32)
    tl.store(counts_ptr + first_bin + bins, tl.sum(sent, axis=1).to(tl.int64), mask=in_layer)
    tl.store(first_ptr + first_bin + bins, tl.min(tl.where(send, j, LPAD), axis=1).to(tl.int64), mask=in_layer)
    tl.store(last_ptr + first_bin + bins, tl.max(tl.where(send, j, -1), axis=1).to(tl.int64), mask=in_layer)
    code = tl.where(g > 0.0, 2, 0).to(tl.int64)  # sign(G) + 1 of a sent entry (G != 0)
    word = (code << bits) | j
    slot = 2 * (first_slot + 2 + b * (size + 1) + j + 1)  # after the scale's two slots and the bin's marker
    tl.store(words_ptr + slot, (word & 0xFF).to(tl.uint8), mask=valid)
    tl.store(words_ptr + slot + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=valid)
    tl.store(used_ptr + slot, sent.to(tl.uint8), mask=valid)
    tl.store(used_ptr + slot + 1, (send & wide).to(tl.uint8), mask=valid)
