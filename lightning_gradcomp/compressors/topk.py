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

A group of layers (the hook's batched pipeline, :meth:`TopK.compress_flat`) is compressed and decoded in a fixed
number of ops: the group payload's layout is :mod:`~lightning_gradcomp.compressors.topk_flat`'s (the same bytes
per layer as here), DGC's selection of all layers at once :mod:`~lightning_gradcomp.compressors.dgc_flat`'s. DGC's
sample offsets come from per-name counter streams computed on the host, so both paths draw the same ones.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp.wire.bits import pack_bits, packed_bits_nbytes, unpack_bits
from lightning_gradcomp.compressors import dgc_flat, topk_flat
from lightning_gradcomp.compressors.base import Aggregation, Compressor, FlatPacket, Packet, SharedStatistic
from lightning_gradcomp.compressors.streams import CounterStreams, load_counters
from lightning_gradcomp.compressors.topk_flat import INT2_HALF_RANGE as _INT2_HALF_RANGE
from lightning_gradcomp.compressors.topk_flat import SparseLayout
from lightning_gradcomp.exchange.segments import Segments
from lightning_gradcomp.validation import check_choice, check_int, check_number

ValueDtype = Literal["fp32", "fp16", "int2"]
_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_INT2 = "int2"

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


class TopK(Compressor):
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

    def select(self, importance: Tensor, name: str = "") -> Tensor:
        """Indices (int64) of the elements to send, given their magnitudes."""
        k = min(self.num_selects(importance.numel()), importance.numel())
        return torch.topk(importance, k, sorted=False).indices

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1)
        if self.is_dense(tensor.shape):
            payload = flat.float().view(torch.uint8)
            return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats={"density": flat.new_ones(())})
        # an empty tensor selects nothing (the samplers' order statistics need a value)
        indices = self.select(flat.abs(), name) if flat.numel() else flat.new_zeros(0, dtype=torch.long)
        index_bytes = indices.to(torch.int32).view(torch.uint8)
        if self.value_dtype == _INT2:
            values = flat[indices].float()
            scale = values.abs().amax().reshape(1) / _INT2_HALF_RANGE if values.numel() else values.new_zeros(1)
            codes = topk_flat.int2_codes(values, scale)
            payload = torch.cat((scale.view(torch.uint8), index_bytes, pack_bits(codes, 2)))
        else:
            values = flat[indices].to(_VALUE_DTYPES[self.value_dtype])
            payload = torch.cat((values.view(torch.uint8), index_bytes))
        stats = {"density": flat.new_tensor(indices.numel() / max(1, flat.numel()), dtype=torch.float32)}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    def _values_indices(self, packet: Packet) -> tuple[Tensor, Tensor]:
        if self.value_dtype == _INT2:
            return _int2_values_indices(packet.payload)
        value_size = _VALUE_DTYPES[self.value_dtype].itemsize
        k = packet.payload.numel() // (value_size + 4)
        # clone: slices at odd byte offsets cannot be reinterpreted as wider dtypes in place
        values = packet.payload[: k * value_size].clone().view(_VALUE_DTYPES[self.value_dtype])
        indices = packet.payload[k * value_size :].clone().view(torch.int32).long()
        return values, indices

    def decompress(self, packet: Packet) -> Tensor:
        if self.is_dense(packet.shape):
            return packet.payload.clone().view(torch.float32).to(packet.dtype).view(packet.shape)
        values, indices = self._values_indices(packet)
        out = torch.zeros(packet.numel, dtype=packet.dtype, device=packet.payload.device)
        out[indices] = values.to(packet.dtype)
        return out.view(packet.shape)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        if self.is_dense(packets[0].shape):
            return super().decompress_sum(packets)
        first = packets[0]
        out = torch.zeros(first.numel, dtype=first.dtype, device=first.payload.device)
        for packet in packets:  # rank order, identical on every rank
            values, indices = self._values_indices(packet)
            out.index_add_(0, indices, values.to(first.dtype))
        return out.view(first.shape)

    # -- a group of layers at once (the hook's batched pipeline; wire layout in topk_flat) ------------------------
    batched = True
    # the group's two stable sorts cost 10-20x the per-layer partial selections on a CPU
    # (`python benchmarks/flat_sparse.py`); on a GPU they are a few kernels instead of dozens per layer
    batch_on_cpu = False

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

    def _triton_wire(self, tensor: Tensor) -> bool:
        return self.uses_triton(tensor) and self.value_dtype != _INT2

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """Every sparse layer's ``k`` largest |x| (a per-segment sort, then each segment's first k positions: a
        fixed size, no data-dependent op), sent in position order; ties at the k-th largest are broken by lowest
        position. With Triton (:meth:`uses_triton`) a radix select and a compaction in place of the sorts."""
        if not self.batch_on(flat, segments):
            return Compressor.compress_flat(self, flat, segments, shared)
        layout = self._layout(segments, flat.device)
        x = flat.detach()
        if self.uses_triton(x):
            payload = topk_flat.encode_top_k(x, layout)
        else:
            _, order = segments.sort(x.abs(), descending=True)
            indices = order.index_select(0, segments.firsts(layout.counts, flat.device)).sort().values
            payload = topk_flat.encode(x, layout, indices)
        stats = {"density": layout.constant("density", lambda: topk_flat.density(layout, layout.counts))}
        return FlatPacket(payload, segments, flat.dtype, layout.fixed_nbytes(), ctx={"layout": layout}, stats=stats)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        if packet.layers is not None:
            return super().decompress_flat(packet)
        return topk_flat.decode_sent(packet.payload, packet.ctx["layout"], packet.dtype, self._triton_wire(packet.payload))

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return self.decompress_flat(packet) if packet.layers is None else super().sent_flat(flat, packet)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        if packets[0].layers is not None:
            return super().decompress_flat_mean_into(packets, out)
        first = packets[0]
        return topk_flat.decode_mean_into([p.payload for p in packets], first.ctx["layout"], first.dtype, out,
                                          self._triton_wire(first.payload))

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._layouts = {}

    def describe(self) -> dict[str, Any]:
        return {"compressor": type(self).__name__, "ratio": self._ratio, "value_dtype": self.value_dtype,
                "dense_1d": self.dense_1d}


