"""TernGrad over a group of layers laid out in one flat tensor: a fixed number of torch ops per group, whatever the
number of layers (the hook's batched pipeline, :mod:`lightning_gradcomp.segments`; what CUDA runs).

The maths is the fused backend's (:mod:`~lightning_gradcomp.compressors.terngrad_fused`), so the result equals
``backend="fused"`` layer by layer bit for bit given the same scalers:

* scalers and clip thresholds per chunk from one float64 pass (sums of g and g**2 per chunk, one
  ``scatter_reduce`` each) and :func:`~lightning_gradcomp.kernels.terngrad_scaler`;
* draws from the counter-based stream of :mod:`lightning_gradcomp.kernels.rng`, keyed per layer exactly as the fused
  backend keys it (``(seed, rank, counter, stream id of the name)``, computed on the host and sent as one small
  tensor per group); an element's index in the stream is its index within its layer;
* the wire layout of every layer is today's (2-bit quarter-split or base-3 fifth-split packing, the scalers after
  the packed bytes when they are per worker), so the group payload is byte for byte the concatenation of the
  per-layer payloads and ``layer_nbytes`` are today's.

``backend="torch"`` draws from ``torch.Generator`` layer by layer, which cannot be batched; its batched path draws
from the counter-based stream instead: the same Bernoulli probabilities ``min(|g|, clip) / s`` (a 24-bit uniform
against them, as ``torch.rand``), the same scalers up to float32 rounding of sigma (float64 sums instead of
``torch.std``), so the same expectation (unbiased) and variance.

Chunks: each layer is cut into chunks of ``bucket_size`` elements (the last one shorter), one scaler each; with
``bucket_size=None`` one chunk per layer; an empty layer has no chunk (no scaler, no byte on the wire). The
chunks of a group are themselves :class:`~lightning_gradcomp.segments.Segments`, so per-chunk reductions are one
``scatter_reduce`` each.
"""

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Aggregation, FlatPacket, SharedStatistic
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.kernels import rng
from lightning_gradcomp.segments import Segments
from lightning_gradcomp.wire import Packing

_PER_BYTE = {"2bit": 4, "base3": 5}
_RADIX = {"2bit": 4, "base3": 3}
_ZERO_CODE = 1  # a ternary t is sent as the code t + 1; padding is a zero


class FlatSettings(Protocol):
    """The settings of :class:`~lightning_gradcomp.compressors.TernGrad` the batched path reads (at each call)."""

    @property
    def clip_factor(self) -> float: ...

    @property
    def clip_mode(self) -> str: ...

    @property
    def scaler_share(self) -> str: ...

    @property
    def bucket_size(self) -> Optional[int]: ...

    @property
    def packing(self) -> Packing: ...


