"""TernGrad over a group of layers laid out in one flat tensor: a fixed number of ops per group, whatever the number
of layers (the hook's batched pipeline, :mod:`lightning_gradcomp.flat`). This is TernGrad's one
implementation: a single tensor (``TernGrad.compress(tensor, name)``) is a group of one.

The result equals TernGrad's per-layer oracle (``tests/oracles/terngrad.py`` with the per-layer kernels) layer by
layer, bit for bit, given the same scalers:

* scalers and clip thresholds per chunk from one float64 pass (sums of g and g**2 per chunk, one
  ``scatter_reduce`` each) and :func:`~lightning_gradcomp.kernels.terngrad_scaler`;
* draws from the counter-based stream of :mod:`lightning_gradcomp.kernels.rng`, keyed per layer
  (``(seed, rank, counter, stream id of the name)``, computed on the host and sent as one small tensor per group); an
  element's index in the stream is its index within its layer;
* the wire layout of every layer is one layer's (2-bit quarter-split or base-3 fifth-split packing, the scalers after
  the packed bytes when they are per worker), so the group payload is byte for byte the concatenation of the
  per-layer payloads.

The operations a kernel set runs (scalers and clip thresholds, ternarize and pack, decode, decode-and-average) are
the provider's (:class:`TernGradKernels`; torch ops, the compiled CPU kernels one call per group, or Triton's:
:mod:`~lightning_gradcomp.compressors.terngrad_kernels`), chosen once by the compressor; every one gives the same
bits.

Chunks: each layer is cut into chunks of ``bucket_size`` elements (the last one shorter), one scaler each; with
``bucket_size=None`` one chunk per layer; an empty layer has no chunk (no scaler, no byte on the wire). The
chunks of a group are themselves :class:`~lightning_gradcomp.flat.Segments`, so per-chunk reductions are one
``scatter_reduce`` each.
"""

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.kernels import triton_terngrad
from lightning_gradcomp.wire.ternary import Packing

_PER_BYTE = {"2bit": 4, "base3": 5}
_RADIX = {"2bit": 4, "base3": 3}
ZERO_CODE = 1  # a ternary t is sent as the code t + 1; padding is a zero


class TernGradSettings(Protocol):
    """The settings of :class:`~lightning_gradcomp.compressors.TernGrad` the group code reads (at each call, so a
    setting changed between steps, e.g. by ``CompressionSchedule``, takes effect at the next group)."""

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


