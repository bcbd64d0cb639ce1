"""Top-k sparsification with error feedback, and DGC's sampled threshold (Lin et al., ICLR 2018).

``TopK`` sends the ``ceil(ratio * n)`` largest-magnitude elements of each tensor exactly. ``DGC`` selects them
as the official DGC code does (``dgc/compression.py``): estimate the threshold from a strided random sample
of about 1% of the magnitudes, adapt it up to 10 times (exact top-k among the selected when more than 1.3x
the target count survive, threshold * 0.8 when fewer than 0.8x), then keep at most ``ceil(ratio * n)``.
What is not sent stays in the per-rank residual (error feedback; with
:class:`~lightning_gradcomp.callbacks.MomentumCorrection` that residual is DGC's accumulator v).

``ratio`` is the kept fraction (1 - sparsity) and may be changed between steps by a
:class:`~lightning_gradcomp.callbacks.CompressionSchedule` (DGC's sparsity warm-up,
:data:`DGC_PAPER_WARMUP`).

On the wire (exact), gathered: per sent element its value (float32, or float16 with ``value_dtype="fp16"``)
and its int32 index (DGC's code sends fp32 + int64 by default, fp16 + int32 as an option). With
``value_dtype="int2"`` (SparseLoCo's 2-bit values, arXiv 2508.15706) each value is one of
``{-1.5, -0.5, 0.5, 1.5} * s`` with ``s = max|value| / 1.5`` per tensor, rounded to the nearest: 2 bits per
value plus one float32 scale per tensor; the rounding error stays in the residual like the unsent elements. Tensors with
``dim() <= 1`` (biases, norms) are sent dense as float32 values when ``dense_1d`` (DGC's code compresses only
``dim() > 1``).

The code is written once, for a group of layers in one flat tensor (the hook's pipeline, :meth:`TopK.compress_flat`);
the per-tensor calls (``per_tensor(compressor).compress(tensor, name)``, ``decompress(packet)``, ``sent``) run it on a group of one. The
group payload's layout is :mod:`~lightning_gradcomp.compressors.topk_group`'s; the selection, what differs by device
(:attr:`TopK.selection`), is stated for one layer once (:func:`~lightning_gradcomp.compressors.topk_group.top_k_segment`,
:func:`~lightning_gradcomp.compressors.dgc_group.select_segment`) and looped over the layers on a CPU, batched for all
layers at once elsewhere (:mod:`~lightning_gradcomp.compressors.dgc_group`, or Triton's kernels on CUDA): the same
elements either way. DGC's sample offsets come from per-name counter streams computed on the host, so every
selection draws the same ones.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors import dgc_group, topk_group
from lightning_gradcomp.compressors.backends import KernelBacked
from lightning_gradcomp.compressors.base import Aggregation, SharedStatistic, SelectsElements
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.streams import CounterStreams, load_counters
from lightning_gradcomp.compressors.topk_group import SparseLayout
from lightning_gradcomp.compressors.topk_kernels import TOPK_KERNELS, TopKKernels
from lightning_gradcomp.validation import check_choice, check_int, check_number

ValueDtype = Literal["fp32", "fp16", "int2"]
_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_INT2 = "int2"
Selection = Literal["loop", "batched"]

DGC_PAPER_WARMUP: tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.00390625, 0.001)
"""The DGC paper's sparsity warm-up as kept fractions: 75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity.

