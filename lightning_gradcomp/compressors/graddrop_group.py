"""Gradient Dropping over a group of layers in one flat tensor: the maths of
:class:`~lightning_gradcomp.compressors.GradientDropping`, stated once (a single tensor is a group of one).

The threshold and the survivors are found for the whole group at once, in a number of ops that does not grow with
the layers (the global scope's pool is the compressor's, :meth:`GradientDropping._group_thresholds`):

* each layer's threshold sample is the whole layer, Marian's stride, or positions drawn from the counter-based
  streams of :class:`~lightning_gradcomp.compressors.streams.CounterStreams` (hash(i) mod n, keyed by seed, rank,
  name and a per-name counter, so the whole group draws in a fixed number of ops); the samples, back to back, are
  sorted per layer at once (:meth:`Segments.sort <lightning_gradcomp.flat.Segments.sort>`) and each
  layer's floor(R * m)-th value is read at a cached position (``torch.kthvalue`` and a stable sort agree on every
  value, NaN ranked last);
* the drop rule, the tie rule (a layer with nothing above its threshold sends its ties) and the fp16 overflow
  rule are masks over the whole group, per-layer "any" through one segment reduce.

On the wire, unquantized survivors in ``coo32`` travel as one group payload ``[int32 index x K][value x K]`` with
indices counted from the group's start (one ``nonzero``; each layer's share, K_s * (4 + value bytes), is exactly
what the layer alone would send: ``layer_nbytes``, an int64 device tensor), decoded from the payload's length alone.
Every other wire form (quantized survivors, ``delta16`` indices, and ``coo32`` for a group of 2**31 elements or
more) is each layer's own encoding, back to back: :func:`encode_layer` / :func:`decode_layer` of one layer, looped
over the group's layers inside the group methods.

The fused backend's compiled kernels draw the same positions and select the same survivors; on CUDA with Triton,
:mod:`lightning_gradcomp.kernels.triton_graddrop` runs the sample, the selection, the ``coo32`` encode and the
decoders in kernels, bit-identical to these ops (the samples' sort stays here).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.flat import Segments
from lightning_gradcomp.wire.sparse import (
    IndexEncoding,
    ValueFormat,
    decode_indices,
    decode_sparse,
    encode_indices,
    encode_sparse,
    pack_codes,
    packed_codes_nbytes,
    unpack_codes,
    value_dtype,
    value_nbytes,
)

Quantize = Literal["none", "threshold", "column_mean", "global_mean", "2bit"]


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


#: positions in a group's coo32 payload (and in the compiled and Triton kernels) count from the group's start in int32
INT32_POSITIONS = 2**31

#: the thresholds of a group's layers from its samples: ``(samples, per_layer)`` where ``per_layer()`` selects each
#: layer's threshold on its own sample (the compressor adds the global scope's pool)
Thresholds = Callable[[Tensor, Callable[[], Tensor]], Tensor]


class Survivors(NamedTuple):
    """A group's survivors."""

    #: positions from the group's start, ascending (int64, or int32 from the compiled kernels)
    positions: Tensor
    #: float32 values
    values: Tensor
    #: int64 ``[layers]`` survivors per layer
    counts: Tensor
    #: float32 ``[layers]`` survivors held back beyond fp16's range, or ``None`` without fp16 values
    overflow: Optional[Tensor]


class Coo32Group(NamedTuple):
    """A group's ``coo32`` payload and its per-layer statistics."""

    payload: Tensor
    #: int64 ``[layers]`` bytes per layer
    nbytes: Tensor
    sparsity: Tensor
    sent: Tensor
    compression_rate: Tensor
    overflow: Optional[Tensor]


class GradDropKernels(Protocol):
    """The operations of Gradient Dropping's group step that a kernel set runs (:mod:`~.graddrop_kernels`: torch
    ops, the compiled CPU kernels, Triton's); each gives the torch ops' bits."""

    @property
    def name(self) -> str:
        """The kernel set: ``"torch"``, ``"fused"`` or ``"triton"``."""
        ...

    def select(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool
    ) -> tuple[Tensor, Survivors]:
        """Every layer's threshold and the group's survivors of float32 ``x``."""
        ...

    def select_coo32(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool, fmt: ValueFormat
    ) -> tuple[Tensor, Coo32Group]:
        """Every layer's threshold and the survivors in the group's ``coo32`` payload."""
        ...

    def decode_coo32(self, payload: Tensor, fmt: ValueFormat, total: int) -> Tensor:
        """float32 ``[total]``: a group's ``coo32`` payload, dense."""
        ...

    def sum_into(self, decoded: Sequence[tuple[Tensor, Tensor]], out: Tensor) -> Tensor:
        """Every rank's (positions, values) added into ``out`` in rank order, onto zeros."""
        ...

    def mean_coo32_into(self, payloads: Sequence[Tensor], fmt: ValueFormat, out: Tensor) -> Tensor:
        """The ranks' mean of ``coo32`` payloads into ``out`` (float32)."""
        ...


