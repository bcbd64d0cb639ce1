"""Stream compaction in Triton (the positions and values a mask keeps, in position order, in two launches), and its
inverse for decoders (:func:`scatter_add`).

What ``torch.nonzero(mask)`` then ``x.index_select(0, positions).to(dtype)`` compute, fused: the values are read
once, where kept. The size of the result is the mask's count; :func:`tile_counts` gives it per tile on the device,
so a caller that knows the count (top-k sends exactly k per layer) needs no host read at all, and one that does not
reads one number (``counts.sum()``) per group, where ``torch.nonzero`` on CUDA also reads it.

Selection kernels that already know each tile's count (they compute the mask) may pass it and skip
:func:`tile_counts`'s launch, as long as their tiles are this module's (``BLOCK`` elements from 0 on).
"""

from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.kernels.triton_launch import bodies, launch, programs

#: elements per program
BLOCK = 1024


def _jit() -> ModuleType:
    return bodies("_triton_compact_jit")


def tile_counts(mask: Tensor) -> Tensor:
    """int64 ``[tiles]``: how many of each :data:`BLOCK`-long tile of the flat ``mask`` (bool or uint8) are set."""
    counts = torch.empty(programs(mask.numel(), BLOCK), dtype=torch.int64, device=mask.device)
    launch(_jit().count_kernel, counts.numel(), mask.view(torch.uint8), mask.numel(), counts, BLOCK=BLOCK)
    return counts


def compact(
    mask: Tensor, x: Tensor, index: Tensor, values: Tensor, counts: Optional[Tensor] = None
) -> None:
    """Write the positions the flat ``mask`` keeps into ``index`` (int32) and ``x``'s values there into ``values``
    (converted to its dtype), in position order.

    Args:
        mask: bool or uint8 ``[n]``, contiguous.
        x: ``[n]`` contiguous values.
        index: int32, at least as long as the kept count (only that many are written).
        values: as long as ``index``, of the dtype to send.
        counts: the mask's :func:`tile_counts`, when the caller has them already.
    """
    counts = tile_counts(mask) if counts is None else counts
    starts = counts.cumsum(0) - counts  # each tile's first slot
    launch(_jit().compact_kernel, counts.numel(), mask.view(torch.uint8), mask.numel(), starts, x, index, values,
           BLOCK=BLOCK)


def scatter_add(index: Tensor, values: Tensor, out: Tensor) -> Tensor:
    """``out.index_add_(0, index, values.to(out.dtype))`` for distinct ``index`` (int32 or int64) into a contiguous
    ``out``, with the conversion fused: what a sparse decoder runs once per rank, in rank order, so every element's
    sum over ranks is added in that order (no float atomics)."""
    launch(_jit().scatter_add_kernel, programs(index.numel(), BLOCK), index, values, index.numel(), out,
           ACCUMULATE=True, BLOCK=BLOCK)
    return out


def scatter(index: Tensor, values: Tensor, out: Tensor) -> Tensor:
    """``out[index] = values.to(out.dtype)`` (``index_put_``) for distinct ``index`` (int32 or int64) into a
    contiguous ``out``: one packet decoded on its own, where :func:`scatter_add` into zeros would turn -0.0 into 0.0."""
    launch(_jit().scatter_add_kernel, programs(index.numel(), BLOCK), index, values, index.numel(), out,
           ACCUMULATE=False, BLOCK=BLOCK)
    return out


__all__ = ["BLOCK", "compact", "scatter", "scatter_add", "tile_counts"]
