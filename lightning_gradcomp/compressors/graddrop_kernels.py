"""Gradient Dropping's kernel providers: the operations of its group step (:class:`~.graddrop_group.GradDropKernels`)
on torch ops, on the compiled CPU kernels (:mod:`lightning_gradcomp.kernels`' group calls, their torch-ops forms
elsewhere: sample, k-th smallest, selection, decode-and-sum) and on Triton's
(:mod:`lightning_gradcomp.kernels.triton_graddrop`: sample, selection with the ``coo32`` encode and its statistics,
decode, decode-and-average). All three give the same bits. The compiled and Triton kernels count positions in
int32: a group of 2**31 elements or more runs the torch ops, which each provider inherits.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.backends import Kernels
from lightning_gradcomp.compressors.graddrop_group import (
    INT32_POSITIONS,
    Coo32Group,
    SamplePlan,
    Survivors,
    Thresholds,
    counted_statistics,
    decode_group_coo32,
    encode_group_coo32,
    gather_samples,
    segment_thresholds,
    survivors,
)
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.kernels import triton_graddrop
from lightning_gradcomp.wire.sparse import ValueFormat, value_dtype, value_nbytes


class TorchGradientDropping:
    """Gradient Dropping's group step in torch ops (the reference the other providers equal bit for bit).

    Args:
        streams: the compressor's counter-based streams, which the random samples draw from.
    """

    name: Kernels = "torch"

    def __init__(self, streams: CounterStreams) -> None:
        self.streams = streams

    def select(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool
    ) -> tuple[Tensor, Survivors]:
        """Every layer's threshold (``thresholds`` of the samples) and the group's survivors of float32 ``x``."""
        magnitudes = x.abs()
        # every drawing layer's positions from its own counter, as the kernels draw them
        bits = self.streams.bits_flat(plan.draws, x.device) if plan.draws.total else None
        samples = gather_samples(magnitudes, plan, bits)
        chosen = thresholds(samples, lambda: segment_thresholds(samples, plan))
        return chosen, survivors(x, magnitudes, chosen, segments, fp16)

    def select_coo32(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool, fmt: ValueFormat
    ) -> tuple[Tensor, Coo32Group]:
        """:meth:`select`, its survivors in the group's ``coo32`` payload with their statistics."""
        chosen, (index, values, counts, overflow) = self.select(x, segments, plan, thresholds, fp16)
        payload = encode_group_coo32(index, values, fmt)
        nbytes = counts * (4 + value_nbytes(fmt))
        return chosen, Coo32Group(payload, nbytes, *counted_statistics(plan, counts, nbytes), overflow)

    def decode_coo32(self, payload: Tensor, fmt: ValueFormat, total: int) -> Tensor:
        """float32 ``[total]``: a group's ``coo32`` payload, dense."""
        index, values = decode_group_coo32(payload, fmt)
        out = torch.zeros(total, dtype=torch.float32, device=payload.device)
        return out.index_put_((index,), values)

    def sum_into(self, decoded: Sequence[tuple[Tensor, Tensor]], out: Tensor) -> Tensor:
        """Every rank's (positions, values) added into ``out`` (float32) in rank order, onto zeros."""
        # each rank's survivors are distinct positions: added rank after rank, the sums of the dense loop
        out.zero_()
        for index, values in decoded:
            out.index_add_(0, index, values)
        return out

    def mean_coo32_into(self, payloads: Sequence[Tensor], fmt: ValueFormat, out: Tensor) -> Tensor:
        """The ranks' mean of ``coo32`` payloads into ``out`` (float32): their sum, then divided."""
        return self.sum_into([decode_group_coo32(p, fmt) for p in payloads], out).div_(len(payloads))