def fits_fp16(keep: Tensor, magnitudes: Tensor, segments: Segments) -> tuple[Tensor, Tensor]:
    """``keep`` without the survivors beyond fp16's range (fp16 would turn them into inf on every rank; they wait
    in the residual instead), and their count per layer."""
    fits = ~(magnitudes > torch.finfo(torch.float16).max)
    overflow = segments.reduce((keep & ~fits).to(torch.float32), "sum")
    return keep & fits, overflow


def survivors(x: Tensor, magnitudes: Tensor, thresholds: Tensor, segments: Segments, fp16: bool) -> Survivors:
    """The survivors of ``x`` (|x| ``magnitudes``) under each layer's threshold, with torch ops (one ``nonzero``)."""
    keep = survivors_mask(magnitudes, thresholds, segments)
    overflow = None
    if fp16:
        keep, overflow = fits_fp16(keep, magnitudes, segments)
    index = torch.nonzero(keep).reshape(-1)
    # each layer's count from where its bounds fall among the sorted positions (not a sum over the whole group)
    counts = torch.searchsorted(index, segments.bounds(index.device)).diff()
    return Survivors(index, x.index_select(0, index), counts, overflow)


def counted_statistics(plan: SamplePlan, counts: Tensor, nbytes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sparsity, sent, compression rate) per layer from the survivors' ``counts`` and each layer's bytes."""
    numels = plan.numels
    # in float64 then rounded once, as a layer's statistics in Python floats would be
    sparsity = (1.0 - counts / numels.clamp(min=1)).float()
    # bytes fp32 would take over bytes sent (an empty payload counts as 1 byte, to stay finite)
    rate = (4.0 * numels / nbytes.clamp(min=1)).float()
    return sparsity, counts.float(), rate


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


def encode_group_coo32(index: Tensor, values: Tensor, fmt: ValueFormat) -> Tensor:
    """``[int32 index x K][value x K]`` bytes of the survivors (``index``: ascending positions from the group's start,
    ``values``: float32)."""
    return torch.cat((index.to(torch.int32).view(torch.uint8), values.to(value_dtype(fmt)).view(torch.uint8)))


def decode_group_coo32(payload: Tensor, fmt: ValueFormat) -> tuple[Tensor, Tensor]:
    """(int64 indices, float32 values) of :func:`encode_group_coo32`'s bytes (copied first: a slice of a gathered
    buffer may be misaligned for int32)."""
    count = payload.numel() // (4 + value_nbytes(fmt))
    raw = payload.reshape(-1).view(torch.uint8).clone()
    index = raw[: 4 * count].view(torch.int32).long()
    values = raw[4 * count :].view(value_dtype(fmt)).float()
    return index, values


# -- one layer's wire form (quantized survivors, delta16, coo32 of a very large group) ---------------------------------
def threshold_level(threshold: Tensor, survivors: Tensor) -> Tensor:
    """The one level of ``quantize="threshold"`` (Strom): the threshold, "effectively the minimum surviving
    absolute value" (Aji & Heafield, Sec. 5.4). At threshold 0 (more than R of the values exactly 0, or a
    one-element tensor) it is the smallest surviving |x| instead, else every survivor would be sent as 0; NaN
    when a NaN survives (NaN in, NaN out). ``survivors``: the survivors' |x| (non-empty). Returns a 1-element
    float32 tensor."""
    level = torch.where(threshold > 0, threshold.float(), survivors.min())
    return torch.where(survivors.isnan().any(), float("nan"), level).reshape(1)


def _mean(values: Tensor) -> Tensor:
    """Mean of a possibly empty tensor (0 when empty), as a 0-d tensor."""
    if values.numel() == 0:
        return values.new_zeros(())
    return values.mean()


def _columns(shape: torch.Size) -> int:
    """Columns of ``quantize="column_mean"``: the second dimension of the layer viewed as ``[shape[0], -1]``."""
    n = shape.numel()
    return 1 if len(shape) < 2 or n == 0 else n // shape[0]


def _num_levels(quantize: Quantize, shape: torch.Size) -> int:
    return {"threshold": 1, "global_mean": 2, "2bit": 4}.get(quantize, 2 * _columns(shape))


def group_means(group: Tensor, values: Tensor, groups: int) -> Tensor:
    """The mean of ``values`` (float32) per group id in ``group`` (int64 in ``[0, groups)``), 0 for an empty group.

    Each group's values are summed one after another in their order in ``values``, on every device: a stable sort
    by group, then one segment reduce over the sorted values. ``index_add_`` would give these bits on the CPU, but
    CUDA adds it with float atomics in no fixed order, so the same survivors could send different means from one
    run (or one kernel path) to the next. The counts come from where each group starts among the sorted ids (no
    host read).
    """
    order = torch.sort(group, stable=True)
    bounds = torch.searchsorted(order.values, torch.arange(groups + 1, device=group.device))
    counts = bounds.diff()
    # unsafe: the lengths add up to the values' count by construction (the check would read them to the host)
    sums = torch.segment_reduce(values[order.indices], "sum", lengths=counts, unsafe=True, initial=0.0)
    return torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)


def quantized_levels(
    quantize: Quantize, idx: Tensor, kept: Tensor, threshold: Tensor, shape: torch.Size
) -> tuple[Tensor, Tensor]:
    """One layer's quantized survivors (paper Sec. 5.4): the code of each survivor and the float levels they select.

    Args:
        quantize: ``"threshold"`` (1 bit: the sign, one level), ``"global_mean"`` (1 bit, the mean |x| per sign),
            ``"column_mean"`` (1 bit, the mean |x| per sign and column) or ``"2bit"`` (sign and whether |x| exceeds
            the mean |survivor|: four means).
        idx: the survivors' positions in the layer (int64, ascending).
        kept: their values (float32).
        threshold: the layer's threshold (0-d float32).
        shape: the layer's shape.
    """
    positive = kept > 0
    mag = kept.abs()
    if quantize == "threshold":
        return positive.long(), threshold_level(threshold, mag)
    if quantize == "global_mean":
        return positive.long(), torch.stack((_mean(mag[~positive]), _mean(mag[positive])))
    if quantize == "column_mean":
        cols = _columns(shape)
        group = (idx % cols) * 2 + positive.long()  # [neg, pos] per column
        return positive.long(), group_means(group, mag, 2 * cols)
    # 2bit: bit 0 the sign, bit 1 "large mover" (above the mean |survivor|); a mean per (size, sign) group
    large = mag > _mean(mag)
    code = positive.long() + 2 * large.long()
    return code, group_means(code, mag, 4)


def encode_layer(
    idx: Tensor, kept: Tensor, threshold: Tensor, shape: torch.Size, quantize: Quantize, index: IndexEncoding,
    values: ValueFormat,
) -> Tensor:
    """One layer's payload (uint8) from its survivors (``idx`` ascending positions in the layer, ``kept`` float32).

    Unquantized: :func:`~lightning_gradcomp.wire.sparse.encode_sparse` (``delta16`` sends its count even when
    nothing survives). Quantized: ``[uint32 K][float32 levels][packed codes][indices]`` (K sizes the rest, the
    index section goes last), nothing at all when nothing survives.
    """
    if quantize == "none":
        return encode_sparse(idx, kept, index, values)
    if idx.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=kept.device)
    codes, levels = quantized_levels(quantize, idx, kept, threshold, shape)
    count = torch.tensor([idx.numel()], dtype=torch.int32, device=kept.device)
    bits = 2 if quantize == "2bit" else 1
    return torch.cat(
        (count.view(torch.uint8), levels.float().contiguous().view(torch.uint8), pack_codes(codes, bits),
         encode_indices(idx, index))
    )


def decode_layer(
    payload: Tensor, shape: torch.Size, quantize: Quantize, index: IndexEncoding, values: ValueFormat
) -> tuple[Tensor, Tensor]:
    """(int64 positions in the layer, float32 values) of :func:`encode_layer`'s non-empty ``payload``."""
    if quantize == "none":
        return decode_sparse(payload, index, values)
    k = int(payload[:4].clone().view(torch.int32)[0])
    n_levels = _num_levels(quantize, shape)
    levels = payload[4 : 4 + 4 * n_levels].clone().view(torch.float32)
    start = 4 + 4 * n_levels
    bits = 2 if quantize == "2bit" else 1
    code_bytes = packed_codes_nbytes(k, bits)
    codes = unpack_codes(payload[start : start + code_bytes], k, bits)
    idx = decode_indices(payload[start + code_bytes :], k, index)
    sign = torch.where(codes % 2 == 1, 1.0, -1.0)
    if quantize == "threshold":
        return idx, sign * levels[0]
    if quantize == "column_mean":
        return idx, sign * levels[(idx % _columns(shape)) * 2 + codes]
    return idx, sign * levels[codes]


__all__ = [
    "Coo32Group",
    "GradDropKernels",
    "INT32_POSITIONS",
    "Survivors",
    "Thresholds",
    "counted_statistics",
    "fits_fp16",
    "survivors",
    "Quantize",
    "SamplePlan",
    "decode_group_coo32",
    "decode_layer",
    "encode_group_coo32",
    "encode_layer",
    "gather_samples",
    "plan_samples",
    "quantized_levels",
    "segment_thresholds",
    "survivors_mask",
    "threshold_level",
]