def _int2_values_indices(payload: Tensor) -> tuple[Tensor, Tensor]:
    """Values and indices of an int2 payload ``scale (4 B) | k int32 indices | k 2-bit codes``."""
    total = payload.numel() - 4
    k = max(0, total * 4 // 17 - 1)  # 4k + ceil(k / 4) == total: start just below and step up
    while 4 * k + packed_bits_nbytes(k, 2) < total:
        k += 1
    scale = payload[:4].clone().view(torch.float32)
    indices = payload[4 : 4 + 4 * k].clone().view(torch.int32).long()
    codes = unpack_bits(payload[4 + 4 * k :], k, 2).float()
    return topk_flat.int2_values(codes, scale), indices


class DGC(TopK):
    """Top-k with DGC's sampled, adapted threshold (the official code's selection).

    Args:
        ratio: kept fraction (DGC: 0.001).
        sample_ratio: fraction of magnitudes sampled to estimate the threshold (DGC: 0.01).
        upper_bound: when more than ``upper_bound * k`` elements pass, take an exact top-k of those (1.3).
        lower_bound: when fewer than ``lower_bound * k`` pass, multiply the threshold by it and retry (0.8).
        max_adaptation_iters: threshold adaptations at most (10).
        value_dtype: ``"fp32"`` or ``"fp16"`` values on the wire.
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
        self._plans: dict[tuple[Any, ...], dgc_flat.DGCPlan] = {}

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._streams.reset(rank)
        self._plans = {}

    @property
    def batched(self) -> bool:  # type: ignore[override]
        """int2 values need two data-dependent sizes per group (indices and padded codes): they loop over layers."""
        return self.value_dtype != _INT2

    def _start(self, name: str, stride: int) -> int:
        """The sample's random offset in ``[0, stride)`` for ``name``'s next draw: a pure function of (seed, rank,
        name, draw number) computed on the host (no op, no read), the same in the per-layer and group paths."""
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

    def select(self, importance: Tensor, name: str = "") -> Tensor:
        numel = importance.numel()
        num_selects = min(self.num_selects(numel), numel)
        stride, num_samples, top_k_samples = self.sampling(numel)
        if stride == 1:
            samples = importance
        else:
            samples = importance[self._start(name, stride) :: stride]
        top_k_samples = min(top_k_samples, samples.numel())
        threshold = torch.topk(samples, top_k_samples, sorted=False).values.min()
        indices = torch.nonzero(importance >= threshold).view(-1)
        if stride > 1:
            for _ in range(self.max_adaptation_iters):
                count = indices.numel()
                if count > num_selects:
                    if count > self.upper_bound * num_selects:
                        top = torch.topk(importance[indices], num_selects, sorted=False).indices
                        indices = indices[top]
                    break
                if count >= self.lower_bound * num_selects:
                    break
                threshold = threshold * self.lower_bound
                indices = torch.nonzero(importance >= threshold).view(-1)
        return indices[:num_selects]

    def _plan(self, segments: Segments, device: torch.device) -> dgc_flat.DGCPlan:
        key = (segments, self._ratio, self.value_dtype, self.dense_1d, self.sample_ratio, self.upper_bound,
               self.lower_bound, self.max_adaptation_iters, device)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            layout = self._layout(segments, device)
            sampled = [self.sampling(n) if k else (0, 0, 0) for n, k in zip(segments.numels, layout.counts)]
            plan = self._plans[key] = dgc_flat.DGCPlan(
                layout, tuple(s[0] for s in sampled), tuple(s[2] for s in sampled), self.lower_bound,
                self.upper_bound, self.max_adaptation_iters)
        return plan

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """DGC's selection of every layer (:mod:`~lightning_gradcomp.compressors.dgc_flat`): one ``nonzero`` per
        group (with Triton, :meth:`uses_triton`: kernels, and one read of the selected count); the per-layer sizes
        stay on the device (``layer_nbytes`` an int64 tensor)."""
        if not self.batch_on(flat, segments):
            return Compressor.compress_flat(self, flat, segments, shared)
        plan = self._plan(segments, flat.device)
        starts = [0] * len(segments)
        for i in plan.drawn:
            starts[i] = self._start(segments.names[i], plan.strides[i])
        x = flat.detach()
        layout = plan.layout
        if self.uses_triton(x):
            x = x.float().contiguous()
            mask, sent = dgc_flat.select_mask(plan, x, starts)
            payload = topk_flat.encode_mask(x, layout, mask)
        else:
            indices, sent = dgc_flat.select(plan, x.abs(), starts)
            payload = topk_flat.encode(x, layout, indices)
        return FlatPacket(payload, segments, flat.dtype,
                          topk_flat.sent_nbytes(layout, sent), ctx={"layout": layout},
                          stats={"density": topk_flat.density(layout, sent)})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sample_ratio": self.sample_ratio, "upper_bound": self.upper_bound,
                "lower_bound": self.lower_bound, "max_adaptation_iters": self.max_adaptation_iters, "seed": self.seed}