class CompiledGradientDropping(TorchGradientDropping):
    """Gradient Dropping's group step in the compiled kernels' group calls, each one call per group with the layers'
    tables of a :class:`~.graddrop_group.SamplePlan`; random samples keyed per layer."""

    name: Kernels = "fused"

    def select(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool
    ) -> tuple[Tensor, Survivors]:
        if segments.total >= INT32_POSITIONS:
            return super().select(x, segments, plan, thresholds, fp16)
        offsets, sizes, modes, ranks, sample_offsets = plan.kernel_args
        samples = kernels.graddrop_group_sample(x, offsets, sizes, modes, torch.tensor(self.streams.keys(plan.draws)))
        chosen = thresholds(samples, lambda: kernels.graddrop_group_kth(samples, sample_offsets, ranks))
        return chosen, Survivors(*kernels.graddrop_group_select(x, offsets, chosen, fp16))

    def sum_into(self, decoded: Sequence[tuple[Tensor, Tensor]], out: Tensor) -> Tensor:
        if not out.is_contiguous():
            return super().sum_into(decoded, out)
        # one kernel call for all ranks
        return kernels.sparse_decode_sum(out.numel(), [i for i, _ in decoded], [v for _, v in decoded], out=out)


class TritonGradientDropping(TorchGradientDropping):
    """Gradient Dropping's group step in Triton kernels (the samples' sort excepted)."""

    name: Kernels = "triton"

    def __init__(self, streams: CounterStreams) -> None:
        super().__init__(streams)
        # the kernels' tables per sample plan (kept with the plan they were built for)
        self._tables: dict[int, tuple[SamplePlan, triton_graddrop.GroupTables]] = {}

    def tables(self, segments: Segments, plan: SamplePlan, device: torch.device) -> triton_graddrop.GroupTables:
        """The kernels' tables of this group and sample plan on ``device`` (built once per plan)."""
        kept = self._tables.get(id(plan))
        if kept is None or kept[0] is not plan:
            kept = self._tables[id(plan)] = (plan, triton_tables(segments, plan, device))
        return kept[1]

    def _thresholds(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds
    ) -> tuple[Tensor, triton_graddrop.GroupTables]:
        tables = self.tables(segments, plan, x.device)
        keys = triton_graddrop.keys_on(self.streams.keys(plan.draws), x.device) if plan.draws.total else None
        samples = x.abs() if plan.whole else triton_graddrop.sample(x, tables, keys)
        return thresholds(samples, lambda: segment_thresholds(samples, plan)), tables

    def select(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool
    ) -> tuple[Tensor, Survivors]:
        if segments.total >= INT32_POSITIONS:
            return super().select(x, segments, plan, thresholds, fp16)
        x = x.contiguous()
        chosen, _ = self._thresholds(x, segments, plan, thresholds)
        return chosen, survivors(x, x.abs(), chosen, segments, fp16)

    def select_coo32(
        self, x: Tensor, segments: Segments, plan: SamplePlan, thresholds: Thresholds, fp16: bool, fmt: ValueFormat
    ) -> tuple[Tensor, Coo32Group]:
        x = x.contiguous()
        chosen, tables = self._thresholds(x, segments, plan, thresholds)
        payload, counts, overflow_count = triton_graddrop.select_encode(x, tables, chosen, value_dtype(fmt), fp16)
        nbytes, (sparsity, sent, rate, overflow) = triton_graddrop.statistics(
            counts, overflow_count, plan.numels, value_nbytes(fmt)
        )
        return chosen, Coo32Group(payload, nbytes, sparsity, sent, rate, overflow)

    def decode_coo32(self, payload: Tensor, fmt: ValueFormat, total: int) -> Tensor:
        return triton_graddrop.decode(payload, value_dtype(fmt), total)

    def mean_coo32_into(self, payloads: Sequence[Tensor], fmt: ValueFormat, out: Tensor) -> Tensor:
        if not out.is_contiguous():
            return super().mean_coo32_into(payloads, fmt, out)
        # each rank's survivors added in rank order, then div_
        return triton_graddrop.decode_mean_into(payloads, value_dtype(fmt), out)


def triton_tables(segments: Segments, plan: SamplePlan, device: torch.device) -> triton_graddrop.GroupTables:
    """The Triton kernels' tables of a group and its sample plan on ``device``."""
    _, sizes, modes, _, _ = plan.kernel_args
    return triton_graddrop.GroupTables(segments.numels, sizes.tolist(), modes.tolist(), device)


#: Gradient Dropping's provider of each kernel set
GRADDROP_KERNELS: dict[Kernels, type[TorchGradientDropping]] = {
    "torch": TorchGradientDropping,
    "fused": CompiledGradientDropping,
    "triton": TritonGradientDropping,
}

__all__ = ["GRADDROP_KERNELS", "CompiledGradientDropping", "TorchGradientDropping", "TritonGradientDropping",
           "triton_tables"]
