"""Gradient Dropping's group kernels for CUDA in Triton: threshold sample, selection and ``coo32`` encode, decode.

They compute what :meth:`GradientDropping.compress_flat <lightning_gradcomp.compressors.GradientDropping.compress_flat>`
and its decoders compute with torch ops (``compressors/graddrop_group.py``: its CUDA path before these kernels, still
its path without Triton), bit for bit, in a number of launches that does not depend on the number of layers:

* :func:`sample`: every layer's threshold sample of |x| in one launch (the positions of ``gather_samples``: a
  random sample's draws ``hash(j) mod numel`` from the layer's stream keys, Marian's stride, or the whole layer),
  replacing the per-element hash of ``CounterStreams.bits_flat``, the ``remainder``, ``index_put`` and
  ``index_select``. The samples' per-layer sort stays on torch ops (``segment_thresholds``: a fixed number of ops over
  the small sample).
* :func:`select_encode`: ``survivors_mask``'s rule (dropped at or below the layer's threshold, NaN kept; a layer with
  nothing above a positive threshold sends its ties; with fp16 values, values beyond fp16's range wait, counted) in two
  launches over the group (the first marks the layers with anything above their threshold, the second writes the mask
  and counts it per layer and per compaction tile with integer atomics), then
  :func:`~lightning_gradcomp.kernels.triton_compact.compact` writes the ``[int32 index x K][value x K]`` payload in
  position order: ``encode_group_coo32``'s ``nonzero``, ``index_select``, conversion and ``cat``. K is read once per
  group (as ``nonzero`` reads it); the per-layer counts stay on the device.
* :func:`statistics`: the per-layer bytes and the packet's statistics from the counts in one launch, instead of a
  dozen elementwise ops over ``[layers]`` vectors.
* :func:`decode` (one packet, ``sent_flat``) and :func:`decode_mean_into` (every rank's packet added in rank order,
  then ``Tensor.div_`` as the torch path divides): ``decode_group_coo32``'s copy and conversions and the
  ``index_put_`` / ``index_add_`` per rank, reading the payload in place where it is aligned for int32.

Triton is imported on first use (:mod:`~lightning_gradcomp.kernels.triton_launch`); under ``TRITON_INTERPRET=1`` the
kernels run on CPU tensors in Triton's interpreter.
"""

import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.kernels import triton_compact
from lightning_gradcomp.kernels.segmented import host_to_device
from lightning_gradcomp.kernels.triton_launch import bodies, launch, programs, tiles

#: sampled values per program of the sample kernel; the selection kernels take triton_compact.BLOCK elements
SAMPLE_BLOCK = 1024
#: layers per program of the statistics kernel
STATISTICS_BLOCK = 128
#: the sample modes of GroupTables (graddrop_group.plan_samples's, as the compiled kernels read them)
STRIDED, RANDOM, WHOLE = 0, 1, 2


def _jit() -> ModuleType:
    return bodies("_triton_graddrop_jit")


class GroupTables:
    """The per-layer and per-tile tables the kernels read for one group of layers and sample plan, on one device.

    Args:
        numels: elements of each layer.
        sizes: each layer's threshold sample size (``numel`` for a whole layer; 0 for an empty one).
        modes: each layer's sample mode: :data:`STRIDED` (``numel // size`` apart from 0 on), :data:`RANDOM` or
            :data:`WHOLE`.
        device: where the kernels run.
    """

    def __init__(self, numels: Sequence[int], sizes: Sequence[int], modes: Sequence[int], device: torch.device) -> None:
        offsets = list(itertools.accumulate(numels, initial=0))
        sample_offsets = list(itertools.accumulate(sizes, initial=0))
        columns = (offsets[:-1], list(numels), list(sizes), list(modes), sample_offsets[:-1])
        #: int64 ``[layers, 5]``: offset, numel, sample size, sample mode, sample offset of each layer
        self.meta = torch.tensor(list(zip(*columns)), dtype=torch.int64).reshape(-1, 5).to(device)
        self.samples = tiles(sizes, SAMPLE_BLOCK).to(device)
        self.elements = tiles(numels, triton_compact.BLOCK).to(device)
        #: the keys of a group that draws nothing (every layer's sample is fixed)
        self.no_keys = torch.zeros(len(numels), 2, dtype=torch.int64, device=device)
        self.layers = len(numels)
        self.total = offsets[-1]
        self.sample_total = sample_offsets[-1]


def keys_on(keys: Sequence[tuple[int, int]], device: torch.device) -> Tensor:
    """int64 ``[layers, 2]`` on ``device``: each layer's stream keys (``CounterStreams.keys``) for :func:`sample`."""
    return host_to_device([k for pair in keys for k in pair], device).view(-1, 2)


def sample(x: Tensor, tables: GroupTables, keys: Optional[Tensor]) -> Tensor:
    """float32 ``[tables.sample_total]``: every layer's threshold sample of |x|, back to back.

    Args:
        x: the group's float32 gradients, contiguous.
        tables: the group's tables on ``x``'s device.
        keys: :func:`keys_on` of the layers' next draws, or ``None`` when no layer draws.
    """
    out = torch.empty(tables.sample_total, dtype=torch.float32, device=x.device)
    launch(_jit().sample_kernel, tables.samples.shape[0], x, tables.meta, tables.samples,
           tables.no_keys if keys is None else keys, out, BLOCK=SAMPLE_BLOCK)
    return out


