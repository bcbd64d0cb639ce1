"""Test oracle: Gradient Dropping one layer at a time, as it was written before its group code
(:mod:`lightning_gradcomp.compressors.graddrop_group`) became the one implementation.

:class:`LayerGradientDropping` is :class:`~lightning_gradcomp.compressors.GradientDropping` with its per-layer methods
written per layer: ``backend="torch"`` selects with torch ops (``torch.kthvalue``, a mask, ``nonzero``),
``backend="fused"`` with the per-layer kernels (:class:`FusedGradientDropping`: ``sample_abs``, ``kth_smallest``,
``select_above``), both drawing the random sample from the same counter-based streams as the group code, so the group
code must equal it bit for bit. Its group methods are the base class's loop over these per-layer methods, so
``LayerGradientDropping(...).compress_flat`` is the looping reference of a group: each layer's packet, back to back.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.graddrop import GradientDropping, drop_count, select_threshold
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.kernels import rng
from lightning_gradcomp.wire.sparse import (
    decode_indices,
    decode_sparse,
    encode_indices,
    encode_sparse,
    pack_codes,
    packed_codes_nbytes,
    unpack_codes,
)
from tests.oracles.layer_loop import LayerLoop


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


class GradientDroppingSettings(Protocol):
    """The settings of :class:`~lightning_gradcomp.compressors.GradientDropping` the fused path reads (at each call)."""

    @property
    def sample(self) -> str: ...

    @property
    def sample_fraction(self) -> float: ...

    @property
    def min_sample(self) -> int: ...

    @property
    def max_sample(self) -> int: ...

    @property
    def quantize(self) -> str: ...

    @property
    def values(self) -> str: ...


class FusedGradientDropping:
    """Gradient Dropping's fused steps: the threshold's sample and the survivors above a threshold.

    :class:`~lightning_gradcomp.compressors.GradientDropping` composes them with its own threshold selection
    (which keeps the global scope's pool).

    Args:
        settings: the compressor's settings, read at each call (a schedule may change them between steps).
        streams: the random sample's streams (their counters are checkpointed by the compressor).
    """

    def __init__(self, settings: GradientDroppingSettings, streams: CounterStreams) -> None:
        self.settings = settings
        self.streams = streams

    def threshold_sample(self, flat: Tensor, name: str) -> tuple[Tensor, float]:
        """:meth:`GradientDropping.threshold_sample` on the values (not their magnitudes): the same sample
        for ``"exact"`` and ``"strided"``, counter-based random positions for ``"random"``."""
        n = flat.numel()
        if self.settings.sample == "exact" or n == 0:
            return flat.abs(), 1.0
        if self.settings.sample == "strided":
            size = min(self.settings.max_sample, n)
            return kernels.sample_abs(flat, size, "strided"), n / size
        size = max(self.settings.min_sample, math.ceil(self.settings.sample_fraction * n))
        if size >= n:
            return flat.abs(), 1.0
        return kernels.sample_abs(flat, size, "random", self.streams.key(name)), n / size

    def survivors(self, flat: Tensor, thr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(indices, values, fp16 overflow count) of the survivors |x| > ``thr`` of a flat float32 tensor, as
        ``GradientDropping`` selects them on the torch backend."""
        idx, kept = kernels.select_above(flat, thr)  # not at or below the threshold: NaN is sent
        if idx.numel() == 0 and thr > 0:  # nothing above it: every |x| ties with it, send the ties
            idx, kept = kernels.select_above(flat, thr, inclusive=True)
        overflow = flat.new_zeros(())
        if self.settings.quantize == "none" and self.settings.values == "fp16":
            # fp16 would turn these into inf on every rank; they wait in the residual instead (counted)
            fits = ~(kept.abs() > torch.finfo(torch.float16).max)
            overflow = (~fits).sum().float()
            idx, kept = idx[fits], kept[fits]
        return idx.long(), kept, overflow


class LayerGradientDropping(LayerLoop, GradientDropping):
    """Gradient Dropping per layer (the oracle); same options as :class:`~lightning_gradcomp.compressors.GradientDropping`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fused = FusedGradientDropping(self, streams=self._keys)

    def _layer_kernels(self, device: torch.device) -> Optional[FusedGradientDropping]:
        return self._fused if self.kernels(device).name == "fused" else None

    # a loop over layers is not a fixed number of ops per group (the group methods: LayerLoop's)
    @property
    def batched(self) -> bool:
        return False

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

    # -- compress ---------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1).float()
        n = flat.numel()
        fused = self._layer_kernels(flat.device)
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
        pairs = [self._decode(p) for p in packets if p.payload.numel() > 0]
        return kernels.sparse_decode_sum(packets[0].numel, [i for i, _ in pairs], [v for _, v in pairs], out=out.view(-1))

    # the sums the fused backend decoded with the kernels (float32 gradients), the base class's otherwise
    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        first = packets[0]
        if first.dtype != torch.float32 or self.kernels(first.payload.device).name != "fused":
            return LayerLoop.decompress_sum(self, packets)
        out = torch.empty(first.numel, dtype=torch.float32, device=first.payload.device)
        return self._fused_sum(packets, out).view(first.shape)

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        first = packets[0]
        writes_into = (first.dtype == torch.float32 and out.dtype == torch.float32 and out.is_contiguous()
                       and out.numel() == first.numel)
        if not writes_into or self.kernels(first.payload.device).name != "fused":
            return LayerLoop.decompress_sum_into(self, packets, out)
        self._fused_sum(packets, out)
        return out


def _mean(values: Tensor) -> Tensor:
    """Mean of a possibly empty tensor (0 when empty), as a 0-d tensor."""
    if values.numel() == 0:
        return values.new_zeros(())
    return values.mean()
