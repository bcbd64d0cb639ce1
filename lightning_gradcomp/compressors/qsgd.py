"""QSGD (Alistarh et al., NIPS 2017): stochastic, unbiased quantization to ``s`` levels per bucket.

For each bucket v of ``bucket_size`` consecutive elements: with r_i = s * |v_i| / ||v||_2, the level is
``floor(r_i)`` plus a Bernoulli(r_i - floor(r_i)) draw, and the decoded value is
``||v||_2 * sign(v_i) * level_i / s``; so E[decoded] = v exactly (unbiased), no error feedback needed.

On the wire (exact), fixed-width levels: per element one sign bit and ``ceil(log2(s + 1))`` level bits,
packed end to end, plus one float32 norm per bucket. (The paper's Elias coding of the sparse levels is
denser at small s; fixed width keeps every packet the same size, so no size exchange is needed.)

Written once, for a group of layers (a single tensor is a group of one), in a fixed number of ops: each layer padded
to whole buckets, one norm per bucket row, per-element scalers by bucket index; its payload is the layers' payloads
back to back. The draws come from counter-based streams, one per parameter name (:class:`CounterStreams`), so a group
draws exactly what its layers draw one by one (``tests/oracles/dense.py`` holds the per-layer reference).
"""

import math
from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.wire.bits import packed_bits_nbytes
from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.grouped import PackedPayload, derived
from lightning_gradcomp.compressors.streams import CounterStreams, load_counters
from lightning_gradcomp.validation import check_int


class QSGD(Compressor):
    """Stochastic quantization to ``levels`` levels of each bucket's L2 norm.

    Args:
        levels: s, the number of non-zero levels (s = 7 gives 3 level bits + 1 sign bit = 4 bits/element).
        bucket_size: elements per norm (the paper uses 512); the last bucket of a tensor may be shorter.
        seed: seed of the random stream; rank r draws from seed and r, so ranks differ and runs repeat.
    """

    aggregation = Aggregation.GATHER
    batched = True

    def __init__(self, levels: int = 7, bucket_size: int = 512, seed: int = 0) -> None:
        super().__init__()
        check_int("bucket_size", bucket_size, minimum=1, fix="use 512 (the paper)")
        check_int("seed", seed, minimum=0)
        self.levels = levels
        self.bucket_size = bucket_size
        self.seed = seed
        self._streams = CounterStreams(seed)

    @property
    def levels(self) -> int:
        """s, the number of non-zero levels; settable between steps (identically on every rank)."""
        return self._levels

    @levels.setter
    def levels(self, value: int) -> None:
        check_int("levels", value, minimum=1, fix="use 7 (4 bits per element) or 1 (2 bits per element)")
        if value > 2**15 - 1:
            raise ValueError(f"Expected `levels` to be at most {2**15 - 1}, but got {value}. Fix: use 'fp16' instead.")
        self._levels = value
        #: bits per element on the wire: one sign bit and the level
        self.width = 1 + math.ceil(math.log2(value + 1))

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._streams.reset(rank)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_counters(self._streams, state.get("streams", {}), type(self).__name__)

    def payload_nbytes(self, numel: int) -> int:
        """Exact bytes of one packet: packed sign+level codes and one float32 norm per bucket."""
        return packed_bits_nbytes(numel, self.width) + 4 * -(-numel // self.bucket_size)

    def _inverse(self, norms: Tensor) -> Tensor:
        """s / ||v|| per bucket (s for an all-zero bucket, whose levels are all 0)."""
        return self.levels / torch.where(norms > 0, norms, 1.0)

    def _round(self, scaled: Tensor, rnd: Tensor) -> Tensor:
        """int32 levels: ``scaled`` rounded up with probability its fraction."""
        lower = scaled.floor()
        return (lower + (rnd < scaled - lower).float()).clamp_(max=self.levels).to(torch.int32)  # guard at r == s

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        layout = self._layout(segments)
        x = flat.detach().float()
        buckets = segments.padding(self.bucket_size).pad(x).view(-1, self.bucket_size)  # zeros change no norm
        norms = torch.linalg.vector_norm(buckets, dim=1, dtype=torch.float64).float()
        scaled = x.abs() * self._inverse(norms).index_select(0, layout.bucket_of(x.device))
        level = self._round(scaled, self._streams.uniform_flat(segments, x.device))
        payload = layout.payload(self.width).join(level * 2 + (x < 0).to(torch.int32), norms)
        zeros = segments.reduce((level == 0).float(), "sum")
        stats = {"sparsity": zeros / layout.numels(x.device), "norm": layout.buckets.reduce(norms, "amax")}
        return FlatPacket(payload, segments, flat.dtype, layout.payload(self.width).layer_nbytes, stats=stats)

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        layout = self._layout(packet.segments)
        codes, norms = layout.payload(self.width).split(packet.payload)
        step = (norms / self.levels).index_select(0, layout.bucket_of(codes.device))
        magnitude = (codes >> 1).float() * step
        return torch.where((codes & 1).bool(), -magnitude, magnitude).to(packet.dtype)

    def _layout(self, segments: Segments) -> "_Buckets":
        return derived(segments, ("qsgd", self.bucket_size), lambda: _Buckets(segments, self.bucket_size))

    def describe(self) -> dict[str, Any]:
        return {"compressor": "QSGD", "levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}


class _Buckets:
    """A group of layers cut into QSGD buckets: each layer padded to whole buckets of ``size`` elements.

    Holds no reference to the group's :class:`Segments` (it is cached weakly by them: :func:`derived`).
    """

    def __init__(self, segments: Segments, size: int) -> None:
        padding = segments.padding(size)
        #: the buckets, layer by layer: a layer of ``n`` elements has ``ceil(n / size)``
        self.buckets = Segments(segments.names, [torch.Size([n // size]) for n in padding.numels])
        self._bucket_of = padding.index(torch.device("cpu")) // size
        self._numels = torch.tensor(segments.numels, dtype=torch.float32).clamp_min(1)
        self._layers = Segments(segments.names, segments.shapes)  # for the payload layouts, built per width
        self._payloads: dict[int, PackedPayload] = {}
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _tensors(self, device: torch.device) -> tuple[Tensor, Tensor]:
        cached = self._on.get(device)
        if cached is None:
            cached = self._on[device] = (self._bucket_of.to(device), self._numels.to(device))
        return cached

    def bucket_of(self, device: torch.device) -> Tensor:
        """int64 ``[total]``: the bucket of every element of the group."""
        return self._tensors(device)[0]

    def numels(self, device: torch.device) -> Tensor:
        """float32 ``[layers]``: each layer's element count (1 for an empty layer, whose statistics are 0)."""
        return self._tensors(device)[1]

    def payload(self, width: int) -> PackedPayload:
        """The group's payload at ``width`` bits per code (the width follows ``levels``, settable between steps)."""
        layout = self._payloads.get(width)
        if layout is None:
            layout = self._payloads[width] = PackedPayload(self._layers, width, self.buckets.numels)
        return layout
