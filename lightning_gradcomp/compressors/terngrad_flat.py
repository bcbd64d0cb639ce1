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

On the CPU the fused backend runs a group with one call of each compiled kernel (``terngrad_scale_clip_flat``,
``terngrad_ternarize_flat``, ``terngrad_decode_sum_flat``, ``terngrad_scale_int8_flat``: the per-layer kernels' tile
code looping over the group's layers inside), the same bits as those kernels layer by layer. On CUDA with Triton
installed, Triton kernels (:mod:`lightning_gradcomp.kernels.triton_terngrad`: ternarize and pack, decode-and-average,
decode of the int8 form; the same bits as the torch ops); elsewhere (``backend="torch"``, CUDA without Triton, no
compiler) torch ops, the same bits again.

Chunks: each layer is cut into chunks of ``bucket_size`` elements (the last one shorter), one scaler each; with
``bucket_size=None`` one chunk per layer; an empty layer has no chunk (no scaler, no byte on the wire). The
chunks of a group are themselves :class:`~lightning_gradcomp.flat.Segments`, so per-chunk reductions are one
``scatter_reduce`` each.
"""

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Aggregation, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.kernels import triton_terngrad
from lightning_gradcomp.wire.ternary import Packing

_PER_BYTE = {"2bit": 4, "base3": 5}
_RADIX = {"2bit": 4, "base3": 3}
_ZERO_CODE = 1  # a ternary t is sent as the code t + 1; padding is a zero


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

    def uses_triton(self, tensor: Tensor) -> bool: ...


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


#: which compiled kernels run a group: the extension module, or ``None`` for torch ops
Native = Callable[[Tensor], Optional[ModuleType]]


class FlatTernGrad:
    """TernGrad's batched path: a whole group of layers per call, in a fixed number of ops.

    Args:
        settings: the compressor's settings, read at each call.
        sigma_noise: a chunk whose sigma is at most this times its max |g| counts as constant (not clipped).
        streams: the counter-based random streams (shared with the fused backend, checkpointed by the compressor).
        native: the compiled CPU kernels to run a group with (one call per group, looping over its layers inside),
            or ``None`` for torch ops; asked at each call with the group's tensor.

    Whether Triton's kernels run is the compressor's choice (``settings.uses_triton``, made once per device).
    """

    def __init__(self, settings: TernGradSettings, sigma_noise: float, streams: CounterStreams, native: Native) -> None:
        self.settings = settings
        self.sigma_noise = sigma_noise
        self.streams = streams
        self.native = native
        self._layouts: "weakref.WeakKeyDictionary[Segments, _Layouts]" = weakref.WeakKeyDictionary()
        #: the statistics :meth:`statistic` computed, for :meth:`compress` of the same tensor
        self._pending: "weakref.WeakKeyDictionary[Segments, tuple[Tensor, int, Tensor, Optional[Tensor]]]" = (
            weakref.WeakKeyDictionary()
        )

    def forget(self) -> None:
        """Drop the statistics kept between :meth:`statistic` and :meth:`compress` (the state was replaced)."""
        self._pending = weakref.WeakKeyDictionary()

    def uses_triton(self, tensor: Tensor) -> bool:
        """Whether Triton's kernels run the groups on ``tensor``'s device: the compressor's choice."""
        return self.settings.uses_triton(tensor)

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

    def _bucket(self) -> int:
        """The kernels' chunk length: 0 for one chunk per layer."""
        return self.settings.bucket_size or 0

    # -- statistics -------------------------------------------------------------------------------------
    def scale_clip(self, flat: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's scaler per chunk and the clip threshold per chunk (``None``: no clipping), as
        the per-layer ``terngrad_scale_clip`` kernel gives them layer by layer (``tests/oracles/terngrad_kernels.py``)."""
        chunks = self.chunk_layout(segments)
        x = flat.detach().reshape(-1).to(torch.float32)
        s = self.settings
        ext = self.native(x)
        if ext is not None:
            mode = 0 if s.clip_factor == 0.0 else {"paper": 1, "code": 2}[s.clip_mode]
            offsets = chunks.offsets()
            scale, clip = ext.terngrad_scale_clip_flat(x.contiguous(), offsets, self._bucket(), s.clip_factor, mode, self.sigma_noise)
            return scale, clip if mode == 1 else None
        absmax = chunks.chunks.reduce(x.abs(), "amax")
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
    def _keys(self, segments: Segments) -> Tensor:
        """int64 ``[layers, 2]`` (host): the stream keys (k0, k1) of each layer's next draw, for the compiled kernel
        (the torch path draws through :meth:`CounterStreams.uniform_flat`, the same keys); an empty layer draws
        nothing (its counter stays, as layer by layer)."""
        return torch.tensor(self.streams.keys(segments), dtype=torch.int64).reshape(-1, 2)

    def _keys_on(self, segments: Segments, device: torch.device) -> Tensor:
        """:meth:`_keys` on ``device``."""
        keys = self._keys(segments)
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

    def _encode(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor], packed: bool
    ) -> tuple[Tensor, Tensor]:
        """The ternaries (int8 ``[total]``, or 2-bit packed when ``packed``) and the nonzero count of each layer."""
        if self.uses_triton(flat):
            return self._triton_encode(flat, segments, scale, clip, packed)
        ext = self.native(flat)
        if ext is None:
            ternary = self.ternarize(flat, segments, scale, clip)
            nonzero = segments.reduce((ternary != 0).to(torch.int32), "sum")
            return (self.pack(ternary, self.pack_layout(segments)) if packed else ternary), nonzero
        x = flat.detach().reshape(-1).to(torch.float32).contiguous()
        no_clip = x.new_empty(0)
        return ext.terngrad_ternarize_flat(
            x, self.chunk_layout(segments).offsets(), self._bucket(), scale.contiguous(),
            no_clip if clip is None else clip.contiguous(), self._keys(segments), packed,
        )

    def encode(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> Tensor:
        """int8 ``[total]`` ternaries of the group given its scalers and clip thresholds (the stream's next draws)."""
        return self._encode(flat, segments, scale, clip, packed=False)[0]

    def _triton_encode(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor], packed: bool
    ) -> tuple[Tensor, Tensor]:
        """:meth:`_encode` in Triton kernels; packed (in either packing), the bytes sit where the payload has them
        (a per-worker payload's scaler bytes still to be written)."""
        x = flat.detach().reshape(-1).contiguous()
        tables = self.tables(segments, x.device)
        keys = self._keys_on(segments, x.device)
        scale, clip = scale.contiguous(), None if clip is None else clip.contiguous()
        bucket = self.settings.bucket_size
        if not packed:
            return triton_terngrad.ternarize(x, tables, keys, scale, clip, bucket)
        layout = self.pack_layout(segments)
        payload = torch.empty(sum(layout.layer_nbytes), dtype=torch.uint8, device=x.device)
        nonzero = triton_terngrad.ternarize_pack(x, tables, keys, scale, clip, bucket, layout.per, layout.radix, payload)
        return payload, nonzero

    def compress(
        self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic], aggregation: Aggregation
    ) -> FlatPacket:
        """The group's packet travelling as ``aggregation`` (int8 ternaries to sum, or packed payloads to gather)."""
        chunks = self.chunk_layout(segments)
        local, clip = self._take(flat, segments)
        s = local
        if shared is not None and self.settings.scaler_share == "max":
            s = shared.values.to(local.device, torch.float32)
        gather = aggregation is Aggregation.GATHER
        in_place = gather and self.uses_triton(flat)  # the payload's packed bytes, in place
        values, nonzero = self._encode(flat, segments, s, clip, packed=in_place or gather and self.settings.packing == "2bit")
        # the fused backend's 1 - nonzero / n; an empty layer sends nothing: 0, as the torch path says
        sparsity = torch.where(chunks.nonempty(flat.device), 1.0 - nonzero.to(torch.float32) / chunks.numels(flat.device), 0.0)
        stats = {"sparsity": sparsity, "scaler": chunks.by_layer.reduce(s, "amax")}
        ctx: dict[str, Any] = {"scale": s}
        if not gather:
            return FlatPacket(values, segments, flat.dtype, segments.numels, ctx, stats)
        layout = self.pack_layout(segments)
        packed = values if values.dtype == torch.uint8 else self.pack(values, layout)
        if layout.with_scalers:
            packed_at, scalers_at = layout.payload_index(packed.device)
            payload = packed
            if not in_place:
                payload = packed.new_empty(sum(layout.layer_nbytes)).scatter_(0, packed_at, packed)
            payload.scatter_(0, scalers_at, s.contiguous().view(torch.uint8))
            packed, ctx = payload, {}
        return FlatPacket(packed, segments, flat.dtype, layout.layer_nbytes, ctx, stats)

    @staticmethod
    def pack(ternary: Tensor, layout: PackLayout) -> Tensor:
        """uint8 ``[bytes]``: every layer's ternaries packed as :func:`~lightning_gradcomp.wire.ternary.pack_ternary` packs them."""
        codes = torch.cat((ternary + _ZERO_CODE, ternary.new_full((1,), _ZERO_CODE))).view(torch.uint8)
        parts = codes.index_select(0, layout.gather(codes.device)).view(layout.per, layout.bytes)
        # place values times codes (<= 2) sum below 256: exact in uint8
        return parts.mul_(layout.weights(codes.device)).sum(0, dtype=torch.uint8)

    # -- decompress -------------------------------------------------------------------------------------
    def _codes(self, packed: Tensor, layout: PackLayout) -> Tensor:
        """uint8 ``[..., per, bytes]``: each byte's codes, part by part."""
        return torch.div(packed.unsqueeze(-2), layout.weights(packed.device), rounding_mode="floor").remainder_(layout.radix)

    def _scale_of(self, packet: FlatPacket, layout: PackLayout) -> Tensor:
        """The packet's scalers: the shared ones in its context, or those its sender put in the payload."""
        if "scale" in packet.ctx:
            return packet.ctx["scale"]
        return packet.payload.index_select(0, layout.payload_index(packet.payload.device)[1]).view(torch.float32)

    def _scaled(self, values: Tensor, scale: Tensor, segments: Segments, out: Optional[Tensor] = None) -> Tensor:
        """float32 ``values * scale`` (the scaler of each element's chunk), into ``out`` when given (float32)."""
        per_element = self.chunk_layout(segments).chunks.expand(scale.to(values.device, torch.float32))
        return torch.mul(values.to(torch.float32), per_element, out=out)

    def _native_decode(self, packets: Sequence[FlatPacket]) -> Optional[ModuleType]:
        """The compiled kernels when they decode these packets (2-bit packed payloads on the CPU)."""
        first = packets[0]
        if first.payload.dtype != torch.uint8 or self.settings.packing != "2bit":
            return None
        return self.native(first.payload)

    def _decode_sum_native(
        self, ext: ModuleType, packets: Sequence[FlatPacket], scale: Tensor, out: Optional[Tensor], divisor: int
    ) -> Tensor:
        """float32 flat: the integer sum of the packets' ternaries, scaled once, divided by ``divisor`` (one call)."""
        first = packets[0]
        layout = self.pack_layout(first.segments)
        return ext.terngrad_decode_sum_flat(
            [p.payload.contiguous() for p in packets], self.chunk_layout(first.segments).offsets(), layout.starts(),
            self._bucket(), scale.to(torch.float32).contiguous(), first.payload.new_empty(0, dtype=torch.float32) if out is None else out,
            divisor,
        )

    def values(self, packet: FlatPacket) -> Tensor:
        """The integer values of one packet: ternaries, or their sum over ranks in the int8 form."""
        if packet.payload.dtype == torch.int8:
            return packet.payload
        layout = self.pack_layout(packet.segments)
        packed = packet.payload
        if layout.with_scalers:
            packed = packed.index_select(0, layout.payload_index(packed.device)[0])
        codes = self._codes(packed, layout).view(-1).index_select(0, layout.scatter(packed.device))
        return codes.view(torch.int8) - _ZERO_CODE

    def decompress(self, packet: FlatPacket) -> Tensor:
        """The flat ``[total]`` decoded packet, of ``packet.dtype``."""
        segments = packet.segments
        if packet.payload.dtype == torch.int8:  # the all-reduce form: ternaries, or their sum over ranks
            scale = packet.ctx["scale"]
            if self.uses_triton(packet.payload):
                values = packet.payload.reshape(-1).contiguous()
                tables = self.tables(segments, values.device)
                scale = scale.to(values.device, torch.float32).contiguous()
                return triton_terngrad.scale_int8(values, tables, scale, self.settings.bucket_size).to(packet.dtype)
            ext = self.native(packet.payload)
            if ext is not None:
                decoded = ext.terngrad_scale_int8_flat(
                    packet.payload.contiguous(), self.chunk_layout(segments).offsets(), self._bucket(),
                    scale.to(torch.float32).contiguous(), packet.payload.new_empty(0, dtype=torch.float32),
                )
                return decoded.to(packet.dtype)
            return self._scaled(packet.payload, scale, segments).to(packet.dtype)
        scale = self._scale_of(packet, self.pack_layout(segments))
        if self.uses_triton(packet.payload):
            return self._triton_decode(packet, packet.payload.contiguous(), 0, 1, scale, None).to(packet.dtype)
        ext = self._native_decode([packet])
        if ext is not None:
            return self._decode_sum_native(ext, [packet], scale, None, 1).to(packet.dtype)
        return self._scaled(self.values(packet), scale, segments).to(packet.dtype)

    def _triton_decode(
        self, first: FlatPacket, base: Tensor, stride: int, ranks: int, scale: Tensor, out: Optional[Tensor]
    ) -> Tensor:
        """float32 ``[total]``: ``ranks`` packed payloads (from ``base``, ``stride`` bytes apart; laid out as
        ``first``'s) decoded in one Triton launch, summed (shared ``scale`` ``[chunks]``: the integer sum scaled
        once; per-worker ``[ranks, chunks]``: in rank order), divided by ``ranks`` into ``out`` (float32, contiguous)
        when given, else not divided."""
        layout = self.pack_layout(first.segments)
        target = torch.empty(first.segments.total, dtype=torch.float32, device=base.device) if out is None else out
        return triton_terngrad.decode(
            base, stride, ranks, self.tables(first.segments, base.device),
            scale.to(base.device, torch.float32).contiguous(), "scale" in first.ctx, self.settings.bucket_size,
            layout.per, layout.radix, target, out is not None,
        )

    def _triton_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """:meth:`decompress_mean_into` in one Triton launch, the same ops after it as the torch path has."""
        first, ranks = packets[0], len(packets)
        writable = out.dtype == torch.float32 and out.is_contiguous()
        shared = "scale" in first.ctx
        base, stride = _rank_rows([p.payload for p in packets])
        if shared:
            scale = first.ctx["scale"]
        else:  # every rank's scalers from its payload: [ranks, chunks]
            layout = self.pack_layout(first.segments)
            rows = base.as_strided((ranks, sum(layout.layer_nbytes)), (stride, 1))
            scale = rows.index_select(1, layout.payload_index(base.device)[1]).view(torch.float32)
        if writable:
            self._triton_decode(first, base, stride, ranks, scale, out.view(-1))
            return out
        total = self._triton_decode(first, base, stride, ranks, scale, None)
        # as the torch path: a shared scaler's scaled sum in the packet's dtype; per worker, the float32 sum
        return out.copy_(total.to(first.dtype) if shared else total).div_(ranks)

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
        return self._scaled(values, first.ctx["scale"], first.segments).to(first.dtype)

    def decompress_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean into ``out``: :meth:`decompress_sum` divided by the number of ranks, bit for bit."""
        first, ranks = packets[0], len(packets)
        if self.uses_triton(first.payload) and ("scale" in first.ctx or first.dtype == torch.float32):
            # (per-worker scalers of another dtype round each rank's decoded tensor: the torch path below)
            return self._triton_mean_into(packets, out)
        if "scale" not in first.ctx:  # per-worker scalers: decode each rank, sum the decoded in rank order
            total = self.decompress(first)
            for packet in packets[1:]:
                total.add_(self.decompress(packet))
            return out.copy_(total).div_(ranks)
        # one shared scaler: the exact integer sum over ranks, scaled once
        scale = first.ctx["scale"]
        writable = out.dtype == torch.float32 and out.is_contiguous()
        ext = self._native_decode(packets)
        if ext is not None:  # divides in the pass that writes, as the fused backend does layer by layer
            if writable:
                self._decode_sum_native(ext, packets, scale, out.view(-1), ranks)
                return out
            return out.copy_(self._decode_sum_native(ext, packets, scale, None, ranks))
        layout = self.pack_layout(first.segments)
        payloads = torch.stack([p.payload for p in packets])
        sums = self._codes(payloads, layout).sum(0, dtype=torch.int32).view(-1)
        values = sums.index_select(0, layout.scatter(sums.device)).sub_(ranks * _ZERO_CODE)
        if writable:
            self._scaled(values, scale, first.segments, out=out.view(-1))
        else:
            out.copy_(self._scaled(values, scale, first.segments).to(first.dtype))
        return out.div_(ranks)


def _rank_rows(payloads: Sequence[Tensor]) -> tuple[Tensor, int]:
    """The ranks' uint8 payloads as (rank 0's, stride in bytes to the next rank's): the gathered buffer's rows as
    they are when evenly spaced in one storage (the hook's all-gather), else stacked (one copy)."""
    first = payloads[0]
    if len(payloads) == 1:
        return first.contiguous(), 0
    step = payloads[1].data_ptr() - first.data_ptr()
    rows = all(
        p.is_contiguous() and p.numel() == first.numel()
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.data_ptr() - first.data_ptr() == r * step
        for r, p in enumerate(payloads)
    )
    if rows and step >= first.numel():
        return first, step
    return torch.stack([p.reshape(-1) for p in payloads]), first.numel()


__all__ = ["ChunkLayout", "FlatTernGrad", "PackLayout", "TernGradSettings", "chunk_counts", "ternary_from_uniforms"]
