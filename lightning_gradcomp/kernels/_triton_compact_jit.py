"""The Triton bodies of :mod:`lightning_gradcomp.kernels.triton_compact` (imported only by it, once Triton is
known to import; parameters carry Triton's annotations, see ``_triton_terngrad_jit``)."""

import triton
import triton.language as tl


@triton.jit
def count_kernel(mask_ptr, n, counts_ptr, BLOCK: tl.constexpr):
    """The number of set mask bytes in each ``BLOCK``-long tile."""
    pid = tl.program_id(0)
    w = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = tl.load(mask_ptr + w, mask=w < n, other=0).to(tl.int32)
    tl.store(counts_ptr + pid, tl.sum(m, axis=0).to(tl.int64))


@triton.jit
def compact_kernel(mask_ptr, n, starts_ptr, x_ptr, index_ptr, values_ptr, BLOCK: tl.constexpr):
    """Each kept position (int32) and its value (in ``values_ptr``'s dtype) at slot ``starts[tile]`` + its rank among
    the tile's kept ones: the kept entries in position order, as ``torch.nonzero`` orders them."""
    pid = tl.program_id(0)
    w = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = tl.load(mask_ptr + w, mask=w < n, other=0).to(tl.int32)
    keep = m != 0
    slot = tl.load(starts_ptr + pid) + (tl.cumsum(m, axis=0) - m)
    tl.store(index_ptr + slot, w.to(tl.int32), mask=keep)
    v = tl.load(x_ptr + w, mask=keep, other=0.0)
    tl.store(values_ptr + slot, v.to(values_ptr.dtype.element_ty), mask=keep)


@triton.jit
def scatter_add_kernel(index_ptr, values_ptr, count, out_ptr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    """``out[index[i]] += values[i]`` (in ``out``'s dtype) for ``i < count``; the indices of one call are distinct, so
    no two programs touch one element and the sum needs no atomics (one call per rank: rank order). Without ``ADD``:
    ``out[index[i]] = values[i]`` (``index_copy_``)."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < count
    at = tl.load(index_ptr + i, mask=valid, other=0).to(tl.int64)
    v = tl.load(values_ptr + i, mask=valid, other=0.0).to(out_ptr.dtype.element_ty)
    if ADD:
        v = tl.load(out_ptr + at, mask=valid, other=0.0) + v
    tl.store(out_ptr + at, v, mask=valid)
