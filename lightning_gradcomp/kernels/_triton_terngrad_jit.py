"""The Triton bodies of :mod:`lightning_gradcomp.kernels.triton_terngrad` (that module's docstring says what they
compute and which torch ops they match bit for bit).

Imported only by that module, and only once Triton is known to import: this module imports Triton at its top, as
``@triton.jit`` needs it at definition. Parameters carry Triton's annotations (``tl.constexpr`` marks a
compile-time constant), not Python's: Triton reads them to specialise the kernel (mypy skips these bodies,
see pyproject.toml).

Every kernel runs one program per *tile*: a row ``(layer, start)`` of an int64 ``[tiles, 2]`` table, ``BLOCK``
elements (or packed bytes) of one layer from ``start`` on, so the grid covers a group of layers of any sizes in
one launch and no per-element index tensor is read. A layer's row of the int64 ``[layers, META]`` table holds
its flat offset, numel, packed bytes, payload start and first chunk (see ``triton_terngrad.GroupTables``).
"""

import triton
import triton.language as tl

#: columns of the per-layer table: offset, numel, packed bytes, payload start, first chunk
META = tl.constexpr(5)
#: 2**-24: a 24-bit integer to a uniform in [0, 1), as kernels/rng.py (a kernel reads only constexpr globals)
TWO_POW_MINUS_24 = tl.constexpr(2.0**-24)


@triton.jit
def lowbias32_uint32(x):
    # Wellons' lowbias32 on uint32 (multiplications wrap mod 2**32), as rng.lowbias32 on int64 holding uint32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _layer(meta_ptr, tiles_ptr):
    pid = tl.program_id(0)
    layer = tl.load(tiles_ptr + 2 * pid)
    start = tl.load(tiles_ptr + 2 * pid + 1)
    row = meta_ptr + layer * META
    return layer, start, tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _chunk_values(ptr, first_chunk, w, valid, bucket, CHUNKED: tl.constexpr):
    # the per-chunk value of each element: one scalar per layer, or a gather by chunk
    if CHUNKED:
        return tl.load(ptr + first_chunk + w // bucket, mask=valid, other=0.0)
    else:
        return tl.load(ptr + first_chunk)


@triton.jit
def _ternary(x_ptr, offset, w, valid, layer, keys_ptr, scale_ptr, clip_ptr, first_chunk, bucket,
             HAS_CLIP: tl.constexpr, CHUNKED: tl.constexpr):
    # int32 ternaries of the elements w of a layer (0 where not valid): FlatTernGrad.ternarize element by element
    g = tl.load(x_ptr + offset + w, mask=valid, other=0.0).to(tl.float32)
    k0 = tl.load(keys_ptr + 2 * layer).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * layer + 1).to(tl.uint32)
    h = lowbias32_uint32(lowbias32_uint32(w.to(tl.uint32) + k0) ^ k1)
    u = (h >> 8).to(tl.float32) * TWO_POW_MINUS_24
    s = _chunk_values(scale_ptr, first_chunk, w, valid, bucket, CHUNKED)
    a = tl.abs(g)
    if HAS_CLIP:
        c = _chunk_values(clip_ptr, first_chunk, w, valid, bucket, CHUNKED)
        a = tl.where(a > c, c, a)
        a = tl.where(c != c, c, a)  # torch.minimum: NaN if either is NaN
    keep = (u * s < a) & valid
    sign = tl.where(g > 0, 1, tl.where(g < 0, -1, 0))
    return tl.where(keep, sign, 0)


@triton.jit
def ternarize_kernel(x_ptr, meta_ptr, tiles_ptr, keys_ptr, scale_ptr, clip_ptr, out_ptr, nonzero_ptr, bucket,
                     HAS_CLIP: tl.constexpr, CHUNKED: tl.constexpr, BLOCK: tl.constexpr):
    """int8 ternaries of a tile of elements, and the tile's nonzero count added to its layer's."""
    layer, start, offset, numel, _packed, _at, first_chunk = _layer(meta_ptr, tiles_ptr)
    w = start + tl.arange(0, BLOCK)
    valid = w < numel
    t = _ternary(x_ptr, offset, w, valid, layer, keys_ptr, scale_ptr, clip_ptr, first_chunk, bucket, HAS_CLIP, CHUNKED)
    tl.store(out_ptr + offset + w, t.to(tl.int8), mask=valid)
    tl.atomic_add(nonzero_ptr + layer, tl.sum((t != 0).to(tl.int32), axis=0))


@triton.jit
def _parts(packed, numel, k, PER: tl.constexpr, PER_P2: tl.constexpr):
    # byte k of a layer packs elements j * packed + k, j < PER (wire.pack_ternary's quarter / fifth split)
    j = tl.arange(0, PER_P2)
    in_bytes = k < packed
    w = j[:, None] * packed + k[None, :]
    valid = (j[:, None] < PER) & in_bytes[None, :] & (w < numel)
    return j, in_bytes, w, valid


@triton.jit
def _place(j, RADIX: tl.constexpr, PER: tl.constexpr):
    # RADIX ** j, the place value of part j's code in a byte
    place = tl.full(j.shape, 1, tl.int32)
    for i in tl.static_range(1, PER):
        place = tl.where(j >= i, place * RADIX, place)
    return place