One value per warm-up epoch, the last one kept afterwards; 99.6% is taken as 1 - 4**-4 = 99.609%.
"""


def dgc_code_warmup(ratio: float, warmup_epochs: int) -> list[float]:
    """The schedule the official DGC code computes (``base**((e+1)/(E+1))``), not the paper's.

    For ``ratio=0.001, warmup_epochs=5``: 0.316, 0.1, 0.0316, 0.01, 0.00316, then 0.001.
    """
    check_number("ratio", ratio, minimum=0.0, maximum=1.0, min_open=True)
    check_int("warmup_epochs", warmup_epochs, minimum=0)
    coeff = ratio ** (1.0 / (warmup_epochs + 1))
    return [max(coeff ** (e + 1), ratio) for e in range(warmup_epochs)] + [ratio]


class TopK(KernelBacked[TopKKernels], SelectsElements):
    """Send the ``ceil(ratio * n)`` largest-magnitude elements of each tensor, keep the rest as residual.

    Args:
        ratio: kept fraction of each tensor, in (0, 1] (DGC: 0.001).
        value_dtype: ``"fp32"`` or ``"fp16"`` values on the wire, or ``"int2"`` (SparseLoCo's 2-bit values with
            a per-tensor scale).
        dense_1d: send tensors with ``dim() <= 1`` dense (DGC's code); otherwise sparsify them too.
    """

    aggregation = Aggregation.GATHER
    uses_memory = True

    def __init__(self, ratio: float = 0.001, value_dtype: ValueDtype = "fp32", dense_1d: bool = True) -> None:
        super().__init__()
        check_number("ratio", ratio, minimum=0.0, maximum=1.0, min_open=True, fix="use 0.001 (DGC) or 0.01")
        check_choice("value_dtype", value_dtype, (*_VALUE_DTYPES, _INT2))
        self._ratio = float(ratio)
        self.value_dtype: ValueDtype = value_dtype
        self.dense_1d = bool(dense_1d)
        # per group layout and settings (a group's Segments is made once and reused every step)
        self._layouts: dict[tuple[Any, ...], SparseLayout] = {}

    @property
    def ratio(self) -> float:
        """Kept fraction of each tensor; settable between steps (identically on every rank)."""
        return self._ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        check_number("ratio", value, minimum=0.0, maximum=1.0, min_open=True, fix="use a kept fraction such as 0.001")
        self._ratio = float(value)

    def num_selects(self, numel: int) -> int:
        """How many elements of a tensor of ``numel`` elements are sent (at most)."""
        return max(1, math.ceil(numel * self._ratio))

    def is_dense(self, shape: torch.Size) -> bool:
        return self.dense_1d and len(shape) <= 1

    # -- the group code: a group of layers at once (the hook's pipeline; a single tensor is a group of one) ---------
    batched = True

    #: the kernel sets that run the groups (:mod:`~lightning_gradcomp.compressors.topk_kernels`): torch ops or Triton's
    providers = TOPK_KERNELS

    #: how a group's elements are selected where the Triton kernels do not run: ``"loop"``, one partial selection
    #: (``torch.topk``) per layer, or ``"batched"``, a fixed number of ops per group (sorts of the whole group);
    #: ``None`` (default) chooses by device: the loop on a CPU, where an op costs well under a microsecond and a
    #: group's sort 10-20x the partial selections (``python benchmarks/flat_sparse.py``), the batched ops elsewhere,
    #: where every op is a kernel launch. Both select the same elements.
    selection: Optional[Selection] = None

    def _layout(self, segments: Segments, device: torch.device) -> SparseLayout:
        key = (segments, self._ratio, self.value_dtype, self.dense_1d, device)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 64:  # stale ratios of a schedule, old bucket layouts
                self._layouts.clear()
            dense = tuple(self.is_dense(s) for s in segments.shapes)
            counts = tuple(0 if d or n == 0 else min(self.num_selects(n), n) for n, d in zip(segments.numels, dense))
            layout = self._layouts[key] = SparseLayout(segments, self.value_dtype, dense, counts, device)
        return layout

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """Every sparse layer's ``k`` largest ``|x|`` (NaN above +inf; of the values equal to the k-th largest, the
        lowest positions), sent in position order, in the group payload of
        :mod:`~lightning_gradcomp.compressors.topk_group`. The selection by device (:attr:`selection`): one partial
        selection per layer, a segmented sort, or with Triton a radix select and a compaction."""
        layout = self._layout(segments, flat.device)
        payload = self.kernels(flat.device).encode_top_k(flat.detach(), layout)
        stats = {"density": layout.constant("density", lambda: topk_group.density(layout, layout.counts))}
        return FlatPacket(payload, segments, flat.dtype, layout.fixed_nbytes(), ctx={"layout": layout}, stats=stats)

    def _decoding(self, packet: FlatPacket) -> tuple[SparseLayout, Optional[Segments]]:
        """The layout a packet was encoded with (its own context; a packet made by hand: this compressor's), and its
        int2 selection when it is not the layout's (DGC's counts, from the packet's sizes)."""
        layout = packet.ctx.get("layout")
        if layout is None:
            layout = self._layout(packet.segments, packet.payload.device)
        return layout, None

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        layout, selection = self._decoding(packet)
        return self.kernels(packet.payload.device).decode_sent(packet.payload, layout, packet.dtype, selection)

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return self.decompress_flat(packet)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        layout = self._decoding(packets[0])[0]
        selections = [self._decoding(p)[1] for p in packets]
        return self.kernels(out.device).decode_mean_into([p.payload for p in packets], layout, packets[0].dtype, out,
                                                         selections)

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._layouts = {}

    def describe(self) -> dict[str, Any]:
        return {"compressor": type(self).__name__, "ratio": self._ratio, "value_dtype": self.value_dtype,
                "dense_1d": self.dense_1d}


class DGC(TopK):
    """Top-k with DGC's sampled, adapted threshold (the official code's selection).

    Args:
        ratio: kept fraction (DGC: 0.001).
        sample_ratio: fraction of magnitudes sampled to estimate the threshold (DGC: 0.01).
        upper_bound: when more than ``upper_bound * k`` elements pass, take an exact top-k of those (1.3).
        lower_bound: when fewer than ``lower_bound * k`` pass, multiply the threshold by it and retry (0.8).
        max_adaptation_iters: threshold adaptations at most (10).
        value_dtype: ``"fp32"`` or ``"fp16"`` values on the wire, or ``"int2"`` (as :class:`TopK`'s).
        dense_1d: send tensors with ``dim() <= 1`` dense (DGC's code).
        seed: seed of the sampling offsets; rank r draws from seed and r.
    """

    fixed_size = False  # the number of selected elements differs across ranks

    def __init__(
        self,
        ratio: float = 0.001,
        sample_ratio: float = 0.01,
        upper_bound: float = 1.3,
        lower_bound: float = 0.8,
        max_adaptation_iters: int = 10,
        value_dtype: ValueDtype = "fp32",
        dense_1d: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(ratio, value_dtype, dense_1d)
        check_number("sample_ratio", sample_ratio, minimum=0.0, maximum=1.0, min_open=True, fix="use 0.01 (DGC)")
        check_number("upper_bound", upper_bound, minimum=1.0, fix="use 1.3 (DGC)")
        check_number("lower_bound", lower_bound, minimum=0.0, maximum=1.0, min_open=True, fix="use 0.8 (DGC)")
        check_int("max_adaptation_iters", max_adaptation_iters, minimum=0, fix="use 10 (DGC)")
        check_int("seed", seed, minimum=0)
        self.sample_ratio = float(sample_ratio)
        self.upper_bound = float(upper_bound)
        self.lower_bound = float(lower_bound)
        self.max_adaptation_iters = max_adaptation_iters
        self.seed = seed
        self._streams = CounterStreams(seed)
        self._plans: dict[tuple[Any, ...], dgc_group.DGCPlan] = {}

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._streams.reset(rank)
        self._plans = {}

    def _start(self, name: str, stride: int) -> int:
        """The sample's random offset in ``[0, stride)`` for ``name``'s next draw: a pure function of (seed, rank,
        name, draw number) computed on the host (no op, no read), whichever selection runs."""
        return self._streams.key(name)[0] % stride

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a checkpoint from when DGC drew its sample offsets from a torch.Generator per name is refused, as int8's,
        # QSGD's and Gradient Dropping's are: starting the streams afresh would resume a different run silently
        load_counters(self._streams, state.get("streams", {}), type(self).__name__)

    def sampling(self, numel: int) -> tuple[int, int, int]:
        """(sample stride, number of samples, top-k of the samples), as DGC's code computes them."""
        if self.sample_ratio >= 1.0 or numel <= math.ceil(2 / self._ratio):
            stride, samples = 1, numel
        else:
            wanted = max(math.ceil(numel * self.sample_ratio), math.ceil(2 / self._ratio))
            stride = math.ceil(numel / wanted / 32) * 32 + 1
            samples = numel // stride
            while samples < wanted and stride > 1:
                stride = max(1, stride - 8)
                samples = numel // stride
        return stride, samples, max(1, math.ceil(samples * self._ratio))

    def _plan(self, segments: Segments, device: torch.device) -> dgc_group.DGCPlan:
        key = (segments, self._ratio, self.value_dtype, self.dense_1d, self.sample_ratio, self.upper_bound,
               self.lower_bound, self.max_adaptation_iters, device)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            layout = self._layout(segments, device)
            sampled = [self.sampling(n) if k else (0, 0, 0) for n, k in zip(segments.numels, layout.counts)]
            plan = self._plans[key] = dgc_group.DGCPlan(
                layout, tuple(s[0] for s in sampled), tuple(s[2] for s in sampled), self.lower_bound,
                self.upper_bound, self.max_adaptation_iters)
        return plan

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """DGC's selection of every layer (:func:`~lightning_gradcomp.compressors.dgc_group.select_segment` states it
        for one layer), sent in position order in :mod:`~lightning_gradcomp.compressors.topk_group`'s group payload.
        The selection by device (:attr:`~TopK.selection`): one :func:`~lightning_gradcomp.compressors.dgc_group
        .select_segment` per layer (host counts), :func:`~lightning_gradcomp.compressors.dgc_group.select`'s fixed
        number of ops with one ``nonzero`` per group, or with Triton kernels and one read of the
        selected count; the batched forms keep the per-layer sizes on the device (``layer_nbytes`` an int64 tensor).
        int2 values are coded with the counts on the host (a read of them after a batched selection)."""
        plan = self._plan(segments, flat.device)
        starts = [0] * len(segments)
        for i in plan.drawn:
            starts[i] = self._start(segments.names[i], plan.strides[i])
        layout, ops = plan.layout, self.kernels(flat.device)
        if self.value_dtype != _INT2:
            payload, sent = ops.dgc_encode(plan, flat.detach(), starts)
            return self._packet(payload, segments, flat.dtype, layout, sent)
        x, indices, sent = ops.dgc_indices(plan, flat.detach(), starts)
        counts = sent if isinstance(sent, tuple) else tuple(sent.tolist())
        payload = topk_group.encode(x, layout, indices, layout.selection_of(counts))
        return self._packet(payload, segments, flat.dtype, layout, counts)

    @staticmethod
    def _packet(payload: Tensor, segments: Segments, dtype: torch.dtype, layout: SparseLayout,
                sent: "tuple[int, ...] | Tensor") -> FlatPacket:
        """The group packet of ``payload`` sending ``sent`` elements per layer (host counts or a device tensor)."""
        return FlatPacket(payload, segments, dtype, topk_group.sent_nbytes(layout, sent), ctx={"layout": layout},
                          stats={"density": topk_group.density(layout, sent)})

    def _decoding(self, packet: FlatPacket) -> tuple[SparseLayout, Optional[Segments]]:
        layout, _ = super()._decoding(packet)
        if self.value_dtype != _INT2:
            return layout, None
        # int2 codes are padded per layer: the layers' counts, from this packet's (this rank's) sizes
        return layout, layout.selection_of(topk_group.int2_counts(layout, packet.layer_nbytes))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sample_ratio": self.sample_ratio, "upper_bound": self.upper_bound,
                "lower_bound": self.lower_bound, "max_adaptation_iters": self.max_adaptation_iters, "seed": self.seed}
