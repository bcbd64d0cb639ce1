"""Segment-wise helpers over a flat group of layers (:class:`~lightning_gradcomp.flat.Segments`), each a fixed
number of ops whatever the number of segments, with no host read and no op whose output size depends on the data.

For the batched sparse compressors (top-k, DGC; reusable by Gradient Dropping and AdaComp):

* :func:`cumsum`: inclusive prefix sums restarting at every segment (with a 0/1 mask: each selected element's
  rank among its layer's selected ones, so "the first k of them" is an elementwise test).
* :func:`kth_largest`: every segment's ``k``-th largest value, exact, by a 4-pass radix select over the float's bits
  (a histogram of 256 bins per segment and pass) instead of a per-layer ``torch.topk`` or a sort of the whole group;
  it also says how many values tied with it the top ``k`` takes, so ties can be broken by position.
* :func:`host_to_device`: a small per-step vector of host integers (random offsets drawn on the host) on the device
  without draining its stream.

torch has segmented reductions (``scatter_reduce``) but no segmented scan or order statistic; ``torch.topk`` and
``torch.kthvalue`` take one ``k`` for all rows of a rectangular tensor, and layers are neither equal in size nor
given equal ``k``. Histograms are ``index_add_`` into a fixed-size buffer, not ``torch.bincount`` (which reads its
input's max on the host on CUDA to size its output).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gradcomp.flat import Segments

_RADIX_BITS = 8
_BINS = 1 << _RADIX_BITS
_SIGN = 1 << 31
_MASK32 = (1 << 32) - 1


def cumsum(values: Tensor, segments: Segments) -> Tensor:
    """Inclusive prefix sums of ``values`` (``[total]``) restarting at every segment.

    Exact for integer dtypes (the intended use: counting selected elements); floating values round differently
    from a per-layer ``cumsum``.
    """
    running = values.cumsum(0)
    per_segment = segments.reduce(values, "sum")
    before = per_segment.cumsum(0) - per_segment  # what the running sum holds when each segment starts
    return running - segments.expand(before)


def order_key(values: Tensor) -> Tensor:
    """int64 keys in ``[0, 2**32)`` that order float32 ``values`` as IEEE's total order does: -NaN < -inf < ... <
    -0.0 < +0.0 < ... < +inf < +NaN (negative floats have their bits flipped, positive ones their sign bit set)."""
    bits = values.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    return torch.where(bits >= _SIGN, _MASK32 - bits, bits + _SIGN)


def from_order_key(keys: Tensor) -> Tensor:
    """float32 values back from :func:`order_key`'s keys."""
    bits = torch.where(keys >= _SIGN, keys - _SIGN, _MASK32 - keys)
    return torch.where(bits >= _SIGN, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def kth_largest(values: Tensor, segments: Segments, k: Tensor) -> tuple[Tensor, Tensor]:
    """Every segment's ``k[s]``-th largest float32 value (1-based, in :func:`order_key`'s order), exactly.

    Four passes of 8 bits each, from the top: a 256-bin histogram per segment of the elements that share the
    digits found so far, then the digit where the count from the top reaches ``k``. Ops: a fixed number
    (about 12 per pass, int32 where the whole group is touched), whatever the number of segments.

    Args:
        values: ``[segments.total]`` float32.
        segments: the layout.
        k: int64 ``[len(segments)]`` on ``values``' device; a segment's result is meaningful only for
            ``1 <= k[s] <= numel[s]`` (others give some value of no meaning, without an error or a host read).

    Returns:
        ``(value, ties)``: the ``k``-th largest of each segment, and how many elements equal to it the top ``k``
        holds (``k`` less those strictly larger; between 1 and the number of elements equal to it).
    """
    n = len(segments)
    device = values.device
    bits = values.contiguous().view(torch.int32)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # ordered as signed integers: negative floats' magnitude bits flipped
    ids = segments.ids(device)
    rows = ids * _BINS
    weight = torch.ones_like(bits)  # 1 for the elements whose higher digits are the ones found so far
    prefix = torch.zeros(n, dtype=torch.int64, device=device)
    remaining = k.to(torch.int64)
    for shift in range(32 - _RADIX_BITS, -1, -_RADIX_BITS):
        digit = (signed >> shift) & (_BINS - 1)
        if shift == 32 - _RADIX_BITS:
            digit ^= _BINS // 2  # the sign bit flipped: unsigned order of the top byte
        hist = torch.zeros(n * _BINS, dtype=torch.int32, device=device).index_add_(0, rows + digit, weight)
        hist = hist.view(n, _BINS).to(torch.int64)
        from_top = hist.flip(1).cumsum(1).flip(1)  # elements with this digit or a larger one
        chosen = ((from_top >= remaining.unsqueeze(1)).sum(1) - 1).clamp_(min=0)
        above = from_top.gather(1, chosen.unsqueeze(1)) - hist.gather(1, chosen.unsqueeze(1))
        remaining = remaining - above.squeeze(1)
        prefix = prefix * _BINS + chosen
        if shift:
            weight = weight * (digit == chosen.to(torch.int32).index_select(0, ids))
    return from_order_key(prefix), remaining


def host_to_device(values: Sequence[int], device: torch.device) -> Tensor:
    """int64 ``values`` (host integers made this step) on ``device``; on CUDA through pinned memory and a
    non-blocking copy, so the copy does not wait for the work already queued on the stream."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


__all__ = ["cumsum", "from_order_key", "host_to_device", "kth_largest", "order_key"]
