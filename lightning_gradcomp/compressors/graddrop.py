"""Gradient Dropping (Aji & Heafield, EMNLP 2017): send only the largest R% complement, keep the rest as a residual.

Per tensor x (the gradient plus this rank's residual, added by the hook's error feedback):

1. a threshold such that a fraction ``drop_ratio`` of |x| is at or below it, selected on a sample: a 0.1%
   random sample (the paper), at most 100k elements at a fixed stride from index 0 (the original Marian
   code), or all elements (``"exact"``). With k = floor(R * m) for a sample of m values, the threshold is the
   k-th smallest sampled |x| (Marian's ``max(0, m*R - 1)``-th element, 2017-06 code); k = 0 means only exact
   zeros are dropped.
2. drop |x| <= threshold (Marian's rule); the survivors travel as a sparse vector, the dropped values stay in
   the residual (the hook's :class:`~lightning_gradcomp.exchange.memory.ResidualMemory`).
3. optionally (paper Sec. 5.4) quantize the survivors: to +-threshold (Strom), to the per-column or global
   mean of each sign (Dryden), or with 2 bits that separate large movers from small ones.

Scope ``"layer"`` selects a threshold per tensor. ``"global"`` approximates Marian's single threshold over
the whole concatenated gradient: the hook compresses bucket by bucket while backward still runs, so the whole
model's gradient never exists before the first bucket must go out. Each tensor therefore contributes its
sample to a whole-model pool, and every tensor of step t uses the threshold selected on the pool of step
t - 1 (weighted so each sample stands for its share of the model); the first step, with no pool yet, uses
per-layer thresholds. ``benchmarks/graddrop_global_threshold.py`` measures how far this is from a truly
global threshold (see ``docs/compressors.md``).

The random sample's positions come from counter-based streams (:class:`~lightning_gradcomp.compressors.streams.
CounterStreams`, keyed by seed, rank, parameter name and a per-name counter): draw i of a tensor of n elements is
``hash(i) mod n`` (:func:`~lightning_gradcomp.kernels.rng.positions`); every backend draws exactly these positions.
Earlier versions drew the torch backend's positions from a ``torch.Generator`` per name (other positions, the same
distribution); the state is the per-name counters, and a checkpoint holding such generator states is refused at
:meth:`~GradientDropping.load_state_dict` (resume it with ``resume_compression='reset'``).

The code is written once, for a group of layers in one flat tensor (:mod:`~lightning_gradcomp.compressors.graddrop_group`);
the per-tensor calls (``per_tensor(compressor).compress(tensor, name)``, ``decompress(packet)``, ...) run it on a group of one.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.backends import BACKENDS, Backend, KernelBacked
from lightning_gradcomp.compressors.base import Aggregation, SharedStatistic, SelectsElements
from lightning_gradcomp.compressors.per_tensor import layer_segments
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.graddrop_group import (
    INT32_POSITIONS,
    GradDropKernels,
    counted_statistics,
    Quantize,
    SamplePlan,
    decode_layer,
    encode_layer,
    gather_samples,
    plan_samples,
    segment_thresholds,
)
from lightning_gradcomp.compressors.streams import CounterStreams, check_counters
from lightning_gradcomp.compressors.graddrop_kernels import GRADDROP_KERNELS
from lightning_gradcomp.wire.sparse import (
    INDEX_ENCODINGS,
    VALUE_FORMATS,
    IndexEncoding,
    ValueFormat,
)
from lightning_gradcomp.validation import check_choice, check_int, check_number

Sample = Literal["random", "strided", "exact"]
Scope = Literal["layer", "global"]
QUANTIZERS: tuple[str, ...] = ("none", "threshold", "column_mean", "global_mean", "2bit")

# guards floor(R * m) against R's binary rounding (0.29 * 100 = 28.999999999999996)
_FLOOR_EPS = 1e-9


def drop_count(ratio: float, m: int) -> int:
    """How many of ``m`` sampled values the threshold must cover: floor(ratio * m)."""
    return int(math.floor(ratio * m + _FLOOR_EPS))


def select_threshold(sample: Tensor, ratio: float) -> Tensor:
    """The k-th smallest value of ``sample`` with k = floor(ratio * m); 0 when k = 0 (a 0-d float32 tensor)."""
    k = drop_count(ratio, sample.numel())
    if k == 0:
        return sample.new_zeros(())
    return torch.kthvalue(sample.float(), k).values


def select_weighted_threshold(
    samples: list[Tensor], weights: list[float], ratio: float, element_weights: Optional[Tensor] = None
) -> Tensor:
    """The threshold over a pool of samples where each sampled value stands for ``weight`` elements.

    Returns the smallest pooled value v such that the represented elements with |x| <= v number at least
    floor(ratio * total), i.e. :func:`select_threshold` when every weight is 1. ``element_weights``: each pooled
    value's weight (float32, in pool order) when the caller keeps it, so the pool costs no op per sample.
    """
    values = torch.cat([s if s.dim() == 1 else s.reshape(-1) for s in samples]).float() if samples else torch.zeros(0)
    w = element_weights
    if w is None:
        w = torch.cat([torch.full((s.numel(),), float(wt), device=values.device) for s, wt in zip(samples, weights)])
    total = sum(s.numel() * wt for s, wt in zip(samples, weights))
    k = drop_count(ratio, int(round(total)))
    if k == 0 or values.numel() == 0:
        return values.new_zeros(())
    order = torch.argsort(values)
    cum = torch.cumsum(w[order].double(), 0)
    # the first sorted position whose cumulative weight reaches k (clamped: float sums may fall a hair short)
    pos = torch.searchsorted(cum, torch.tensor([k - 1e-6], dtype=torch.float64, device=cum.device))
    pos = pos.clamp_(max=values.numel() - 1)
    return values[order][pos].reshape(())


class GradientDropping(KernelBacked[GradDropKernels], SelectsElements):
    """Gradient Dropping: the R% smallest |x| stay in the residual, the rest travel as a sparse vector.

    Args:
        drop_ratio: R, the fraction of values dropped, in [0, 1) (paper: 0.99). At 0 every non-zero value is
            sent, so training matches plain DDP.
        sample: how the threshold is selected: ``"random"`` (``sample_fraction`` of the tensor drawn with
            replacement, the paper), ``"strided"`` (at most ``max_sample`` values at a fixed stride from index 0,
            the original Marian code) or ``"exact"`` (all values).
        scope: ``"layer"`` (a threshold per tensor) or ``"global"`` (one threshold for the whole model, taken
            from the previous step's whole-model sample; see the module docstring).
        sample_fraction: fraction sampled by ``sample="random"`` (paper: 0.001).
        min_sample: the random sample has at least this many values; a tensor no larger is selected exactly
            (0.1% of a small tensor would be a handful of values).
        max_sample: the stride sample's size cap (Marian: 100000).
        quantize: ``"none"``; ``"threshold"`` (1 bit, survivors become +-threshold); ``"column_mean"`` (1 bit,
            each column's survivors of each sign become their mean; columns are the second dimension of the
            tensor viewed as ``[shape[0], -1]``, a 1-D tensor is one column); ``"global_mean"`` (1 bit, one mean
            per sign); ``"2bit"`` (sign and whether |x| exceeds the mean |survivor|, four means).
        index_encoding: ``"coo32"`` (32-bit absolute indices, the original) or ``"delta16"`` (16-bit gaps).
        values: wire format of unquantized values: ``"fp32"`` (the original), ``"bf16"`` or ``"fp16"`` (values
            beyond fp16's range stay in the residual; the ``overflow`` statistic counts them).
        seed: seed of the random sample; rank r draws from seed and r.
        backend: ``"torch"`` (torch ops: the reference, and the path CUDA runs), ``"fused"``
            (:mod:`lightning_gradcomp.kernels`' group calls: the samples, their order statistics and the survivors'
            compaction of a whole group, and the sum of all ranks' payloads decoded into one dense tensor; compiled
            on CPU, torch ops elsewhere) or ``"auto"`` (fused on CPU when the kernels compile here, else torch).
            Both draw the same random sample, select the same survivors and send the same bytes. On CUDA with
            Triton installed, a group runs Triton kernels whatever the backend (``kernels/triton_graddrop.py``):
            the same bits as the torch ops.
    """
    aggregation = Aggregation.GATHER
    uses_memory = True
    fixed_size = False

    def __init__(
        self,
        drop_ratio: float = 0.99,
        sample: Sample = "random",
        scope: Scope = "layer",
        sample_fraction: float = 0.001,
        min_sample: int = 1000,
        max_sample: int = 100_000,
        quantize: Quantize = "none",
        index_encoding: IndexEncoding = "coo32",
        values: ValueFormat = "fp32",
        seed: int = 0,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        check_number(
            "drop_ratio", drop_ratio, minimum=0.0, maximum=1.0, max_open=True,
            fix="use 0.99 (the paper), 0.9 or 0.999; 0 sends every value",
        )
        check_choice("sample", sample, ("random", "strided", "exact"))
        check_choice("scope", scope, ("layer", "global"), fix="use 'layer' (per tensor) or 'global' (whole model)")
        check_number(
            "sample_fraction", sample_fraction, minimum=0.0, maximum=1.0, min_open=True,
            fix="use 0.001 (the paper's 0.1%)",
        )
        check_int("min_sample", min_sample, minimum=1, fix="use 1000")
        check_int("max_sample", max_sample, minimum=1, fix="use 100000 (the original code)")
        check_choice("quantize", quantize, QUANTIZERS)
        check_choice("index_encoding", index_encoding, INDEX_ENCODINGS)
        check_choice("values", values, VALUE_FORMATS)
        check_int("seed", seed, minimum=0)
        check_choice(
            "backend", backend, BACKENDS, fix="use 'auto' (fused on CPU when the kernels compile), 'torch' or 'fused'"
        )
        if quantize != "none" and values != "fp32":
            raise ValueError(
                f"Expected `values='fp32'` with `quantize={quantize!r}` (quantized survivors travel as codes, "
                f"not values), but got `values={values!r}`. Fix: drop `values` or set `quantize='none'`."
            )
        if quantize == "threshold" and drop_ratio == 0.0:
            raise ValueError(
                "Expected `drop_ratio` > 0 with `quantize='threshold'` (at 0 the threshold is 0 and every "
                "survivor would be sent as 0), but got 0. Fix: use `drop_ratio=0.99` or another quantizer."
            )
        self.drop_ratio = float(drop_ratio)
        self.sample = sample
        self.scope = scope
        self.sample_fraction = float(sample_fraction)
        self.min_sample = min_sample
        self.max_sample = max_sample
        self.quantize = quantize
        self.index_encoding: IndexEncoding = index_encoding
        self.values: ValueFormat = values
        self.seed = seed
        self.backend = backend
        # the random sample's streams, one counter per name; both backends draw the same positions from them
        self._keys = CounterStreams(seed)
        self._device = torch.device("cpu")
        # global scope: the latest sample (and the elements each value stands for) per parameter name, the
        # names seen in the current step, and the threshold selected on the previous step's pool
        self._pool: dict[str, tuple[Tensor, float]] = {}
        self._seen: set[str] = set()
        self._global_threshold: Optional[Tensor] = None
        # the sample plans, per group layout, device and sample settings
        self._plans: dict[tuple[object, ...], SamplePlan] = {}
        # the global pool's per-value weights and the layout they were built for
        self._pool_weights: tuple[tuple[object, ...], Tensor] = ((), torch.zeros(0))

    # -- setup and state --------------------------------------------------------------------------------
    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._device = device
        self._keys.reset(rank)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._keys.state_dict(),
            "pool": {n: (s.detach().cpu().clone(), w) for n, (s, w) in self._pool.items()},
            "seen": sorted(self._seen),
            "global_threshold": None if self._global_threshold is None else self._global_threshold.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a checkpoint from before the torch backend's draws became counter-based keeps that backend's
        # torch.Generator states under "streams" (empty when it never drew them): they cannot become counters
        check_counters(state.get("streams", {}), type(self).__name__)
        self._keys.load_state_dict(state)
        self._pool = {n: (s.to(self._device), w) for n, (s, w) in state.get("pool", {}).items()}
        self._seen = set(state.get("seen", []))
        thr = state.get("global_threshold")
        self._global_threshold = None if thr is None else thr.to(self._device)

    def describe(self) -> dict[str, Any]:
        return {
            "compressor": "GradientDropping",
            "drop_ratio": self.drop_ratio,
            "sample": self.sample,
            "scope": self.scope,
            "sample_fraction": self.sample_fraction,
            "min_sample": self.min_sample,
            "max_sample": self.max_sample,
            "quantize": self.quantize,
            "index_encoding": self.index_encoding,
            "values": self.values,
            "seed": self.seed,
            "backend": self.backend,
        }

    # -- threshold --------------------------------------------------------------------------------------
    def threshold_sample(self, magnitudes: Tensor, name: str = "") -> tuple[Tensor, float]:
        """The sampled |x| of one tensor and how many elements each sampled value stands for: the group code's sample
        of a group of one (a random sample draws from ``name``'s stream, whose counter moves on)."""
        flat = magnitudes if magnitudes.dim() == 1 else magnitudes.reshape(-1)
        plan = self._sample_plan(layer_segments(self, name, magnitudes.shape), flat.device)
        bits = self._keys.bits_flat(plan.draws, flat.device) if plan.draws.total else None
        return gather_samples(flat, plan, bits), plan.weights[0]

    def threshold(self, magnitudes: Tensor, name: str) -> Tensor:
        """The drop threshold of one tensor of |x| (0-d): the group code's threshold of a group of one (in global
        scope its sample joins the pool, as a layer of a group does)."""
        samples, _ = self.threshold_sample(magnitudes.abs(), name)  # a tensor of its own: the pool keeps views of it
        group = layer_segments(self, name, magnitudes.shape)
        plan = self._sample_plan(group, samples.device)
        return self._group_thresholds(group, samples, plan, lambda: segment_thresholds(samples, plan)).reshape(())

    def _select_global(self) -> None:
        """Select the whole-model threshold on the pool (the previous step's samples) and start a new step."""
        names = sorted(self._pool)
        samples, weights = [self._pool[n][0] for n in names], [self._pool[n][1] for n in names]
        key = tuple((n, s.numel(), w, s.device) for n, s, w in zip(names, samples, weights))
        if self._pool_weights[0] != key:  # each value's weight, kept while the pool's layout stays
            device = samples[0].device if samples else self._device
            per_sample = [torch.full((s.numel(),), float(w), device=device) for s, w in zip(samples, weights)]
            self._pool_weights = (key, torch.cat(per_sample) if per_sample else torch.zeros(0, device=device))
        self._global_threshold = select_weighted_threshold(samples, weights, self.drop_ratio, self._pool_weights[1])
        self._seen.clear()

    def _group_thresholds(
        self, segments: Segments, samples: Tensor, plan: SamplePlan, per_layer: Callable[[], Tensor]
    ) -> Tensor:
        """``[layers]``: the drop threshold of every layer of the group, in order, with a fixed number of ops.

        ``per_layer`` selects each layer's threshold on its own sample (``samples``, laid out as ``plan.segments``):
        layer scope, and the global scope's first step. In global scope every layer's sample joins the whole-model
        pool (views of one tensor), and each layer uses the threshold selected on the previous step's pool; a new
        step begins at the first layer of the group already seen this step, where the pool is selected again.
        """
        names = segments.names
        if self.scope == "layer":
            return per_layer()
        restart = next((i for i, name in enumerate(names) if name in self._seen), len(names))
        before = self._global_threshold
        parts = samples.split(plan.segments.numels)  # views of a tensor of its own (|x|, a gather or a kernel's)
        for i, name in enumerate(names):
            if i == restart:
                self._select_global()
            self._seen.add(name)
            self._pool[name] = (parts[i], plan.weights[i])
        device = samples.device
        if restart > 0:  # the layers before the restart: the threshold they would have had, per layer at first
            first = per_layer() if before is None else before.to(device).expand(len(names))
            if restart == len(names):
                return first.clone()
        after = self._global_threshold
        assert after is not None
        after = after.to(device).expand(len(names))
        if restart == 0:
            return after.clone()
        return torch.where(torch.arange(len(names), device=device) < restart, first, after)

    # -- a group of layers in one flat tensor (a single tensor is a group of one) -----------------------------
    #: the kernel sets that run the groups (:mod:`~lightning_gradcomp.compressors.graddrop_kernels`)
    providers = GRADDROP_KERNELS

    def _provider_input(self) -> CounterStreams:
        return self._keys  # the streams the samples draw from

    def _flat_settings(self) -> bool:
        """Whether the settings have a fixed number of ops per group: unquantized survivors in coo32 (either scope)."""
        return self.quantize == "none" and self.index_encoding == "coo32"

    @property
    def batched(self) -> bool:
        """Whether the ``*_flat`` methods run a fixed number of ops per group: :meth:`_flat_settings` on the torch
        backend (the path CUDA runs), or on the fused backend with the compiled kernels (a few calls per group). The
        other settings select a group at once too, and encode and decode it layer by layer."""
        return self._flat_settings() and (self._torch_ops_form() or kernels.fused_available())

    def _group_coo32(self, segments: Segments) -> bool:
        """Whether a group's payload is the group's coo32 (unquantized ``coo32`` survivors of a group whose positions
        fit int32), else each layer's own encoding back to back (:func:`~.graddrop_group.encode_layer`)."""
        return self._flat_settings() and segments.total < INT32_POSITIONS

    def _plan_key(self, segments: Segments, device: torch.device) -> tuple[object, ...]:
        return (segments.names, segments.shapes, device, self.sample, self.sample_fraction, self.min_sample,
                self.max_sample, self.drop_ratio)

    def _sample_plan(self, segments: Segments, device: torch.device) -> SamplePlan:
        key = self._plan_key(segments, device)
        plan = self._plans.get(key)
        if plan is None:
            sizes, drawn, strides = [], [], []
            for n in segments.numels:  # each layer's sample, from its shape alone
                size, draw, stride = n, 0, 1
                if self.sample == "strided" and n:
                    # Marian: sortSize = min(100000, len); tmp[j] = |data[j * (len / sortSize)]|
                    size = min(self.max_sample, n)
                    stride = n // size
                elif self.sample == "random" and n:
                    wanted = max(self.min_sample, math.ceil(self.sample_fraction * n))
                    if wanted < n:  # else the whole layer (a tensor no larger than the sample is selected exactly)
                        size = draw = wanted
                sizes.append(size)
                drawn.append(draw)
                strides.append(stride)
            counts = [drop_count(self.drop_ratio, m) for m in sizes]
            plan = self._plans[key] = plan_samples(segments, sizes, drawn, strides, counts, device)
        return plan

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None  # no statistic is shared

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        x = flat.detach()
        if x.dtype != torch.float32:  # selected and sent from the float32 values, as a float32 gradient
            x = x.float()
        plan = self._sample_plan(segments, x.device)
        fp16 = self.quantize == "none" and self.values == "fp16"
        ops = self.kernels(x.device)

        def thresholds(samples: Tensor, per_layer: Callable[[], Tensor]) -> Tensor:
            return self._group_thresholds(segments, samples, plan, per_layer)

        if self._group_coo32(segments):
            chosen, group = ops.select_coo32(x, segments, plan, thresholds, fp16, self.values)
            return self._flat_packet(group.payload, segments, flat.dtype, group.nbytes, chosen, group.sparsity,
                                     group.sent, group.compression_rate, group.overflow)
        chosen, (index, values, counts, overflow) = ops.select(x, segments, plan, thresholds, fp16)
        return self._layers_packet(index, values, counts, overflow, chosen, segments, flat.dtype, plan)

    def _layers_packet(
        self, index: Tensor, values: Tensor, counts: Tensor, overflow: Optional[Tensor], thresholds: Tensor,
        segments: Segments, dtype: torch.dtype, plan: SamplePlan,
    ) -> FlatPacket:
        """The group's packet in each layer's own encoding, back to back (:func:`~.graddrop_group.encode_layer`; the
        survivors of the group split by layer, one host read of their counts)."""
        per_layer = counts.tolist()
        parts = []
        for s, (idx, kept) in enumerate(zip(index.split(per_layer), values.split(per_layer))):
            position = idx.long() - segments.offsets[s]
            parts.append(encode_layer(position, kept, thresholds[s], segments.shapes[s], self.quantize,
                                      self.index_encoding, self.values))
        payload = torch.cat(parts) if parts else values.new_zeros(0, dtype=torch.uint8)
        sizes = tuple(p.numel() for p in parts)
        nbytes = torch.tensor(sizes, dtype=torch.int64, device=values.device)
        sparsity, sent, rate = counted_statistics(plan, counts, nbytes)
        return self._flat_packet(payload, segments, dtype, sizes, thresholds, sparsity, sent, rate, overflow)

    def _flat_packet(
        self, payload: Tensor, segments: Segments, dtype: torch.dtype, layer_nbytes: "tuple[int, ...] | Tensor",
        thresholds: Tensor, sparsity: Tensor, sent: Tensor, rate: Tensor, overflow: Optional[Tensor],
    ) -> FlatPacket:
        """The group's packet with its per-layer statistics (``overflow`` with fp16 values)."""
        stats = {"sparsity": sparsity, "threshold": thresholds, "sent": sent, "compression_rate": rate}
        if self.values == "fp16" and overflow is not None:
            stats["overflow"] = overflow
        return FlatPacket(payload, segments, dtype, layer_nbytes, stats=stats)

    def _decoded(self, packet: FlatPacket) -> tuple[Tensor, Tensor]:
        """(int64 positions from the group's start, float32 values) of a group packet in each layer's own encoding."""
        segments = packet.segments
        sizes = packet.layer_nbytes
        nbytes = sizes if isinstance(sizes, tuple) else tuple(int(n) for n in sizes.tolist())
        raw = packet.payload.reshape(-1).view(torch.uint8)
        indices, values, start = [raw.new_zeros(0, dtype=torch.int64)], [raw.new_zeros(0, dtype=torch.float32)], 0
        for offset, shape, n in zip(segments.offsets, segments.shapes, nbytes):
            if n:
                idx, val = decode_layer(raw[start : start + n], shape, self.quantize, self.index_encoding, self.values)
                indices.append(idx + offset)
                values.append(val)
            start += n
        return torch.cat(indices), torch.cat(values)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        segments, ops = packet.segments, self.kernels(packet.payload.device)
        if self._group_coo32(segments):
            return ops.decode_coo32(packet.payload, self.values, segments.total).to(packet.dtype)
        index, values = self._decoded(packet)
        out = torch.zeros(segments.total, dtype=torch.float32, device=packet.payload.device)
        return out.index_put_((index,), values).to(packet.dtype)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        if packets[0].dtype != torch.float32 or out.dtype != torch.float32:
            # summed in the gradients' dtype, rank after rank, as a layer's decoded tensors add
            total = self.decompress_flat(packets[0]).clone()
            for packet in packets[1:]:
                total.add_(self.decompress_flat(packet))
            return out.copy_(total).div_(len(packets))
        ops = self.kernels(out.device)
        if self._group_coo32(packets[0].segments):
            return ops.mean_coo32_into([p.payload for p in packets], self.values, out)
        return ops.sum_into([self._decoded(packet) for packet in packets], out).div_(len(packets))

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return self.decompress_flat(packet)
