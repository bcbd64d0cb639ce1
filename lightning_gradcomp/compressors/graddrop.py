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
``hash(i) mod n`` (:func:`~lightning_gradcomp.kernels.rng.positions`). Both backends draw exactly these positions,
per tensor and per group of tensors (the group path draws them all in a fixed number of ops). Earlier versions drew
the torch backend's positions from a ``torch.Generator`` per name (other positions, the same distribution); the
state is the per-name counters, and a checkpoint holding such generator states is refused at
:meth:`~GradientDropping.load_state_dict` (resume it with ``resume_compression='reset'``).
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.backends import BACKENDS, Backend
from lightning_gradcomp.compressors.base import Aggregation, FlatPacket, Packet, SharedStatistic
from lightning_gradcomp.compressors.graddrop_flat import (
    SamplePlan,
    decode_group_coo32,
    encode_group_coo32,
    gather_samples,
    plan_samples,
    segment_thresholds,
    survivors_mask,
)
from lightning_gradcomp.compressors.sparse_fused import FusedGradientDropping, FusedSumCompressor, decode_sum
from lightning_gradcomp.compressors.streams import CounterStreams, check_counters
from lightning_gradcomp.kernels import rng, triton_graddrop
from lightning_gradcomp.exchange.segments import Segments
from lightning_gradcomp.wire.sparse import (
    INDEX_ENCODINGS,
    VALUE_FORMATS,
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
from lightning_gradcomp.validation import check_choice, check_int, check_number

Sample = Literal["random", "strided", "exact"]
Scope = Literal["layer", "global"]
Quantize = Literal["none", "threshold", "column_mean", "global_mean", "2bit"]
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


def kth_threshold(sample: Tensor, ratio: float) -> Tensor:
    """:func:`select_threshold` through the order-statistic kernel (the fused backend's selection)."""
    k = drop_count(ratio, sample.numel())
    if k == 0:
        return sample.new_zeros((), dtype=torch.float32)
    return kernels.kth_smallest(sample, k - 1).to(sample.device)


def threshold_level(threshold: Tensor, survivors: Tensor) -> Tensor:
    """The one level of ``quantize="threshold"`` (Strom): the threshold, "effectively the minimum surviving
    absolute value" (Aji & Heafield, Sec. 5.4). At threshold 0 (more than R of the values exactly 0, or a
    one-element tensor) it is the smallest surviving |x| instead, else every survivor would be sent as 0; NaN
    when a NaN survives (NaN in, NaN out). ``survivors``: the survivors' |x| (non-empty). Returns a 1-element
    float32 tensor."""
    level = torch.where(threshold > 0, threshold.float(), survivors.min())
    return torch.where(survivors.isnan().any(), float("nan"), level).reshape(1)


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


class GradientDropping(FusedSumCompressor[FusedGradientDropping]):
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
            (:mod:`lightning_gradcomp.kernels`: sampling, order statistic and survivor compaction in fewer
            passes, the sum of all ranks' payloads decoded into one dense tensor; compiled on CPU, torch ops
            elsewhere) or ``"auto"`` (fused on CPU when the kernels compile here, else torch). Both draw the
            same random sample, select the same survivors and send the same bytes (see
            :mod:`~lightning_gradcomp.compressors.sparse_fused`). On CUDA with Triton installed, a group of layers
            (the batched path) runs Triton kernels whatever the backend (``kernels/triton_graddrop.py``): the
            same bits as the torch ops.
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
        self._offer_kernels(FusedGradientDropping(self, streams=self._keys))
        self._device = torch.device("cpu")
        # global scope: the latest sample (and the elements each value stands for) per parameter name, the
        # names seen in the current step, and the threshold selected on the previous step's pool
        self._pool: dict[str, tuple[Tensor, float]] = {}
        self._seen: set[str] = set()
        self._global_threshold: Optional[Tensor] = None
        # the batched path's sample plans, per group layout, device and sample settings
        self._plans: dict[tuple[object, ...], SamplePlan] = {}
        # the global pool's per-value weights and the layout they were built for
        self._pool_weights: tuple[tuple[object, ...], Tensor] = ((), torch.zeros(0))
        # the Triton kernels' tables, per sample plan key (as _plans)
        self._tables: dict[tuple[object, ...], triton_graddrop.GroupTables] = {}

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
        """The sampled |x| of one flat tensor and how many elements each sampled value stands for."""
        n = magnitudes.numel()
        if self.sample == "exact" or n == 0:
            return magnitudes, 1.0
        if self.sample == "strided":
            # Marian: sortSize = min(100000, len); tmp[j] = |data[j * (len / sortSize)]|
            size = min(self.max_sample, n)
            stride = n // size
            return magnitudes[: stride * size : stride], n / size
        size = max(self.min_sample, math.ceil(self.sample_fraction * n))
        if size >= n:
            return magnitudes, 1.0
        # the fused kernel's positions (sample_abs), from the same counter-based stream
        idx = rng.positions(size, n, self._keys.key(name), magnitudes.device)
        return magnitudes[idx], n / size

    def threshold(self, magnitudes: Tensor, name: str) -> Tensor:
        """The drop threshold for one flat tensor of |x| (updates the global pool in global scope)."""
        sample, weight = self.threshold_sample(magnitudes, name)
        return self.pooled_threshold(sample, weight, name)

    def pooled_threshold(
        self, sample: Tensor, weight: float, name: str, select: Callable[[Tensor, float], Tensor] = select_threshold
    ) -> Tensor:
        """The drop threshold from one tensor's sample: ``select`` on it (layer scope, or a first global step),
        else the previous step's whole-model threshold; in global scope the sample joins the pool."""
        if self.scope == "layer":
            return select(sample, self.drop_ratio)
        if name in self._seen:  # a name comes back: a new step began, select on the previous step's pool
            self._select_global()
        self._seen.add(name)
        # a copy: the sample may be a view of a tensor the hook reuses
        self._pool[name] = (sample.clone(), weight)
        if self._global_threshold is None:  # first step: no whole-model pool yet
            return select(sample, self.drop_ratio)
        return self._global_threshold.to(sample.device)

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
        """``[layers]``: :meth:`pooled_threshold` of every layer of the group, in order, with a fixed number of ops.

        ``per_layer`` selects each layer's threshold on its own sample (``samples``, laid out as ``plan.segments``).
        In global scope the pool keeps the group's samples as views of one tensor, and the whole-model threshold is
        selected again where the loop would: at the first layer of the group already seen this step.
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

    # -- compress ---------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1).float()
        n = flat.numel()
        fused = self._kernels(flat.device)
        if fused is not None:
            sample, weight = fused.threshold_sample(flat, name)
            thr = self.pooled_threshold(sample, weight, name, select=kth_threshold)
            idx, kept, overflow = fused.survivors(flat, thr)
        else:
            idx, kept, thr, overflow = self._select(flat, name)
        if self.quantize == "none":
            payload = encode_sparse(idx, kept, self.index_encoding, self.values)
        else:
            payload = self._encode_quantized(idx, kept, thr, tensor.shape, n)
        nbytes = payload.numel()
        dev = flat.device
        stats = {
            "sparsity": torch.tensor(1.0 - idx.numel() / max(n, 1), device=dev),
            "threshold": thr.detach().float().reshape(()),
            "sent": torch.tensor(float(idx.numel()), device=dev),
            # bytes fp32 would take over bytes sent (an empty payload counts as 1 byte, to stay finite)
            "compression_rate": torch.tensor(4.0 * n / max(nbytes, 1), device=dev),
        }
        if self.values == "fp16":
            stats["overflow"] = overflow
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    def _select(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(indices, values, threshold, fp16 overflow count) of the survivors, with torch ops."""
        magnitudes = flat.abs()
        thr = self.threshold(magnitudes, name)
        keep = ~(magnitudes <= thr)  # dropped at or below the threshold; a NaN never is, so it is sent
        # nothing above it (then no NaN either, and every |x| <= thr): send the ties |x| == thr. Decided on the
        # device as a mask, not with `if not keep.any()`: a branch would read a scalar back to the host per
        # tensor, which on CUDA drains the stream; the selected set is the same
        keep |= (magnitudes == thr) & ~keep.any() & (thr > 0)
        overflow = flat.new_zeros(())
        if self.quantize == "none" and self.values == "fp16":
            # fp16 would turn these into inf on every rank; they wait in the residual instead (counted)
            fits = ~(magnitudes > torch.finfo(torch.float16).max)
            overflow = (keep & ~fits).sum().float()
            keep &= fits
        idx = torch.nonzero(keep).reshape(-1)
        return idx, flat[idx], thr, overflow

    # -- quantized survivors (paper Sec. 5.4) -----------------------------------------------------------
    @staticmethod
    def _columns(shape: torch.Size, n: int) -> int:
        return 1 if len(shape) < 2 or n == 0 else n // shape[0]

    def _levels(self, idx: Tensor, kept: Tensor, thr: Tensor, shape: torch.Size, n: int) -> tuple[Tensor, Tensor]:
        """Codes per survivor and the float levels they select (the decode table)."""
        positive = kept > 0
        mag = kept.abs()
        if self.quantize == "threshold":
            return positive.long(), threshold_level(thr, mag)
        if self.quantize == "global_mean":
            return positive.long(), torch.stack((_mean(mag[~positive]), _mean(mag[positive])))
        if self.quantize == "column_mean":
            cols = self._columns(shape, n)
            col = idx % cols
            group = col * 2 + positive.long()  # [neg, pos] per column
            sums = torch.zeros(2 * cols, device=kept.device).index_add_(0, group, mag)
            counts = torch.zeros(2 * cols, device=kept.device).index_add_(0, group, torch.ones_like(mag))
            return positive.long(), torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
        # 2bit: bit 0 the sign, bit 1 "large mover" (above the mean |survivor|); a mean per (size, sign) group
        large = mag > _mean(mag)
        code = positive.long() + 2 * large.long()
        sums = torch.zeros(4, device=kept.device).index_add_(0, code, mag)
        counts = torch.zeros(4, device=kept.device).index_add_(0, code, torch.ones_like(mag))
        return code, torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)

    def _encode_quantized(self, idx: Tensor, kept: Tensor, thr: Tensor, shape: torch.Size, n: int) -> Tensor:
        # [uint32 K][float32 levels][packed codes][indices]: K sizes the rest, the index section goes last
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=kept.device)
        codes, levels = self._levels(idx, kept, thr, shape, n)
        count = torch.tensor([idx.numel()], dtype=torch.int32, device=kept.device)
        bits = 2 if self.quantize == "2bit" else 1
        return torch.cat(
            (
                count.view(torch.uint8),
                levels.float().contiguous().view(torch.uint8),
                pack_codes(codes, bits),
                encode_indices(idx, self.index_encoding),
            )
        )

    def _num_levels(self, shape: torch.Size, n: int) -> int:
        return {"threshold": 1, "global_mean": 2, "2bit": 4}.get(self.quantize, 2 * self._columns(shape, n))

    def _decode_quantized(self, payload: Tensor, shape: torch.Size, n: int) -> tuple[Tensor, Tensor]:
        k = int(payload[:4].clone().view(torch.int32)[0])
        n_levels = self._num_levels(shape, n)
        levels = payload[4 : 4 + 4 * n_levels].clone().view(torch.float32)
        start = 4 + 4 * n_levels
        bits = 2 if self.quantize == "2bit" else 1
        code_bytes = packed_codes_nbytes(k, bits)
        codes = unpack_codes(payload[start : start + code_bytes], k, bits)
        idx = decode_indices(payload[start + code_bytes :], k, self.index_encoding)
        sign = torch.where(codes % 2 == 1, 1.0, -1.0)
        if self.quantize == "threshold":
            return idx, sign * levels[0]
        if self.quantize == "column_mean":
            group = (idx % self._columns(shape, n)) * 2 + codes
            return idx, sign * levels[group]
        return idx, sign * levels[codes]

    def _decode(self, packet: Packet) -> tuple[Tensor, Tensor]:
        """(int64 indices, float32 values) of a non-empty packet."""
        if self.quantize == "none":
            return decode_sparse(packet.payload, self.index_encoding, self.values)
        return self._decode_quantized(packet.payload, packet.shape, packet.numel)

    def decompress(self, packet: Packet) -> Tensor:
        out = torch.zeros(packet.numel, dtype=torch.float32, device=packet.payload.device)
        if packet.payload.numel() > 0:
            idx, val = self._decode(packet)
            out[idx] = val
        return out.to(packet.dtype).view(packet.shape)

    def _fused_sum(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        return decode_sum(packets, self._decode, out=out)

    # -- a group of layers in one flat tensor (graddrop_flat) -------------------------------------------
    def _flat_settings(self) -> bool:
        """Whether the settings have a batched form: unquantized survivors in coo32 (either scope)."""
        return self.quantize == "none" and self.index_encoding == "coo32"

    @property
    def batched(self) -> bool:  # type: ignore[override]
        """Whether the ``*_flat`` methods run a fixed number of ops per group: :meth:`_flat_settings` on the torch
        backend (the path CUDA runs), or on the fused backend with the compiled kernels (a few calls per group)."""
        torch_ops = self.backend == "torch" if self._chosen is None else not self._chosen
        return self._flat_settings() and (torch_ops or kernels.fused_available())

    def batch_on(self, flat: Tensor, segments: Segments) -> bool:
        """Batched for the settings of :meth:`_flat_settings`, float32 gradients and groups whose positions fit the
        int32 indices, on every backend (the compiled kernels' group calls on the CPU, torch ops or Triton on CUDA)."""
        return (
            self._flat_settings() and flat.dtype == torch.float32
            and segments.total < 2**31  # group indices travel as int32
        )

    def _plan_key(self, segments: Segments, device: torch.device) -> tuple[object, ...]:
        return (segments.names, segments.shapes, device, self.sample, self.sample_fraction, self.min_sample,
                self.max_sample, self.drop_ratio)

    def _triton_tables(self, segments: Segments, plan: SamplePlan, device: torch.device) -> triton_graddrop.GroupTables:
        """The Triton kernels' tables of this group and sample plan on ``device`` (built once)."""
        key = self._plan_key(segments, device)
        tables = self._tables.get(key)
        if tables is None:
            _, sizes, modes, _, _ = plan.kernel_args
            tables = self._tables[key] = triton_graddrop.GroupTables(
                segments.numels, sizes.tolist(), modes.tolist(), device
            )
        return tables

    def _sample_plan(self, segments: Segments, device: torch.device) -> SamplePlan:
        key = self._plan_key(segments, device)
        plan = self._plans.get(key)
        if plan is None:
            sizes, drawn, strides = [], [], []
            for n in segments.numels:  # threshold_sample's choices, from the shape alone
                size, draw, stride = n, 0, 1
                if self.sample == "strided" and n:
                    size = min(self.max_sample, n)
                    stride = n // size
                elif self.sample == "random" and n:
                    wanted = max(self.min_sample, math.ceil(self.sample_fraction * n))
                    if wanted < n:
                        size = draw = wanted
                sizes.append(size)
                drawn.append(draw)
                strides.append(stride)
            counts = [drop_count(self.drop_ratio, m) for m in sizes]
            plan = self._plans[key] = plan_samples(segments, sizes, drawn, strides, counts, device)
        return plan

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None  # no statistic is shared (and the default would visit every layer to learn it)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        if not self.batch_on(flat, segments):
            return super().compress_flat(flat, segments, shared)
        x = flat.detach()
        device = x.device
        plan = self._sample_plan(segments, device)
        fp16 = self.values == "fp16"
        if self.uses_triton(x):  # the torch path's ops below, in Triton kernels (the samples' sort excepted)
            x = x.contiguous()
            tables = self._triton_tables(segments, plan, device)
            keys = triton_graddrop.keys_on(self._keys.keys(plan.draws), device) if plan.draws.total else None
            samples = x.abs() if plan.whole else triton_graddrop.sample(x, tables, keys)
            thresholds = self._group_thresholds(segments, samples, plan, lambda: segment_thresholds(samples, plan))
            payload, counts, overflow_count = triton_graddrop.select_encode(
                x, tables, thresholds, value_dtype(self.values), fp16
            )
            nbytes, (sparsity, sent, rate, overflow) = triton_graddrop.statistics(
                counts, overflow_count, plan.numels, value_nbytes(self.values)
            )
            return self._flat_packet(payload, segments, flat.dtype, nbytes, thresholds, sparsity, sent, rate, overflow)
        if self._kernels(device) is not None:  # kernel calls, its random samples keyed as the fused loop keys them
            offsets, sizes, modes, ranks, sample_offsets = plan.kernel_args
            keys = torch.tensor(self._keys.keys(plan.draws))
            samples = kernels.graddrop_group_sample(x, offsets, sizes, modes, keys)
            thresholds = self._group_thresholds(
                segments, samples, plan, lambda: kernels.graddrop_group_kth(samples, sample_offsets, ranks)
            )
            index, values, counts, overflow = kernels.graddrop_group_select(x, offsets, thresholds, fp16)
            payload = torch.cat((index.view(torch.uint8), values.to(value_dtype(self.values)).view(torch.uint8)))
        else:
            magnitudes = x.abs()
            # every drawing layer's positions from its own counter, as threshold_sample and the kernel draw them
            bits = self._keys.bits_flat(plan.draws, device) if plan.draws.total else None
            samples = gather_samples(magnitudes, plan, bits)
            thresholds = self._group_thresholds(segments, samples, plan, lambda: segment_thresholds(samples, plan))
            keep = survivors_mask(magnitudes, thresholds, segments)
            if fp16:
                # fp16 would turn these into inf on every rank; they wait in the residual instead (counted)
                fits = ~(magnitudes > torch.finfo(torch.float16).max)
                overflow = segments.reduce((keep & ~fits).to(torch.float32), "sum")
                keep &= fits
            payload = encode_group_coo32(x, keep, self.values)
            counts = segments.reduce(keep.to(torch.int64), "sum")
        nbytes = counts * (4 + value_nbytes(self.values))
        numels = plan.numels
        # in float64 then rounded once, as the per-layer packets compute them in Python floats
        sparsity = (1.0 - counts / numels.clamp(min=1)).float()
        rate = (4.0 * numels / nbytes.clamp(min=1)).float()
        return self._flat_packet(payload, segments, flat.dtype, nbytes, thresholds, sparsity, counts.float(), rate,
                                 overflow if fp16 else None)

    def _flat_packet(
        self, payload: Tensor, segments: Segments, dtype: torch.dtype, nbytes: Tensor, thresholds: Tensor,
        sparsity: Tensor, sent: Tensor, rate: Tensor, overflow: Optional[Tensor],
    ) -> FlatPacket:
        """The group's packet with the per-layer statistics of the per-layer packets (``overflow`` with fp16 values)."""
        stats = {"sparsity": sparsity, "threshold": thresholds, "sent": sent, "compression_rate": rate}
        if self.values == "fp16" and overflow is not None:
            stats["overflow"] = overflow
        return FlatPacket(payload, segments, dtype, nbytes, stats=stats)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        if packet.layers is not None:
            return super().decompress_flat(packet)
        if self.uses_triton(packet.payload):
            decoded = triton_graddrop.decode(packet.payload, value_dtype(self.values), packet.segments.total)
            return decoded.to(packet.dtype)
        index, values = decode_group_coo32(packet.payload, self.values)
        out = torch.zeros(packet.segments.total, dtype=torch.float32, device=packet.payload.device)
        return out.index_put_((index,), values).to(packet.dtype)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        if packets[0].layers is not None or packets[0].dtype != torch.float32 or out.dtype != torch.float32:
            # looping packets, or a sum the loop makes in the gradients' dtype: the base class's rank-order sum
            return super().decompress_flat_mean_into(packets, out)
        if self.uses_triton(out) and out.is_contiguous():  # each rank's survivors added in rank order, then div_
            return triton_graddrop.decode_mean_into([p.payload for p in packets], value_dtype(self.values), out)
        decoded = [decode_group_coo32(packet.payload, self.values) for packet in packets]
        if self._kernels(out.device) is not None and out.is_contiguous():  # one kernel call for all ranks
            kernels.sparse_decode_sum(out.numel(), [i for i, _ in decoded], [v for _, v in decoded], out=out)
            return out.div_(len(packets))
        # each rank's survivors are distinct positions: added rank after rank, the sums of the dense loop
        out.zero_()
        for index, values in decoded:
            out.index_add_(0, index, values)
        return out.div_(len(packets))

def _mean(values: Tensor) -> Tensor:
    """Mean of a possibly empty tensor (0 when empty), as a 0-d tensor."""
    if values.numel() == 0:
        return values.new_zeros(())
    return values.mean()
