"""The Triton bodies of :mod:`lightning_gradcomp.kernels.triton_topk` (that module's docstring says what they compute
and which torch ops they match; imported only by it, once Triton is known to import; parameters carry Triton's
annotations, see ``_triton_terngrad_jit``).

Every kernel runs one program per tile, a row ``(layer, start)`` of an int64 ``[tiles, 2]`` table (``BLOCK``
elements of one layer); a layer's row of the int64 ``[layers, 3]`` table holds its flat offset, numel and first tile.

Elements are ranked by an int32 *key* of their magnitude: ``|x|``'s bits (sign cleared; non-negative floats order as
their bits do), every NaN one key (above +inf with ``NAN_FIRST``, as a descending sort puts NaN first; else below
+0.0, as DGC's exact top-k ranks NaN as -1). The k-th largest key of each layer is found by a radix select over
the key's 4 bytes, from the top: pass ``p`` histograms (256 bins per layer, integer atomics: the same counts in
any order) the ``p``-th byte of the keys whose higher bytes are the ones chosen so far, then one program per layer
chooses the byte (``choose_kernel``; the state, int64 ``[layers, 2]``: the bytes chosen so far and how many keys
with them the top k still takes; after 4 passes: the k-th largest key and how many of its ties are taken).
"""

import triton
import triton.language as tl

BINS = tl.constexpr(256)
#: the largest magnitude key (+inf's bits) and NaN's keys in either order
INF_KEY = tl.constexpr(0x7F800000)


