"""Gradient Dropping over a group of layers in one flat tensor, in a number of ops that does not grow with the layers.

The batched form of :meth:`GradientDropping.compress <lightning_gradcomp.compressors.GradientDropping.compress>`'s
torch path (the path CUDA runs), for unquantized survivors and the ``coo32`` index encoding (the global scope's pool
is the compressor's, :meth:`GradientDropping._group_thresholds`):

* each layer's threshold sample is taken as the per-layer path takes it (the whole layer, Marian's stride, or
  positions drawn from the counter-based streams of
  :class:`~lightning_gradcomp.compressors.streams.CounterStreams`: hash(i) mod n, keyed by seed, rank, name and a
  per-name counter, so the whole group draws in a fixed number of ops); the samples, back to back, are sorted per
  layer at once (:meth:`Segments.sort <lightning_gradcomp.exchange.segments.Segments.sort>`) and each layer's floor(R * m)-th
  value is read at a cached position (``torch.kthvalue`` and a stable sort agree on every value, NaN ranked last);
* the drop rule, the tie rule (a layer with nothing above its threshold sends its ties) and the fp16 overflow
  rule are masks over the whole group, per-layer "any" through one segment reduce;
* one ``nonzero`` per group compacts the survivors; the payload is ``[int32 index x K][value x K]`` with indices
  counted from the group's start, K * (4 + value bytes) in all: each layer's share is exactly its per-layer
  ``coo32`` packet's size (``layer_nbytes``, an int64 device tensor);
* decoding needs only the payload's length (a shape): K = bytes / (4 + value bytes).

Everything is bit-identical to the per-layer loop, the draws included: each layer draws from its own counter, as
the loop does; and the fused backend's kernels draw the same positions. On CUDA with Triton,
:mod:`lightning_gradcomp.kernels.triton_graddrop` runs the sample, the selection, the encode and the decoders in
kernels, bit-identical to these ops (the samples' sort stays here).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.exchange.segments import Segments
from lightning_gradcomp.wire.sparse import ValueFormat, value_dtype, value_nbytes


@dataclass(frozen=True)
class SamplePlan:
    """Where each layer's threshold sample comes from, for one group and one set of sample settings.

    Attributes:
        segments: the sample's own layout (one segment of ``sizes[s]`` values per layer), for the per-layer sort.
        draws: one segment per layer of the random sample size it draws, 0 for a fixed sample (the layers whose
            :class:`~lightning_gradcomp.compressors.streams.CounterStreams` counter a step advances, and the layout of
            :meth:`~lightning_gradcomp.compressors.streams.CounterStreams.bits_flat`'s draws).
        fixed: int64 ``[segments.total]``, the flat positions in the group of the fixed samples, laid out as
            ``segments`` (0 in the drawn layers' slots, which ``drawn_slots`` names; empty when ``whole``).
        drawn_slots: where the drawn positions go in ``fixed``, or ``None`` when every sampled value is drawn.
        draw_numels: per drawn value (laid out as ``draws``), its layer's numel: the draw is ``bits mod numel``.
        draw_offsets: per drawn value, its layer's offset in the group.
        whole: whether every layer's sample is the whole layer (the sample is the magnitudes themselves).
        kth: flat position, in the sorted samples, of each layer's floor(R * m)-th value (0 where k = 0).
        has_k: per layer, whether k > 0 (else the threshold is 0).
        kernel_args: int64 CPU tensors for the group kernels (:func:`~lightning_gradcomp.kernels.graddrop_group_sample`
            and the others): the layers' offsets, sample sizes, sample modes (2 whole, 0 strided, 1 random), k, and
            the samples' offsets.
        weights: per layer, how many elements each sampled value stands for (the global scope's pool weights).
        numels: float64 ``[layers]``, the layers' numels on the device (the statistics' denominators; made once, not
            copied to the device at every step).
    """

    segments: Segments
    draws: Segments
    fixed: Tensor
    drawn_slots: Optional[Tensor]
    draw_numels: Tensor
    draw_offsets: Tensor
    whole: bool
    kth: Tensor
    has_k: Tensor
    kernel_args: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
    weights: tuple[float, ...]
    numels: Tensor


def plan_samples(
    segments: Segments, sizes: Sequence[int], drawn: Sequence[int], strides: Sequence[int], counts: Sequence[int],
    device: torch.device,
) -> SamplePlan:
    """A :class:`SamplePlan` from per-layer sample ``sizes``, random ``drawn`` sizes (0: fixed), fixed ``strides``
    (1: the whole layer) and drop ``counts`` k (the k-th smallest sampled value is the threshold; 0: none)."""
    whole = not any(drawn) and all(m == n for m, n in zip(sizes, segments.numels))
    sample = Segments(segments.names, [torch.Size((m,)) for m in sizes])
    fixed, slots, numels, offsets = [torch.zeros(0, dtype=torch.int64)], [], [], []
    for offset, n, size, draw, stride, start in zip(
        segments.offsets, segments.numels, sizes, drawn, strides, sample.offsets
    ):
        if draw:
            fixed.append(torch.zeros(draw, dtype=torch.int64))
            slots.append(torch.arange(start, start + draw))
            numels.append(torch.full((draw,), n, dtype=torch.int64))
            offsets.append(torch.full((draw,), offset, dtype=torch.int64))
        elif not whole:
            fixed.append(torch.arange(offset, offset + stride * size, stride))
    every = sum(drawn) == sample.total
    kth = [o + k - 1 if k else 0 for o, k in zip(sample.offsets, counts)]
    modes = [1 if d else 2 if m == n else 0 for d, m, n in zip(drawn, sizes, segments.numels)]
    kernel_args = tuple(
        torch.tensor(v, dtype=torch.int64) for v in (segments.offsets, sizes, modes, counts, sample.offsets)
    )
    weights = tuple(n / m if m != n else 1.0 for m, n in zip(sizes, segments.numels))  # as threshold_sample weighs
    return SamplePlan(
        sample, Segments(segments.names, [torch.Size((d,)) for d in drawn]),
        torch.cat(fixed).to(device), None if every else torch.cat(slots or fixed[:1]).to(device),
        torch.cat(numels or fixed[:1]).to(device), torch.cat(offsets or fixed[:1]).to(device), whole,
        torch.tensor(kth, dtype=torch.int64, device=device), torch.tensor([k > 0 for k in counts], device=device),
        kernel_args,  # type: ignore[arg-type]
        weights, torch.tensor(segments.numels, dtype=torch.float64, device=device),
    )


def gather_samples(magnitudes: Tensor, plan: SamplePlan, bits: Optional[Tensor]) -> Tensor:
    """Every layer's threshold sample of |x|, back to back (laid out as ``plan.segments``), in a fixed number of ops.

    Args:
        magnitudes: |x| of the group, flat.
        plan: the group's :class:`SamplePlan`.
        bits: the drawing layers' 32-bit draws laid out as ``plan.draws``
            (:meth:`~lightning_gradcomp.compressors.streams.CounterStreams.bits_flat`), or None when none draws. Draw
            ``i`` of a layer of ``n`` elements samples its element ``bits[i] mod n``: the fused kernel's arithmetic
            (``graddrop_group_sample``), so both backends sample the same positions.
    """
    if plan.whole:
        return magnitudes
    positions = plan.fixed
    if bits is not None and bits.numel():
        drawn = bits.remainder(plan.draw_numels).add_(plan.draw_offsets)
        positions = drawn if plan.drawn_slots is None else positions.index_put((plan.drawn_slots,), drawn)
    return magnitudes.index_select(0, positions)


def segment_thresholds(samples: Tensor, plan: SamplePlan) -> Tensor:
    """``[layers]`` float32: each layer's k-th smallest sampled |x| (0 where k = 0), from :func:`gather_samples`."""
    if plan.segments.total == 0:
        return samples.new_zeros(len(plan.segments))
    ordered, _ = plan.segments.sort(samples)
    kth = ordered.index_select(0, plan.kth)
    return torch.where(plan.has_k, kth, 0.0)


def survivors_mask(magnitudes: Tensor, thresholds: Tensor, segments: Segments) -> Tensor:
    """Marian's rule over the group: not at or below the layer's threshold (so NaN survives); a layer with nothing
    above a positive threshold sends its ties |x| == threshold instead (a device mask, as the per-layer path)."""
    thr = segments.expand(thresholds)
    keep = ~(magnitudes <= thr)
    none_above = segments.reduce(keep.to(torch.float32), "amax") == 0
    return keep | ((magnitudes == thr) & segments.expand(none_above & (thresholds > 0)))


def encode_group_coo32(flat: Tensor, keep: Tensor, fmt: ValueFormat) -> Tensor:
    """``[int32 index x K][value x K]`` bytes of the kept entries, indices from the group's start (one ``nonzero``)."""
    index = torch.nonzero(keep).reshape(-1)
    values = flat.index_select(0, index).to(value_dtype(fmt))
    return torch.cat((index.to(torch.int32).view(torch.uint8), values.view(torch.uint8)))


def decode_group_coo32(payload: Tensor, fmt: ValueFormat) -> tuple[Tensor, Tensor]:
    """(int64 indices, float32 values) of :func:`encode_group_coo32`'s bytes (copied first: a slice of a gathered
    buffer may be misaligned for int32)."""
    count = payload.numel() // (4 + value_nbytes(fmt))
    raw = payload.reshape(-1).view(torch.uint8).clone()
    index = raw[: 4 * count].view(torch.int32).long()
    values = raw[4 * count :].view(value_dtype(fmt)).float()
    return index, values


__all__ = [
    "SamplePlan",
    "decode_group_coo32",
    "encode_group_coo32",
    "gather_samples",
    "plan_samples",
    "segment_thresholds",
    "survivors_mask",
]
