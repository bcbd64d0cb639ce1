"""Top-k's exact per-layer selection for CUDA in Triton: every layer's ``k`` largest ``|x|`` of a group in a fixed
number of launches (10), whatever the number of layers, with no host read.

What :meth:`TopK.compress_flat <lightning_gradcomp.compressors.TopK.compress_flat>`'s torch ops select (a segmented
stable sort of ``|x|``, descending, then each layer's first ``k``): the same set, ties at the k-th largest broken by
the lowest position, NaN above +inf (as the descending sort puts it):

* :func:`kth_largest`: 4 radix passes (``histogram_kernel``), one per byte of the magnitude key from the top, each a
  256-bin histogram per layer made by integer atomics (their counts are the same whatever order the atomics land
  in) then the byte chosen by a program per 16 layers (``choose_kernel``), instead of the two sorts of the group;
* :func:`mark`: ``ties_kernel`` counts per tile the keys equal to the layer's k-th largest, one ``cumsum`` places
  the tiles, and ``mark_kernel`` writes the selection mask (above the k-th, or among the first ties by position).

The selected elements are then written in position order by :func:`~lightning_gradcomp.kernels.triton_compact
.compact` (the payload's int32 indices and values, in place): top-k sends exactly ``k`` per layer, so nothing is
read on the host.

Triton is imported on first use; under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors in the interpreter.
"""

from collections.abc import Sequence
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.kernels.triton_launch import bodies, launch, programs, tiles

#: elements per program
BLOCK = 1024
_PASSES = 4
_BINS = 256
#: layers per program of the byte choice
_ROWS = 16


def _jit() -> ModuleType:
    return bodies("_triton_topk_jit")


class SelectTables:
    """The tile and layer tables of one group's selection on one device (made once per group and ``k``).

    Args:
        numels: elements of each layer.
        counts: each layer's ``k`` (0: the layer selects nothing and has no tile, e.g. a dense layer).
        device: where the kernels run.
    """

    def __init__(self, numels: Sequence[int], counts: Sequence[int], device: torch.device) -> None:
        lengths = [n if k else 0 for n, k in zip(numels, counts)]
        rows = tiles(lengths, BLOCK)
        offsets, first = 0, 0
        meta = []
        for n, length in zip(numels, lengths):
            meta.append((offsets, length, first))
            offsets += n
            first += -(-length // BLOCK)
        #: int64 ``[tiles, 2]``: (layer, start) of every tile of a selecting layer
        self.tiles = rows.to(device)
        #: int64 ``[layers, 3]``: flat offset, numel (0 where nothing is selected) and first tile of each layer
        self.meta = torch.tensor(meta, dtype=torch.int64).reshape(-1, 3).to(device)
        #: int64 ``[layers]``: each layer's k
        self.k = torch.tensor(list(counts), dtype=torch.int64).to(device)
        self.layers = len(numels)
        self.total = offsets


def _run(kernel: object, tables: SelectTables, *args: object, **constants: object) -> None:
    launch(kernel, tables.tiles.shape[0], *args, **constants)  # one program per tile


def kth_largest(x: Tensor, tables: SelectTables, nan_first: bool = True) -> Tensor:
    """The radix select over the float32 ``x`` (``[total]``, contiguous): int64 ``[layers, 2]``, each layer's k-th
    largest magnitude key and how many keys equal to it its top k takes (see ``_triton_topk_jit``).

    Args:
        x: the group's values.
        tables: the group's tables on ``x``'s device.
        nan_first: NaN magnitudes rank above +inf (top-k's sort), else below +0.0 (DGC's exact top-k).
    """
    bits = x.view(torch.int32)
    hist = torch.zeros(_PASSES, tables.layers, _BINS, dtype=torch.int32, device=x.device)
    state = torch.empty(tables.layers, 2, dtype=torch.int64, device=x.device)
    for p in range(_PASSES):
        _run(_jit().histogram_kernel, tables, bits, tables.tiles, tables.meta, state, hist, tables.layers,
             PASS=p, NAN_FIRST=nan_first, BLOCK=BLOCK)
        launch(_jit().choose_kernel, programs(tables.layers, _ROWS), hist, tables.k, state, tables.layers, PASS=p,
               ROWS=_ROWS)
    return state


def mark(
    x: Tensor, tables: SelectTables, state: Tensor, mask: Tensor, nan_first: bool = True,
    bounds: Optional[Tensor] = None,
) -> Tensor:
    """Set ``mask`` (uint8 ``[total]``, zeros where no layer selects) to 1 at each layer's top ``k`` of ``|x|``
    (ties broken by the lowest position), given :func:`kth_largest`'s state.

    With ``bounds`` (float32 ``[layers, 2]``: lower, upper), instead: 1 where ``|x| > upper``, and at the first
    ``state[:, 1]`` elements by position of each layer with ``lower <= |x| <= upper`` (DGC's rule, float compares)."""
    bits = x.view(torch.int32)
    ties = torch.empty(tables.tiles.shape[0], dtype=torch.int64, device=x.device)
    flags = {"NAN_FIRST": nan_first, "BOUNDS": bounds is not None, "BLOCK": BLOCK}
    limits = state if bounds is None else bounds
    _run(_jit().ties_kernel, tables, bits, tables.tiles, tables.meta, state, limits, ties, **flags)
    before = ties.cumsum(0) - ties
    _run(_jit().mark_kernel, tables, bits, tables.tiles, tables.meta, state, limits, before, mask, **flags)
    return mask


def level_counts(x: Tensor, tables: SelectTables, thresholds: Tensor) -> Tensor:
    """int32 ``[layers, steps + 1]``: per layer, how many ``|x|`` reach exactly ``j`` of its ``steps`` thresholds
    (float32 ``[layers, steps]``, contiguous, decreasing along a row): DGC's counts of every threshold at once."""
    steps = thresholds.shape[1]
    hist = torch.zeros(tables.layers, steps + 1, dtype=torch.int32, device=x.device)
    _run(_jit().levels_kernel, tables, x.view(torch.int32), tables.tiles, tables.meta, thresholds, steps, hist,
         WIDTH=1 << steps.bit_length(), BLOCK=BLOCK)
    return hist


def select(x: Tensor, tables: SelectTables) -> Tensor:
    """uint8 ``[total]``: 1 at every layer's top ``k`` of ``|x|`` (float32, contiguous), ties by lowest position."""
    mask = torch.zeros(tables.total, dtype=torch.uint8, device=x.device)
    return mark(x, tables, kth_largest(x, tables), mask)


__all__ = ["BLOCK", "SelectTables", "kth_largest", "level_counts", "mark", "select"]