def select_encode(
    x: Tensor, tables: GroupTables, thresholds: Tensor, dtype: torch.dtype, fp16: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``coo32`` payload of the survivors (uint8 ``[int32 index x K][value x K]``, indices from the group's start,
    values converted to ``dtype``), int64 ``[layers]`` survivors per layer and int64 ``[layers]`` values left out for
    being beyond fp16's range (``fp16``; zeros otherwise).

    Args:
        x: the group's float32 gradients, contiguous.
        tables: the group's tables on ``x``'s device.
        thresholds: float32 ``[layers]`` drop thresholds.
        dtype: the values' wire dtype.
        fp16: whether values beyond fp16's range wait in the residual (fp16 values).
    """
    layers, tile_count = tables.layers, programs(tables.total, triton_compact.BLOCK)
    counters = torch.zeros(3 * layers + tile_count, dtype=torch.int64, device=x.device)  # one memset for all
    marked, counts, overflow, tile_counts = counters.split((layers, layers, layers, tile_count))
    mask = torch.empty(tables.total, dtype=torch.uint8, device=x.device)
    grid, jit = tables.elements.shape[0], _jit()
    launch(jit.above_kernel, grid, x, tables.meta, tables.elements, thresholds, marked, BLOCK=triton_compact.BLOCK)
    launch(jit.select_kernel, grid, x, tables.meta, tables.elements, thresholds, marked, mask, counts, overflow,
           tile_counts, FP16=fp16, BLOCK=triton_compact.BLOCK)
    kept = int(tile_counts.sum())  # the group's one host read: the payload's size
    payload = torch.empty(kept * (4 + dtype.itemsize), dtype=torch.uint8, device=x.device)
    index, values = _split(payload, kept, dtype)
    triton_compact.compact(mask, x, index, values, tile_counts)
    return payload, counts, overflow


def statistics(
    counts: Tensor, overflow: Tensor, numels: Tensor, value_bytes: int
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per layer, in one launch: the bytes sent (int64, ``layer_nbytes``) and the float32 statistics sparsity, sent,
    compression rate and fp16 overflow, as the torch path computes them from the int64 ``counts`` and ``overflow``
    and the float64 ``numels`` (in float64, rounded once to float32).

    Args:
        counts: int64 ``[layers]`` survivors.
        overflow: int64 ``[layers]`` values left out for being beyond fp16's range.
        numels: float64 ``[layers]``, the layers' numels.
        value_bytes: bytes per sent value.
    """
    layers = counts.numel()
    nbytes = torch.empty(layers, dtype=torch.int64, device=counts.device)
    rows = torch.empty(4, layers, dtype=torch.float32, device=counts.device)
    launch(_jit().statistics_kernel, programs(layers, STATISTICS_BLOCK), counts, overflow, numels, layers, nbytes,
           rows, VALUE_BYTES=value_bytes, BLOCK=STATISTICS_BLOCK)
    sparsity, sent, rate, over = rows.unbind(0)
    return nbytes, (sparsity, sent, rate, over)


def _split(payload: Tensor, count: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The int32 index and ``dtype`` value sections of a ``coo32`` payload of ``count`` entries, as views."""
    return payload[: 4 * count].view(torch.int32), payload[4 * count :].view(dtype)


def _sections(payload: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`_split` of a received payload (its count from its length), copied first where it does not start on a
    4-byte boundary (a group's bytes within a gathered row)."""
    raw = payload.reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 4 or raw.data_ptr() % 4:
        raw = raw.clone()
    return _split(raw, raw.numel() // (4 + dtype.itemsize), dtype)


def decode(payload: Tensor, dtype: torch.dtype, total: int) -> Tensor:
    """float32 ``[total]``: one ``coo32`` payload with ``dtype`` values decoded (zeros where nothing was sent)."""
    out = torch.zeros(total, dtype=torch.float32, device=payload.device)
    return triton_compact.scatter(*_sections(payload, dtype), out)


def decode_mean_into(payloads: Sequence[Tensor], dtype: torch.dtype, out: Tensor) -> Tensor:
    """The mean of the ranks' ``coo32`` payloads (``dtype`` values) into the float32 contiguous ``out``: each rank's
    survivors added in rank order (distinct positions within a rank), then ``out.div_(ranks)``, the torch path's own
    division (so it rounds as on the device it runs)."""
    out.zero_()
    for payload in payloads:
        triton_compact.scatter_add(*_sections(payload, dtype), out)
    return out.div_(len(payloads))


__all__ = [
    "RANDOM", "SAMPLE_BLOCK", "STATISTICS_BLOCK", "STRIDED", "WHOLE", "GroupTables", "decode", "decode_mean_into",
    "keys_on", "sample", "select_encode", "statistics",
]