@triton.jit
def ternarize_pack_kernel(x_ptr, meta_ptr, tiles_ptr, keys_ptr, scale_ptr, clip_ptr, out_ptr, nonzero_ptr, bucket,
                          HAS_CLIP: tl.constexpr, CHUNKED: tl.constexpr, PER: tl.constexpr, PER_P2: tl.constexpr,
                          RADIX: tl.constexpr, BLOCK: tl.constexpr):
    """A tile of packed bytes (codes t + 1, padding 1) written at the layer's payload start, and its nonzero count."""
    layer, start, offset, numel, packed, at, first_chunk = _layer(meta_ptr, tiles_ptr)
    k = start + tl.arange(0, BLOCK)
    j, in_bytes, w, valid = _parts(packed, numel, k, PER, PER_P2)
    t = _ternary(x_ptr, offset, w, valid, layer, keys_ptr, scale_ptr, clip_ptr, first_chunk, bucket, HAS_CLIP, CHUNKED)
    weight = tl.where(j < PER, _place(j, RADIX, PER), 0)
    byte = tl.sum((t + 1) * weight[:, None], axis=0)  # at most 2 * (RADIX**PER - 1) / (RADIX - 1) < 256
    tl.store(out_ptr + at + k, byte.to(tl.uint8), mask=in_bytes)
    tl.atomic_add(nonzero_ptr + layer, tl.sum(tl.sum((t != 0).to(tl.int32), axis=1), axis=0))


@triton.jit
def _codes(byte, j, RADIX: tl.constexpr, PER: tl.constexpr):
    # the [PER_P2, BLOCK] codes of a row of bytes
    if RADIX == 4:
        return (byte[None, :] >> (2 * j[:, None])) & 3
    else:
        return (byte[None, :] // _place(j, RADIX, PER)[:, None]) % RADIX


@triton.jit
def _divided(v, divisor, DIVIDE: tl.constexpr):
    # 0: no division; 1: true division by `divisor`, the ranks (torch's Tensor.div_ by an int on the CPU); 2: times
    # `divisor`, the float32 reciprocal of the ranks (Tensor.div_ by an int on CUDA: ATen's div_true_kernel_cuda
    # with a CPU scalar)
    if DIVIDE == 1:
        return tl.math.div_rn(v, divisor)
    elif DIVIDE == 2:
        return v * divisor
    else:
        return v


@triton.jit
def decode_kernel(payload_ptr, rank_stride, ranks, meta_ptr, tiles_ptr, scale_ptr, scale_stride, out_ptr, bucket, divisor,
                  SHARED: tl.constexpr, DIVIDE: tl.constexpr, CHUNKED: tl.constexpr, PER: tl.constexpr,
                  PER_P2: tl.constexpr, RADIX: tl.constexpr, BLOCK: tl.constexpr):
    """A tile of packed bytes of every rank (rank r's payload at ``payload_ptr + r * rank_stride``) decoded into the
    float32 elements they pack: with a shared scaler the integer sum of the ternaries scaled once, else each rank's
    ternaries times its scalers (``scale_ptr + r * scale_stride``) summed in rank order; then divided by ``ranks``
    (``divisor``: ``ranks``, or its reciprocal to multiply by; see ``_divided``)."""
    layer, start, offset, numel, packed, at, first_chunk = _layer(meta_ptr, tiles_ptr)
    k = start + tl.arange(0, BLOCK)
    j, in_bytes, w, valid = _parts(packed, numel, k, PER, PER_P2)
    row = payload_ptr + at + k  # rank r's bytes: advanced by rank_stride per rank (no int32 product r * stride)
    if SHARED:
        sums = tl.zeros(w.shape, tl.int32)
        for _ in range(ranks):
            sums += _codes(tl.load(row, mask=in_bytes, other=0).to(tl.int32), j, RADIX, PER)
            row += rank_stride
        v = (sums - ranks).to(tl.float32) * _chunk_values(scale_ptr, first_chunk, w, valid, bucket, CHUNKED)
    else:
        scales = scale_ptr
        v = (_codes(tl.load(row, mask=in_bytes, other=0).to(tl.int32), j, RADIX, PER) - 1).to(tl.float32) \
            * _chunk_values(scales, first_chunk, w, valid, bucket, CHUNKED)
        for _ in range(1, ranks):
            row += rank_stride
            scales += scale_stride
            t = (_codes(tl.load(row, mask=in_bytes, other=0).to(tl.int32), j, RADIX, PER) - 1).to(tl.float32)
            # t * s is exact (t in {-1, 0, 1}): even fused into a multiply-add it would round as the separate add
            v = v + t * _chunk_values(scales, first_chunk, w, valid, bucket, CHUNKED)
    tl.store(out_ptr + offset + w, _divided(v, divisor, DIVIDE), mask=valid)


@triton.jit
def scale_int8_kernel(values_ptr, meta_ptr, tiles_ptr, scale_ptr, out_ptr, bucket,
                      CHUNKED: tl.constexpr, BLOCK: tl.constexpr):
    """float32 ``values * scale`` of a tile of int8 values (ternaries, or their sum over ranks)."""
    layer, start, offset, numel, _packed, _at, first_chunk = _layer(meta_ptr, tiles_ptr)
    w = start + tl.arange(0, BLOCK)
    valid = w < numel
    v = tl.load(values_ptr + offset + w, mask=valid, other=0).to(tl.float32)
    tl.store(out_ptr + offset + w, v * _chunk_values(scale_ptr, first_chunk, w, valid, bucket, CHUNKED), mask=valid)