def chunk_counts(numels: Sequence[int], bucket: Optional[int]) -> tuple[int, ...]:
    """Chunks (scalers) of each layer: none for an empty layer."""
    return tuple(0 if n == 0 else 1 if bucket is None else -(-n // bucket) for n in numels)


class _PerDevice:
    """Tensors built once on the host and kept per device."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, torch.device], Tensor] = {}

    def get(self, key: str, device: torch.device, build: Any) -> Tensor:
        cached = self._cache.get((key, device))
        if cached is None:
            cached = self._cache[(key, device)] = build().to(device)
        return cached


class ChunkLayout:
    """The chunks of a group of layers (one scaler each), and the per-element index tensors the batched path needs.

    Args:
        segments: the group's layout.
        bucket: ``bucket_size`` (``None``: one chunk per non-empty layer).
    """

    def __init__(self, segments: Segments, bucket: Optional[int]) -> None:
        self.segments = segments
        self.counts = chunk_counts(segments.numels, bucket)
        if bucket is None and all(segments.numels):
            self.chunks = segments  # one chunk per layer: share the layout and its cached ids
        else:
            lengths = []
            for n, c in zip(segments.numels, self.counts):
                size = n if bucket is None else bucket
                lengths += [min(size, n - k * size) for k in range(c)]
            self.chunks = Segments([str(i) for i in range(len(lengths))], [torch.Size((n,)) for n in lengths])
        #: layer i spans ``counts[i]`` chunks: per-layer reductions of per-chunk values
        self.by_layer = Segments(segments.names, [torch.Size((c,)) for c in self.counts])
        self._tensors = _PerDevice()

    def lengths(self, device: torch.device) -> Tensor:
        """float64 ``[chunks]``: elements per chunk."""
        return self._tensors.get("lengths", device, lambda: torch.tensor(self.chunks.numels, dtype=torch.float64))

    def numels(self, device: torch.device) -> Tensor:
        """float32 ``[layers]``: elements per layer, at least 1 (a divisor)."""
        return self._tensors.get(
            "numels", device, lambda: torch.tensor([max(n, 1) for n in self.segments.numels], dtype=torch.float32)
        )

    def nonempty(self, device: torch.device) -> Tensor:
        """bool ``[layers]``: whether each layer has elements."""
        return self._tensors.get("nonempty", device, lambda: torch.tensor([n > 0 for n in self.segments.numels]))

    def within(self, device: torch.device) -> Tensor:
        """int64 ``[total]``: each element's index within its layer (its index in the layer's random stream)."""

        def build() -> Tensor:
            seg = self.segments
            starts = torch.tensor(seg.offsets[:-1], dtype=torch.int64)
            return torch.arange(seg.total, dtype=torch.int64) - seg.expand(starts)

        return self._tensors.get("within", device, build)


class PackLayout:
    """Where each element's code and each layer's scalers go in the group payload: every layer packed as
    :func:`~lightning_gradcomp.wire.pack_ternary` packs it (its padded length split into ``per`` contiguous parts,
    byte k holding element k of each part), then, when scalers travel per worker, the layer's float32 scalers.

    Args:
        segments: the group's layout.
        packing: ``"2bit"`` or ``"base3"``.
        scalers: scalers each layer appends to its bytes (``None``: none, the scaler is shared).
    """

    def __init__(self, segments: Segments, packing: Packing, scalers: Optional[Sequence[int]]) -> None:
        self.segments = segments
        self.per = _PER_BYTE[packing]
        self.radix = _RADIX[packing]
        self.packed = tuple(-(-n // self.per) for n in segments.numels)
        self.bytes = sum(self.packed)
        extra = [0] * len(segments) if scalers is None else [4 * c for c in scalers]
        #: bytes each layer puts on the wire
        self.layer_nbytes = tuple(m + e for m, e in zip(self.packed, extra))
        self.with_scalers = scalers is not None
        self._extra = extra
        self._tensors = _PerDevice()

    def weights(self, device: torch.device) -> Tensor:
        """uint8 ``[per, 1]``: the place value of each part's code in a byte (4**j, or 3**j in base 3)."""
        return self._tensors.get(
            "weights", device, lambda: torch.tensor([self.radix**j for j in range(self.per)], dtype=torch.uint8)[:, None]
        )

    def _parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For every byte b of the packed bytes: its layer's element offset, numel and packed length, and b's
        index within its layer's bytes."""
        seg = self.segments
        packed = torch.tensor(self.packed, dtype=torch.int64)
        layer = torch.arange(len(seg)).repeat_interleave(packed)
        byte_start = torch.tensor([0, *self.packed], dtype=torch.int64).cumsum(0)[:-1]
        k = torch.arange(self.bytes, dtype=torch.int64) - byte_start[layer]
        return torch.tensor(seg.offsets[:-1], dtype=torch.int64)[layer], torch.tensor(seg.numels)[layer], packed[layer], k

    def gather(self, device: torch.device) -> Tensor:
        """int64 ``[per * bytes]``: for part j and byte b, the flat element it packs, or ``total`` for padding."""

        def build() -> Tensor:
            start, numel, m, k = self._parts()
            src = torch.arange(self.per, dtype=torch.int64)[:, None] * m[None, :] + k[None, :]
            return torch.where(src < numel, start + src, self.segments.total).reshape(-1)

        return self._tensors.get("gather", device, build)

    def scatter(self, device: torch.device) -> Tensor:
        """int64 ``[total]``: for every element, its code's place ``j * bytes + b`` in the ``[per, bytes]`` codes."""

        def build() -> Tensor:
            seg = self.segments
            layer = seg.ids(torch.device("cpu"))
            starts = torch.tensor(seg.offsets[:-1], dtype=torch.int64)[layer]
            packed = torch.tensor(self.packed, dtype=torch.int64)
            byte_start = torch.tensor([0, *self.packed], dtype=torch.int64).cumsum(0)[:-1][layer]
            w = torch.arange(seg.total, dtype=torch.int64) - starts
            m = packed[layer]
            return (w // m) * self.bytes + byte_start + w % m

        return self._tensors.get("scatter", device, build)

    def payload_index(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """int64 positions in the payload of the packed bytes (``[bytes]``) and of the scaler bytes (``[4 chunks]``)."""

        def positions(which: int) -> Tensor:
            parts = []
            offset = 0
            for m, e in zip(self.packed, self._extra):
                parts.append(torch.arange(offset, offset + m) if which == 0 else torch.arange(offset + m, offset + m + e))
                offset += m + e
            return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

        return (self._tensors.get("packed_at", device, lambda: positions(0)),
                self._tensors.get("scalers_at", device, lambda: positions(1)))


@dataclass
class _Layouts:
    chunks: dict[Optional[int], ChunkLayout] = field(default_factory=dict)
    packs: dict[tuple[str, Optional[tuple[int, ...]]], PackLayout] = field(default_factory=dict)


class FlatTernGrad:
    """TernGrad's batched path: a whole group of layers per call, in a fixed number of torch ops.

    Args:
        settings: the compressor's settings, read at each call.
        sigma_noise: a chunk whose sigma is at most this times its max |g| counts as constant (not clipped).
        streams: the counter-based random streams (shared with the fused backend, checkpointed by the compressor).
    """

    def __init__(self, settings: FlatSettings, sigma_noise: float, streams: CounterStreams) -> None:
        self.settings = settings
        self.sigma_noise = sigma_noise
        self.streams = streams
        self._layouts: "weakref.WeakKeyDictionary[Segments, _Layouts]" = weakref.WeakKeyDictionary()
        #: the statistics :meth:`statistic` computed, for :meth:`compress` of the same tensor
        self._pending: "weakref.WeakKeyDictionary[Segments, tuple[Tensor, int, Tensor, Optional[Tensor]]]" = (
            weakref.WeakKeyDictionary()
        )

    def forget(self) -> None:
        """Drop the statistics kept between :meth:`statistic` and :meth:`compress` (the state was replaced)."""
        self._pending = weakref.WeakKeyDictionary()

    # -- layouts (built once per group and setting) -------------------------------------------------------
    def _of(self, segments: Segments) -> _Layouts:
        layouts = self._layouts.get(segments)
        if layouts is None:
            layouts = self._layouts[segments] = _Layouts()
        return layouts

    def chunk_layout(self, segments: Segments) -> ChunkLayout:
        layouts, bucket = self._of(segments), self.settings.bucket_size
        layout = layouts.chunks.get(bucket)
        if layout is None:
            layout = layouts.chunks[bucket] = ChunkLayout(segments, bucket)
        return layout

    def pack_layout(self, segments: Segments) -> PackLayout:
        layouts = self._of(segments)
        scalers = None if self.settings.scaler_share == "max" else self.chunk_layout(segments).counts
        key = (self.settings.packing, scalers)
        layout = layouts.packs.get(key)
        if layout is None:
            layout = layouts.packs[key] = PackLayout(segments, self.settings.packing, scalers)
        return layout

    # -- statistics -------------------------------------------------------------------------------------
    def scale_clip(self, flat: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's scaler per chunk and the clip threshold per chunk (``None``: no clipping), as
        :func:`~lightning_gradcomp.kernels.terngrad_scale_clip` gives them layer by layer."""
        chunks = self.chunk_layout(segments)
        x = flat.detach().reshape(-1).to(torch.float32)
        absmax = chunks.chunks.reduce(x.abs(), "amax")
        s = self.settings
        if s.clip_factor == 0.0:
            return absmax, None
        d = x.to(torch.float64)
        lengths = chunks.lengths(x.device)
        mean = chunks.chunks.reduce(d, "sum") / lengths
        var = (chunks.chunks.reduce(d * d, "sum") / lengths - mean * mean).clamp_min(0.0)
        return kernels.terngrad_scaler(var.sqrt().to(torch.float32), absmax, s.clip_factor, s.clip_mode, self.sigma_noise)

    def statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        """Every chunk's local scaler, layer after layer (the looping path's layout too), when scalers are shared."""
        if self.settings.scaler_share != "max":
            return None
        scale, clip = self.scale_clip(flat, segments)
        self._pending[segments] = (flat, flat._version, scale, clip)
        return SharedStatistic(scale, self.chunk_layout(segments).counts)

    def _take(self, flat: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        cached = self._pending.pop(segments, None)
        if cached is not None and cached[0] is flat and cached[1] == flat._version:
            return cached[2], cached[3]
        return self.scale_clip(flat, segments)

    # -- compress ---------------------------------------------------------------------------------------
    def _keys(self, segments: Segments, device: torch.device) -> tuple[Tensor, Tensor]:
        """int64 ``[layers]`` stream keys (k0, k1) of each layer's next draw; an empty layer draws nothing."""
        keys = [self.streams.key(name) if n else (0, 0) for name, n in zip(segments.names, segments.numels)]
        both = torch.tensor(keys, dtype=torch.int64).reshape(-1, 2).to(device)
        return both[:, 0], both[:, 1]

    def ternarize(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> Tensor:
        """int8 ``[total]`` ternaries: t = sign(g) b, b ~ Bernoulli(min(|g|, clip) / s), the fused backend's draws."""
        chunks = self.chunk_layout(segments)
        x = flat.detach().reshape(-1).to(torch.float32)
        k0, k1 = self._keys(segments, x.device)
        u = rng.uniform(chunks.within(x.device), segments.expand(k0), segments.expand(k1))
        a = x.abs()
        if clip is not None:
            a = torch.minimum(a, chunks.chunks.expand(clip))
        keep = u.mul_(chunks.chunks.expand(scale)) < a
        return torch.where(keep, torch.sign(x), 0.0).to(torch.int8)

    def compress(
        self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic], aggregation: Aggregation
    ) -> FlatPacket:
        """The group's packet travelling as ``aggregation`` (int8 ternaries to sum, or packed payloads to gather)."""
        chunks = self.chunk_layout(segments)
        local, clip = self._take(flat, segments)
        s = local
        if shared is not None and self.settings.scaler_share == "max":
            s = shared.values.to(local.device, torch.float32)
        ternary = self.ternarize(flat, segments, s, clip)
        nonzero = segments.reduce((ternary != 0).to(torch.int32), "sum").to(torch.float32)
        # the fused backend's 1 - nonzero / n; an empty layer is all sparse-or-nothing: 0, as the torch path says
        sparsity = torch.where(chunks.nonempty(flat.device), 1.0 - nonzero / chunks.numels(flat.device), 0.0)
        stats = {"sparsity": sparsity, "scaler": chunks.by_layer.reduce(s, "amax")}
        ctx: dict[str, Any] = {"scale": s}
        if aggregation is Aggregation.SUM:
            return FlatPacket(ternary, segments, flat.dtype, segments.numels, ctx, stats)
        layout = self.pack_layout(segments)
        packed = self.pack(ternary, layout)
        if layout.with_scalers:
            payload = packed.new_empty(sum(layout.layer_nbytes))
            packed_at, scalers_at = layout.payload_index(packed.device)
            payload.index_copy_(0, packed_at, packed).index_copy_(0, scalers_at, s.contiguous().view(torch.uint8))
            packed, ctx = payload, {}
        return FlatPacket(packed, segments, flat.dtype, layout.layer_nbytes, ctx, stats)

    @staticmethod
    def pack(ternary: Tensor, layout: PackLayout) -> Tensor:
        """uint8 ``[bytes]``: every layer's ternaries packed as :func:`~lightning_gradcomp.wire.pack_ternary` packs them."""
        codes = torch.cat((ternary + _ZERO_CODE, ternary.new_full((1,), _ZERO_CODE))).view(torch.uint8)
        parts = codes.index_select(0, layout.gather(codes.device)).view(layout.per, layout.bytes)
        # place values times codes (<= 2) sum below 256: exact in uint8
        return parts.mul_(layout.weights(codes.device)).sum(0, dtype=torch.uint8)

    # -- decompress -------------------------------------------------------------------------------------
    def _codes(self, packed: Tensor, layout: PackLayout) -> Tensor:
        """uint8 ``[..., per, bytes]``: each byte's codes, part by part."""
        return torch.div(packed.unsqueeze(-2), layout.weights(packed.device), rounding_mode="floor").remainder_(layout.radix)

    def _packed_and_scale(self, packet: FlatPacket, layout: PackLayout) -> tuple[Tensor, Tensor]:
        if "scale" in packet.ctx:
            return packet.payload, packet.ctx["scale"]
        packed_at, scalers_at = layout.payload_index(packet.payload.device)
        return packet.payload.index_select(0, packed_at), packet.payload.index_select(0, scalers_at).view(torch.float32)

    def _scaled(self, values: Tensor, scale: Tensor, segments: Segments, out: Optional[Tensor] = None) -> Tensor:
        """float32 ``values * scale`` (the scaler of each element's chunk), into ``out`` when given (float32)."""
        per_element = self.chunk_layout(segments).chunks.expand(scale.to(values.device, torch.float32))
        return torch.mul(values.to(torch.float32), per_element, out=out)

    def values(self, packet: FlatPacket) -> tuple[Tensor, Tensor]:
        """The integer values of one packet (ternaries, or their sum over ranks in the int8 form) and its scalers."""
        if packet.payload.dtype == torch.int8:
            return packet.payload, packet.ctx["scale"]
        layout = self.pack_layout(packet.segments)
        packed, scale = self._packed_and_scale(packet, layout)
        codes = self._codes(packed, layout).view(-1).index_select(0, layout.scatter(packed.device))
        return codes.view(torch.int8) - _ZERO_CODE, scale

    def decompress(self, packet: FlatPacket) -> Tensor:
        """The flat ``[total]`` decoded packet, of ``packet.dtype``."""
        values, scale = self.values(packet)
        return self._scaled(values, scale, packet.segments).to(packet.dtype)

    def decompress_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean into ``out``, as :meth:`TernGrad.decompress_mean_into` rounds it layer by layer."""
        first, ranks = packets[0], len(packets)
        if "scale" not in first.ctx:  # per-worker scalers: decode each rank, sum the decoded in rank order
            total = self.decompress(first)
            for packet in packets[1:]:
                total.add_(self.decompress(packet))
            return out.copy_(total).div_(ranks)
        # one shared scaler: the exact integer sum over ranks, scaled once
        layout = self.pack_layout(first.segments)
        payloads = torch.stack([p.payload for p in packets])
        sums = self._codes(payloads, layout).sum(0, dtype=torch.int32).view(-1)
        values = sums.index_select(0, layout.scatter(sums.device)).sub_(ranks * _ZERO_CODE)
        if out.dtype == torch.float32 and out.is_contiguous():
            self._scaled(values, first.ctx["scale"], first.segments, out=out.view(-1))
        else:
            out.copy_(self._scaled(values, first.ctx["scale"], first.segments).to(first.dtype))
        return out.div_(ranks)


__all__ = ["ChunkLayout", "FlatSettings", "FlatTernGrad", "PackLayout", "chunk_counts"]