class TernGradKernels(Protocol):
    """The operations of TernGrad's group step that a kernel set runs (:mod:`~.terngrad_kernels`: torch ops, the
    compiled CPU kernels, Triton's); each gives the torch ops' bits."""

    @property
    def name(self) -> str:
        """The kernel set: ``"torch"``, ``"fused"`` or ``"triton"``."""
        ...

    def scale_clip(self, x: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's scaler per chunk and the clip threshold per chunk of float32 ``x`` (``None``: no clipping)."""
        ...

    def encode(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """int8 ``[total]`` ternaries (the stream's next draws) and the nonzero count of each layer."""
        ...

    def encode_payload(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The packed payload (per-worker scaler bytes still to be written) and the nonzero count of each layer."""
        ...

    def scale_int8(self, packet: FlatPacket) -> Tensor:
        """float32 ``[total]``: the int8 form's values times their scalers."""
        ...

    def decode(self, packet: FlatPacket, scale: Tensor) -> Tensor:
        """float32 ``[total]``: one packed payload decoded with its scalers."""
        ...

    def mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean of the packets into ``out``."""
        ...


def chunk_counts(numels: Sequence[int], bucket: Optional[int]) -> tuple[int, ...]:
    """Chunks (scalers) of each layer: none for an empty layer."""
    return tuple(0 if n == 0 else 1 if bucket is None else -(-n // bucket) for n in numels)


def ternary_from_uniforms(x: Tensor, u: Tensor, scale: Tensor, clip: Optional[Tensor] = None) -> Tensor:
    """int8 ternaries ``t = sign(x) * b`` with ``b = [u * scale < min(|x|, clip)]``: for uniform ``u``,
    ``E[scale * t] == sign(x) * min(|x|, clip)`` wherever that is at most ``scale`` (``x`` itself without a clip).

    Args:
        x: float32 values.
        u: uniforms in ``[0, 1)`` of ``x``'s shape; consumed (scaled in place).
        scale: the scaler of each element (or one, broadcast).
        clip: the clip threshold of each element (or one); ``None``: no clipping.
    """
    a = x.abs()
    if clip is not None:
        a = torch.minimum(a, clip)
    keep = u.mul_(scale) < a
    return torch.where(keep, torch.sign(x), 0.0).to(torch.int8)


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

    def offsets(self) -> Tensor:
        """int64 ``[layers + 1]`` on the host: where each layer starts in the flat tensor, and the total (for the
        compiled kernels)."""
        return self._tensors.get("offsets", torch.device("cpu"), lambda: torch.tensor(self.segments.offsets, dtype=torch.int64))

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


class PackLayout:
    """Where each element's code and each layer's scalers go in the group payload: every layer packed as
    :func:`~lightning_gradcomp.wire.ternary.pack_ternary` packs it (its padded length split into ``per`` contiguous parts,
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

    def starts(self) -> Tensor:
        """int64 ``[layers]`` on the host: where each layer's packed bytes start in the payload (for the compiled
        kernels)."""

        def build() -> Tensor:
            starts = [0]
            for n in self.layer_nbytes[:-1]:
                starts.append(starts[-1] + n)
            return torch.tensor(starts[: len(self.segments)], dtype=torch.int64)

        return self._tensors.get("starts", torch.device("cpu"), build)

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
    #: the Triton kernels' tables, per (bucket_size, packing, scaler_share, device)
    tables: dict[tuple[Optional[int], str, str, torch.device], triton_terngrad.GroupTables] = field(default_factory=dict)


class FlatTernGrad:
    """TernGrad's batched path: a whole group of layers per call, in a fixed number of ops.

    Args:
        settings: the compressor's settings, read at each call.
        sigma_noise: a chunk whose sigma is at most this times its max |g| counts as constant (not clipped).
        streams: the counter-based random streams (shared with the fused backend, checkpointed by the compressor).
        kernels: the compressor's kernel provider for a device (chosen once: see
            :class:`~lightning_gradcomp.compressors.backends.KernelBacked`).
    """

    def __init__(
        self, settings: TernGradSettings, sigma_noise: float, streams: CounterStreams,
        kernels: Callable[[torch.device], TernGradKernels],
    ) -> None:
        self.settings = settings
        self.sigma_noise = sigma_noise
        self.streams = streams
        self.kernels = kernels
        self._layouts: "weakref.WeakKeyDictionary[Segments, _Layouts]" = weakref.WeakKeyDictionary()
        #: the statistics :meth:`statistic` computed, for :meth:`compress` of the same tensor
        self._pending: "weakref.WeakKeyDictionary[Segments, tuple[Tensor, int, Tensor, Optional[Tensor]]]" = (
            weakref.WeakKeyDictionary()
        )

    def forget(self) -> None:
        """Drop the statistics kept between :meth:`statistic` and :meth:`compress` (the state was replaced)."""
        self._pending = weakref.WeakKeyDictionary()

    def tables(self, segments: Segments, device: torch.device) -> triton_terngrad.GroupTables:
        """The Triton kernels' tables of this group under the current settings, on ``device`` (built once)."""
        s = self.settings
        layouts = self._of(segments)
        key = (s.bucket_size, s.packing, s.scaler_share, device)
        tables = layouts.tables.get(key)
        if tables is None:
            pack = self.pack_layout(segments)
            starts = tuple(itertools.accumulate(pack.layer_nbytes, initial=0))[:-1]
            tables = layouts.tables[key] = triton_terngrad.GroupTables(
                segments.numels, self.chunk_layout(segments).counts, pack.packed, starts, device
            )
        return tables

    def __getstate__(self) -> dict[str, Any]:
        # the caches are keyed weakly by layouts of this process: a pickled or deep-copied compressor (a spawned
        # rank, TowerStrategy's workers) starts without them, as a new one would
        return {k: v for k, v in self.__dict__.items() if k not in ("_layouts", "_pending")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._layouts = weakref.WeakKeyDictionary()
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

    def bucket(self) -> int:
        """The kernels' chunk length: 0 for one chunk per layer."""
        return self.settings.bucket_size or 0

    # -- statistics -------------------------------------------------------------------------------------
    def scale_clip(self, flat: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's scaler per chunk and the clip threshold per chunk (``None``: no clipping), as
        the per-layer ``terngrad_scale_clip`` kernel gives them layer by layer (``tests/oracles/terngrad_kernels.py``)."""
        x = flat.detach().reshape(-1).to(torch.float32)
        return self.kernels(x.device).scale_clip(x, segments)

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
    def keys(self, segments: Segments) -> Tensor:
        """int64 ``[layers, 2]`` (host): the stream keys (k0, k1) of each layer's next draw, for the compiled kernel
        (the torch path draws through :meth:`CounterStreams.uniform_flat`, the same keys); an empty layer draws
        nothing (its counter stays, as layer by layer)."""
        return torch.tensor(self.streams.keys(segments), dtype=torch.int64).reshape(-1, 2)

    def keys_on(self, segments: Segments, device: torch.device) -> Tensor:
        """:meth:`keys` on ``device``."""
        keys = self.keys(segments)
        if device.type == "cuda":  # from pinned memory, without waiting: a pageable copy would drain the stream
            keys = keys.pin_memory().to(device, non_blocking=True)
        return keys.to(device)

    def ternarize(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> Tensor:
        """int8 ``[total]`` ternaries: t = sign(g) b, b ~ Bernoulli(min(|g|, clip) / s), the fused backend's draws."""
        chunks = self.chunk_layout(segments)
        x = flat.detach().reshape(-1).to(torch.float32)
        u = self.streams.uniform_flat(segments, x.device)
        return ternary_from_uniforms(x, u, chunks.chunks.expand(scale),
                                     None if clip is None else chunks.chunks.expand(clip))

    def encode(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> Tensor:
        """int8 ``[total]`` ternaries of the group given its scalers and clip thresholds (the stream's next draws)."""
        return self.kernels(flat.device).encode(flat, segments, scale, clip)[0]

    def compress(
        self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic], aggregation: Aggregation
    ) -> FlatPacket:
        """The group's packet travelling as ``aggregation`` (int8 ternaries to sum, or packed payloads to gather)."""
        chunks = self.chunk_layout(segments)
        local, clip = self._take(flat, segments)
        s = local
        if shared is not None and self.settings.scaler_share == "max":
            s = shared.values.to(local.device, torch.float32)
        ops = self.kernels(flat.device)
        gather = aggregation is Aggregation.GATHER
        encode = ops.encode_payload if gather else ops.encode
        values, nonzero = encode(flat, segments, s, clip)
        # the fused backend's 1 - nonzero / n; an empty layer sends nothing: 0, as the torch path says
        sparsity = torch.where(chunks.nonempty(flat.device), 1.0 - nonzero.to(torch.float32) / chunks.numels(flat.device), 0.0)
        stats = {"sparsity": sparsity, "scaler": chunks.by_layer.reduce(s, "amax")}
        ctx: dict[str, Any] = {"scale": s}
        if not gather:
            return FlatPacket(values, segments, flat.dtype, segments.numels, ctx, stats)
        layout = self.pack_layout(segments)
        if layout.with_scalers:
            values.scatter_(0, layout.payload_index(values.device)[1], s.contiguous().view(torch.uint8))
            ctx = {}
        return FlatPacket(values, segments, flat.dtype, layout.layer_nbytes, ctx, stats)

    @staticmethod
    def pack(ternary: Tensor, layout: PackLayout) -> Tensor:
        """uint8 ``[bytes]``: every layer's ternaries packed as :func:`~lightning_gradcomp.wire.ternary.pack_ternary` packs them."""
        codes = torch.cat((ternary + ZERO_CODE, ternary.new_full((1,), ZERO_CODE))).view(torch.uint8)
        parts = codes.index_select(0, layout.gather(codes.device)).view(layout.per, layout.bytes)
        # place values times codes (<= 2) sum below 256: exact in uint8
        return parts.mul_(layout.weights(codes.device)).sum(0, dtype=torch.uint8)

    @staticmethod
    def place(packed: Tensor, layout: PackLayout) -> Tensor:
        """The payload of ``packed`` bytes: themselves, or, with per-worker scalers, each layer's bytes at their
        place and its scalers' bytes still to be written."""
        if not layout.with_scalers:
            return packed
        return packed.new_empty(sum(layout.layer_nbytes)).scatter_(0, layout.payload_index(packed.device)[0], packed)

    # -- decompress -------------------------------------------------------------------------------------
    def codes(self, packed: Tensor, layout: PackLayout) -> Tensor:
        """uint8 ``[..., per, bytes]``: each byte's codes, part by part."""
        return torch.div(packed.unsqueeze(-2), layout.weights(packed.device), rounding_mode="floor").remainder_(layout.radix)

    def _scale_of(self, packet: FlatPacket, layout: PackLayout) -> Tensor:
        """The packet's scalers: the shared ones in its context, or those its sender put in the payload."""
        if "scale" in packet.ctx:
            return packet.ctx["scale"]
        return packet.payload.index_select(0, layout.payload_index(packet.payload.device)[1]).view(torch.float32)

    def scaled(self, values: Tensor, scale: Tensor, segments: Segments, out: Optional[Tensor] = None) -> Tensor:
        """float32 ``values * scale`` (the scaler of each element's chunk), into ``out`` when given (float32)."""
        per_element = self.chunk_layout(segments).chunks.expand(scale.to(values.device, torch.float32))
        return torch.mul(values.to(torch.float32), per_element, out=out)

    def values(self, packet: FlatPacket) -> Tensor:
        """The integer values of one packet: ternaries, or their sum over ranks in the int8 form."""
        if packet.payload.dtype == torch.int8:
            return packet.payload
        layout = self.pack_layout(packet.segments)
        packed = packet.payload
        if layout.with_scalers:
            packed = packed.index_select(0, layout.payload_index(packed.device)[0])
        codes = self.codes(packed, layout).view(-1).index_select(0, layout.scatter(packed.device))
        return codes.view(torch.int8) - ZERO_CODE

    def decompress(self, packet: FlatPacket) -> Tensor:
        """The flat ``[total]`` decoded packet, of ``packet.dtype``."""
        ops = self.kernels(packet.payload.device)
        if packet.payload.dtype == torch.int8:  # the all-reduce form: ternaries, or their sum over ranks
            return ops.scale_int8(packet).to(packet.dtype)
        return ops.decode(packet, self._scale_of(packet, self.pack_layout(packet.segments))).to(packet.dtype)

    def decompress_sum(self, packets: Sequence[FlatPacket]) -> Tensor:
        """The ranks' sum, flat ``[total]`` of the packets' dtype, rounded as :meth:`decompress_mean_into` rounds it
        before dividing: with one shared scaler the exact integer sum scaled once, else the decoded packets added in
        rank order."""
        first = packets[0]
        if "scale" not in first.ctx:
            total = self.decompress(first)
            for packet in packets[1:]:
                total.add_(self.decompress(packet))
            return total
        values = self.values(first).to(torch.int32)
        for packet in packets[1:]:
            values = values + self.values(packet)
        return self.scaled(values, first.ctx["scale"], first.segments).to(first.dtype)

    def decompress_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean into ``out``: :meth:`decompress_sum` divided by the number of ranks, bit for bit."""
        return self.kernels(packets[0].payload.device).mean_into(packets, out)


__all__ = ["ZERO_CODE", "ChunkLayout", "FlatTernGrad", "PackLayout", "TernGradKernels", "TernGradSettings", "chunk_counts",
           "ternary_from_uniforms"]
