"""The Triton bodies of :mod:`lightning_gradcomp.kernels.triton_graddrop` (that module's docstring says what they
compute and which torch ops they match bit for bit).

Imported only by that module, once Triton is known to import (parameters carry Triton's annotations, see
``_triton_terngrad_jit``). Every kernel runs one program per tile: a row ``(layer, start)`` of an int64 ``[tiles, 2]``
table, ``BLOCK`` sampled values or elements of one layer from ``start`` on. A layer's row of the int64
``[layers, META]`` table holds its flat offset, numel, sample size, sample mode (0 strided, 1 random, 2 whole) and
the offset of its sample (see ``triton_graddrop.GroupTables``).
"""

import triton
import triton.language as tl

from lightning_gradcomp.kernels._triton_terngrad_jit import lowbias32_uint32

#: columns of the per-layer table: offset, numel, sample size, sample mode, sample offset
META = tl.constexpr(5)
#: the largest finite fp16 (torch.finfo(torch.float16).max): larger survivors wait in the residual
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def _tile(meta_ptr, tiles_ptr):
    pid = tl.program_id(0)
    layer = tl.load(tiles_ptr + 2 * pid)
    start = tl.load(tiles_ptr + 2 * pid + 1)
    return layer, start, meta_ptr + layer * META


@triton.jit
def sample_kernel(x_ptr, meta_ptr, tiles_ptr, keys_ptr, out_ptr, BLOCK: tl.constexpr):
    """|x| at a tile of a layer's sample positions: draw j of a random sample at ``hash(j) mod numel`` (the layer's
    stream keys, ``rng.positions``'s arithmetic), value j of a fixed one at ``j * (numel // size)`` (Marian's stride;
    1 for a whole layer)."""
    layer, start, row = _tile(meta_ptr, tiles_ptr)
    offset = tl.load(row)
    numel = tl.load(row + 1)
    size = tl.load(row + 2)
    mode = tl.load(row + 3)
    at = tl.load(row + 4)
    j = start + tl.arange(0, BLOCK)
    valid = j < size
    k0 = tl.load(keys_ptr + 2 * layer).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * layer + 1).to(tl.uint32)
    drawn = lowbias32_uint32(lowbias32_uint32(j.to(tl.uint32) + k0) ^ k1).to(tl.int64) % numel  # zero-extended: unsigned
    position = tl.where(mode == 1, drawn, j * (numel // size))
    v = tl.load(x_ptr + offset + position, mask=valid, other=0.0)
    tl.store(out_ptr + at + j, tl.abs(v), mask=valid)


@triton.jit
def _elements(x_ptr, row, start, thresholds_ptr, layer, BLOCK: tl.constexpr):
    # a tile's |x|, its layer's threshold and Marian's drop rule: kept unless at or below it (so NaN is kept)
    offset = tl.load(row)
    w = start + tl.arange(0, BLOCK)
    valid = w < tl.load(row + 1)
    magnitude = tl.abs(tl.load(x_ptr + offset + w, mask=valid, other=0.0))
    threshold = tl.load(thresholds_ptr + layer)
    above = ~(magnitude <= threshold) & valid
    return offset, w, valid, magnitude, threshold, above


@triton.jit
def above_kernel(x_ptr, meta_ptr, tiles_ptr, thresholds_ptr, any_ptr, BLOCK: tl.constexpr):
    """Marks (stores 1 into ``any_ptr[layer]``) the layers that keep anything above their threshold; the stores of a
    layer's tiles all write 1, so they need no atomics."""
    layer, start, row = _tile(meta_ptr, tiles_ptr)
    _offset, _w, _valid, _magnitude, _threshold, above = _elements(x_ptr, row, start, thresholds_ptr, layer, BLOCK)
    tl.store(any_ptr + layer, 1, mask=tl.max(above.to(tl.int32), axis=0) > 0)


@triton.jit
def select_kernel(x_ptr, meta_ptr, tiles_ptr, thresholds_ptr, any_ptr, mask_ptr, counts_ptr, overflow_ptr,
                  tile_counts_ptr, FP16: tl.constexpr, BLOCK: tl.constexpr):
    """The survivors mask of a tile (a layer marked by ``above_kernel`` keeps what is above its threshold, any other
    with a positive threshold its ties ``|x| == threshold``; with ``FP16`` those beyond fp16's range wait, counted
    into ``overflow_ptr[layer]``), its count added to its layer's (``counts_ptr``) and to the ``BLOCK``-long tiles
    of the flat group (``tile_counts_ptr``, ``triton_compact``'s tiles: a layer's tile, ``BLOCK`` long, overlaps at
    most two). Integer atomics only."""
    layer, start, row = _tile(meta_ptr, tiles_ptr)
    offset, w, valid, magnitude, threshold, above = _elements(x_ptr, row, start, thresholds_ptr, layer, BLOCK)
    ties = (tl.load(any_ptr + layer) == 0) & (threshold > 0)
    keep = above | tl.where(ties, (magnitude == threshold) & valid, False)  # (the interpreter cannot `&` a scalar)
    if FP16:
        beyond = keep & (magnitude > FP16_MAX)
        keep = keep & ~beyond
        over = tl.sum(beyond.to(tl.int64), axis=0)
        tl.atomic_add(overflow_ptr + layer, over, mask=over > 0)
    tl.store(mask_ptr + offset + w, keep.to(tl.uint8), mask=valid)
    kept = tl.sum(keep.to(tl.int64), axis=0)
    tl.atomic_add(counts_ptr + layer, kept, mask=kept > 0)
    first = (offset + start) // BLOCK
    in_first = tl.sum((keep & ((offset + w) // BLOCK == first)).to(tl.int64), axis=0)
    tl.atomic_add(tile_counts_ptr + first, in_first, mask=in_first > 0)
    tl.atomic_add(tile_counts_ptr + first + 1, kept - in_first, mask=kept > in_first)


@triton.jit
def statistics_kernel(counts_ptr, overflow_ptr, numels_ptr, layers, nbytes_ptr, out_ptr,
                      VALUE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    """Per layer, the bytes sent and the rows of ``out_ptr`` (float32 ``[4, layers]``): sparsity, sent, compression
    rate and fp16 overflow, each in float64 from the int64 counts and float64 numels and rounded once, as the torch
    path computes them (float64 division is IEEE division, ``div.rn.f64``)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < layers
    counts = tl.load(counts_ptr + i, mask=valid, other=0)
    numels = tl.load(numels_ptr + i, mask=valid, other=1.0)
    nbytes = counts * (4 + VALUE_BYTES)
    tl.store(nbytes_ptr + i, nbytes, mask=valid)
    sparsity = 1.0 - counts.to(tl.float64) / tl.maximum(numels, 1.0)
    rate = 4.0 * numels / tl.maximum(nbytes, 1).to(tl.float64)
    tl.store(out_ptr + i, sparsity.to(tl.float32), mask=valid)
    tl.store(out_ptr + layers + i, counts.to(tl.float32), mask=valid)
    tl.store(out_ptr + 2 * layers + i, rate.to(tl.float32), mask=valid)
    tl.store(out_ptr + 3 * layers + i, tl.load(overflow_ptr + i, mask=valid, other=0).to(tl.float32), mask=valid)