@triton.jit
def _tile(tiles_ptr, meta_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    layer = tl.load(tiles_ptr + 2 * pid)
    start = tl.load(tiles_ptr + 2 * pid + 1)
    offset = tl.load(meta_ptr + 3 * layer)
    numel = tl.load(meta_ptr + 3 * layer + 1)
    first = tl.load(meta_ptr + 3 * layer + 2)
    w = start + tl.arange(0, BLOCK)
    return pid, layer, offset, w, w < numel, first


@triton.jit
def _keys(bits_ptr, offset, w, valid, NAN_FIRST: tl.constexpr):
    # int32 magnitude keys (see the module's docstring); 0 where not valid
    b = tl.load(bits_ptr + offset + w, mask=valid, other=0) & 0x7FFFFFFF
    if NAN_FIRST:
        return tl.where(b > INF_KEY, INF_KEY + 1, b)
    else:
        return tl.where(b > INF_KEY, 0, b + 1)


@triton.jit
def choose_kernel(hist_ptr, k_ptr, state_ptr, layers, PASS: tl.constexpr, ROWS: tl.constexpr):
    """``ROWS`` layers per program, after radix pass ``PASS``: the byte of each layer's k-th largest key this pass
    found (the largest whose count of keys from the top reaches the k still wanted), appended to ``state``'s prefix,
    and how many keys with that prefix the top k still takes (``kernels/segmented.kth_largest``'s choice)."""
    layer = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = layer < layers
    if PASS == 0:
        remaining = tl.load(k_ptr + layer, mask=valid, other=0)
        prefix = remaining * 0
    else:
        prefix = tl.load(state_ptr + 2 * layer, mask=valid, other=0)
        remaining = tl.load(state_ptr + 2 * layer + 1, mask=valid, other=0)
    bins = tl.arange(0, BINS)[None, :]
    h = tl.load(hist_ptr + (PASS * layers + layer[:, None]) * BINS + bins, mask=valid[:, None], other=0).to(tl.int64)
    from_top = tl.sum(h, axis=1)[:, None] - tl.cumsum(h, axis=1) + h  # keys with this byte or a larger one
    chosen = tl.maximum(tl.sum((from_top >= remaining[:, None]).to(tl.int64), axis=1) - 1, 0)
    above = tl.sum(tl.where(bins == chosen[:, None], from_top - h, 0), axis=1)
    tl.store(state_ptr + 2 * layer + 1, remaining - above, mask=valid)
    tl.store(state_ptr + 2 * layer, prefix * BINS + chosen, mask=valid)


@triton.jit
def histogram_kernel(bits_ptr, tiles_ptr, meta_ptr, state_ptr, hist_ptr, layers, PASS: tl.constexpr,
                     NAN_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Radix pass ``PASS``: each tile's histogram of the ``PASS``-th key byte (from the top) of its keys that share
    the bytes chosen so far, added into its layer's 256 bins of ``hist[PASS]``."""
    pid, layer, offset, w, valid, first = _tile(tiles_ptr, meta_ptr, BLOCK)
    key = _keys(bits_ptr, offset, w, valid, NAN_FIRST)
    if PASS > 0:
        valid = valid & ((key >> (32 - 8 * PASS)).to(tl.int64) == tl.load(state_ptr + 2 * layer))
    digit = tl.where(valid, (key >> (24 - 8 * PASS)) & 0xFF, 0)
    # the elements left out went to bin 0: take them out again
    left_out = tl.sum((~valid).to(tl.int32), axis=0)
    h = tl.histogram(digit, BINS) - tl.where(tl.arange(0, BINS) == 0, left_out, 0)
    tl.atomic_add(hist_ptr + (PASS * layers + layer) * BINS + tl.arange(0, BINS), h, mask=h != 0)


@triton.jit
def _candidates(bits_ptr, offset, w, valid, layer, state_ptr, bounds_ptr, NAN_FIRST: tl.constexpr,
                BOUNDS: tl.constexpr):
    # (above, candidate) of a tile: the keys above the layer's k-th largest and those equal to it, or with BOUNDS
    # the magnitudes above the layer's upper bound and those within [lower, upper] (float compares: NaN in neither)
    if BOUNDS:
        mag = (tl.load(bits_ptr + offset + w, mask=valid, other=0) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        lower = tl.load(bounds_ptr + 2 * layer)
        upper = tl.load(bounds_ptr + 2 * layer + 1)
        return valid & (mag > upper), valid & (mag >= lower) & (mag <= upper)
    else:
        key = _keys(bits_ptr, offset, w, valid, NAN_FIRST).to(tl.int64)
        kth = tl.load(state_ptr + 2 * layer)
        return valid & (key > kth), valid & (key == kth)


@triton.jit
def ties_kernel(bits_ptr, tiles_ptr, meta_ptr, state_ptr, bounds_ptr, ties_ptr, NAN_FIRST: tl.constexpr,
                BOUNDS: tl.constexpr, BLOCK: tl.constexpr):
    """How many candidates each tile holds (int64 per tile): keys equal to their layer's k-th largest, or with
    ``BOUNDS`` magnitudes within the layer's ``[lower, upper]``."""
    pid, layer, offset, w, valid, first = _tile(tiles_ptr, meta_ptr, BLOCK)
    above, candidate = _candidates(bits_ptr, offset, w, valid, layer, state_ptr, bounds_ptr, NAN_FIRST, BOUNDS)
    tl.store(ties_ptr + pid, tl.sum(candidate.to(tl.int64), axis=0))


@triton.jit
def mark_kernel(bits_ptr, tiles_ptr, meta_ptr, state_ptr, bounds_ptr, before_ptr, mask_ptr, NAN_FIRST: tl.constexpr,
                BOUNDS: tl.constexpr, BLOCK: tl.constexpr):
    """``mask`` = 1 where a layer keeps the element: above (see ``ties_kernel``), or a candidate among the first
    ``state[layer, 1]`` candidates of its layer by position (``before[tile]``: how many candidates the tiles before it
    hold, counted over the whole group: less the layer's first tile's, within the layer)."""
    pid, layer, offset, w, valid, first = _tile(tiles_ptr, meta_ptr, BLOCK)
    above, candidate = _candidates(bits_ptr, offset, w, valid, layer, state_ptr, bounds_ptr, NAN_FIRST, BOUNDS)
    quota = tl.load(state_ptr + 2 * layer + 1)
    tie = candidate.to(tl.int64)
    rank = tl.load(before_ptr + pid) - tl.load(before_ptr + first) + tl.cumsum(tie, axis=0) - tie
    keep = above | (candidate & (rank < quota))
    tl.store(mask_ptr + offset + w, keep.to(tl.uint8), mask=valid)


@triton.jit
def levels_kernel(bits_ptr, tiles_ptr, meta_ptr, thresholds_ptr, steps, hist_ptr, WIDTH: tl.constexpr,
                  BLOCK: tl.constexpr):
    """DGC's threshold counts: each element's level (how many of its layer's ``steps`` thresholds, a row of the
    float32 ``[layers, steps]`` table, its magnitude reaches) histogrammed into the layer's ``steps + 1`` bins of the
    int32 ``[layers, steps + 1]`` ``hist`` (integer atomics; ``WIDTH``: a power of two above ``steps``)."""
    pid, layer, offset, w, valid, first = _tile(tiles_ptr, meta_ptr, BLOCK)
    mag = (tl.load(bits_ptr + offset + w, mask=valid, other=0) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    level = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(0, steps):
        level += (mag >= tl.load(thresholds_ptr + layer * steps + j)).to(tl.int32)
    left_out = tl.sum((~valid).to(tl.int32), axis=0)
    bins = tl.arange(0, WIDTH)
    h = tl.histogram(tl.where(valid, level, 0), WIDTH) - tl.where(bins == 0, left_out, 0)
    tl.atomic_add(hist_ptr + layer * (steps + 1) + bins, h, mask=(bins <= steps) & (h != 0))
