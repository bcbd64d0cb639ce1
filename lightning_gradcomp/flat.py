"""The flat layout and the packets of the compressed exchange: the library's bottom module.

A DDP bucket holds its parameters' gradients back to back in one 1-D buffer. A batched compressor treats the
layers of a group as *segments* of such a flat tensor (:class:`Segments`): per-layer scalers become one segmented
reduction (:meth:`Segments.reduce`), per-element use of them one ``index_select``, per-layer padding (to a packing
word or a bin) one ``scatter_``. The number of dispatched ops (kernel launches on a GPU) is then fixed per group,
whatever the number of layers. Index tensors are built once per layout and device and kept here; a layout is made
once per group of names (see :class:`SegmentsCache`). A compressor encodes one tensor into a :class:`Packet` and a
group into a :class:`FlatPacket`.

Compressors, kernels, the wire formats and the exchange all speak these types, so this module imports nothing of
``lightning_gradcomp`` (torch and the standard library only): every folder of the package can import it without an
import cycle (``tests/unit/test_import_graph.py``).

Writes to 1-D positions use ``scatter_``/``scatter_add_``, not ``index_copy_``/``index_add_``: the same values for
distinct positions, but on CPU torch's ``index_copy_`` is 1.7-3.6x slower than ``scatter_`` on a bucket of millions
(``python benchmarks/scatter_ops.py``, ``docs/benchmarks.md`` section 7).
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

import torch
from torch import Tensor


#: a float reduction splits a segment longer than this into chunks of this many elements, reduces the chunks, then
#: each segment's chunk results: CUDA's ``segment_reduce`` gives each segment one thread block, so a 38.6M-element
#: embedding reduced as one segment runs on one of the device's SMs
SPLIT = 1 << 16


def _split_lengths(numels: Sequence[int], split: int) -> tuple[list[int], list[int]]:
    """(every chunk's length, chunks per segment) of segments of ``numels`` cut into chunks of ``split`` elements (an
    empty segment: one empty chunk, so each segment keeps a result)."""
    chunks: list[int] = []
    per_segment: list[int] = []
    for n in numels:
        full, rest = divmod(n, split)
        parts = [split] * full + ([rest] if rest or not n else [])
        chunks += parts
        per_segment.append(len(parts))
    return chunks, per_segment


@dataclass(frozen=True)
class Padding:
    """The segments laid out with each one padded to a multiple of ``multiple`` elements.

    Attributes:
        multiple: each padded segment's length is a multiple of this.
        numels: padded length of each segment.
        offsets: start of each padded segment, and the padded total last.
    """

    multiple: int
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    _index: dict[torch.device, Tensor] = field(default_factory=dict, repr=False, compare=False)
    _source: "Segments | None" = field(default=None, repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def index(self, device: torch.device) -> Tensor:
        """int64 ``[segments.total]``: the padded position of every element of the flat tensor."""
        cached = self._index.get(device)
        if cached is None:
            assert self._source is not None
            seg = self._source
            shift = [p - o for p, o in zip(self.offsets[:-1], seg.offsets[:-1])]
            per_element = torch.tensor(shift, dtype=torch.int64).repeat_interleave(torch.tensor(seg.numels))
            cached = (torch.arange(seg.total, dtype=torch.int64) + per_element).to(device)
            self._index[device] = cached
        return cached

    def pad(self, flat: Tensor, fill: float = 0.0) -> Tensor:
        """``flat`` with each segment padded by ``fill`` to its padded length (a new tensor)."""
        out = flat.new_full((self.total,), fill)
        return out.scatter_(0, self.index(flat.device), flat)

    def unpad(self, padded: Tensor) -> Tensor:
        """The flat tensor back from its padded layout (the padding dropped)."""
        return padded.index_select(0, self.index(padded.device))


class Segments:
    """Consecutive layers (name, shape) laid out back to back in one flat tensor.

    Args:
        names: the layers' parameter names, in flat order.
        shapes: their shapes.
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size]) -> None:
        if len(names) != len(shapes):
            raise ValueError(f"Expected one shape per name but got {len(names)} names and {len(shapes)} shapes. "
                             "Fix: pass the shapes of the named layers.")
        self.names: tuple[str, ...] = tuple(names)
        self.shapes: tuple[torch.Size, ...] = tuple(torch.Size(s) for s in shapes)
        self.numels: tuple[int, ...] = tuple(s.numel() for s in self.shapes)
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        self.offsets: tuple[int, ...] = tuple(offsets)
        #: name -> position in the layout
        self.position: dict[str, int] = {name: i for i, name in enumerate(self.names)}
        self._ids: dict[torch.device, Tensor] = {}
        self._lengths: dict[torch.device, Tensor] = {}
        self._bounds: dict[torch.device, Tensor] = {}
        self._paddings: dict[int, Padding] = {}
        self._firsts: dict[tuple[object, ...], Tensor] = {}
        self._split: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"Segments({len(self)} layers, {self.total} elements)"

    @property
    def total(self) -> int:
        """Elements in all segments."""
        return self.offsets[-1]

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each segment of ``flat`` as a view of its layer's shape (one op per layer: for fallbacks and logging)."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def items(self, flat: Tensor) -> Iterator[tuple[str, Tensor]]:
        """(name, view) of every segment of ``flat``."""
        return zip(self.names, self.views(flat))

    def ids(self, device: torch.device) -> Tensor:
        """int64 ``[total]``: the segment index of every element."""
        cached = self._ids.get(device)
        if cached is None:
            cached = torch.arange(len(self)).repeat_interleave(torch.tensor(self.numels, dtype=torch.int64)).to(device)
            self._ids[device] = cached
        return cached

    def lengths(self, device: torch.device) -> Tensor:
        """int64 ``[len]``: every segment's length."""
        cached = self._lengths.get(device)
        if cached is None:
            cached = self._lengths[device] = torch.tensor(self.numels, dtype=torch.int64, device=device)
        return cached

    def split(self, device: torch.device) -> "tuple[Tensor, Tensor] | None":
        """int64 (every chunk's length, chunks per segment) of :meth:`reduce`'s two stages, or ``None`` where every
        segment fits in one chunk of :data:`SPLIT` elements (one stage)."""
        if max(self.numels, default=0) <= SPLIT:
            return None
        cached = self._split.get(device)
        if cached is None:
            chunks, per_segment = _split_lengths(self.numels, SPLIT)
            cached = self._split[device] = (torch.tensor(chunks, dtype=torch.int64, device=device),
                                            torch.tensor(per_segment, dtype=torch.int64, device=device))
        return cached

    def bounds(self, device: torch.device) -> Tensor:
        """int64 ``[len + 1]``: every segment's first position, then the total (:attr:`offsets`)."""
        cached = self._bounds.get(device)
        if cached is None:
            cached = self._bounds[device] = torch.tensor(self.offsets, dtype=torch.int64, device=device)
        return cached

    def reduce(self, values: Tensor, how: Literal["amax", "amin", "sum"]) -> Tensor:
        """``[len]``: ``how`` over each segment of ``values`` (``[total]``), in ``values``' dtype; an empty segment
        gives 0. A NaN propagates to its segment's result.

        Floating values go through ``torch.segment_reduce`` (CUB's segmented reduction on CUDA), integer sums through
        an exact int64 prefix sum: ``scatter_reduce`` over segment ids, the obvious op, serialises on CUDA's atomics
        when a few segments receive millions of elements (82 % of a TernGrad step's GPU time on a 12-layer GPT,
        ``benchmarks/gpu_followup.sh``). On the CPU both sum each segment in element order: the same bits.

        A layout with a segment longer than :data:`SPLIT` elements reduces in two stages, chunks of ``SPLIT``
        elements and then each segment's chunks, so a large layer spreads over many of CUDA's thread blocks (two
        ops instead of one, for every device's max and min, whose result no order changes: the same bits). A
        floating sum splits only off the CPU: on the CPU a segment's sum stays in element order (its bits kept);
        on CUDA both orders are fixed trees, the two-stage one's rounding within a few ulps of the one-stage."""
        if values.is_floating_point():
            kind = {"amax": "max", "amin": "min", "sum": "sum"}[how]
            lengths = self.lengths(values.device)
            split = self.split(values.device) if kind != "sum" or values.device.type != "cpu" else None
            if split is None:
                out = torch.segment_reduce(values, kind, lengths=lengths, unsafe=True)
            else:
                chunks = torch.segment_reduce(values, kind, lengths=split[0], unsafe=True)
                out = torch.segment_reduce(chunks, kind, lengths=split[1], unsafe=True)
            if kind != "sum" and 0 in self.numels:  # an empty segment's max is the reduction's identity (-inf)
                out = torch.where(lengths == 0, torch.zeros((), dtype=out.dtype, device=out.device), out)
            return out
        if how == "sum":
            ends = torch.cat([values.new_zeros(1, dtype=torch.int64), values.cumsum(0, dtype=torch.int64)])
            bounds = torch.tensor(self.offsets, dtype=torch.int64, device=values.device)
            return (ends[bounds[1:]] - ends[bounds[:-1]]).to(values.dtype)
        out = values.new_zeros(len(self))
        return out.scatter_reduce_(0, self.ids(values.device), values, how, include_self=False)

    def expand(self, per_segment: Tensor) -> Tensor:
        """``[total]``: each segment's value repeated over its elements."""
        return per_segment.index_select(0, self.ids(per_segment.device))

    def sort(self, values: Tensor, descending: bool = False) -> tuple[Tensor, Tensor]:
        """Each segment of ``values`` sorted on its own, segments kept in place: ``(sorted, index)`` with
        ``sorted == values[index]``.

        Two stable sorts (by value, then by segment id) instead of one per layer: a fixed number of ops. Ties keep
        their flat order, as a stable sort of each layer would.
        """
        order = torch.sort(values, descending=descending, stable=True).indices
        by_segment = torch.sort(self.ids(values.device).index_select(0, order), stable=True).indices
        index = order.index_select(0, by_segment)
        return values.index_select(0, index), index

    def firsts(self, counts: Sequence[int], device: torch.device) -> Tensor:
        """int64: the flat positions of the first ``counts[s]`` elements of every segment ``s``, segment after
        segment (with :meth:`sort`, the positions of each layer's top ``counts[s]``); cached per counts."""
        key = ("firsts", tuple(counts), device)
        cached = self._firsts.get(key)
        if cached is None:
            if any(not 0 <= c <= n for c, n in zip(counts, self.numels)) or len(counts) != len(self):
                raise ValueError(f"Expected one count in [0, numel] per segment but got {list(counts)} for numels "
                                 f"{list(self.numels)}. Fix: clamp each layer's count to its size before asking.")
            starts = torch.tensor(self.offsets[:-1], dtype=torch.int64)
            sizes = torch.tensor(list(counts), dtype=torch.int64)
            within = torch.arange(int(sizes.sum())) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
            cached = (starts.repeat_interleave(sizes) + within).to(device)
            self._firsts[key] = cached
        return cached

    def padding(self, multiple: int) -> Padding:
        """This layout with every segment padded to a multiple of ``multiple`` elements (cached)."""
        cached = self._paddings.get(multiple)
        if cached is None:
            numels = tuple(-(-n // multiple) * multiple for n in self.numels)
            offsets = [0]
            for n in numels:
                offsets.append(offsets[-1] + n)
            cached = Padding(multiple, numels, tuple(offsets), _source=self)
            self._paddings[multiple] = cached
        return cached


class SegmentsCache:
    """One :class:`Segments` per tuple of names, so its index tensors are built once per layout and device."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, ...], Segments] = {}

    def get(self, names: Sequence[str], shapes: Sequence[torch.Size]) -> Segments:
        key = tuple(names)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Segments(key, shapes)
        return layout


@dataclass
class Packet:
    """One compressed tensor.

    Attributes:
        payload: a 1-D tensor, exactly the bytes that cross the wire for this tensor.
        shape: shape of the original tensor (local decode context).
        dtype: dtype of the original tensor (local decode context).
        ctx: any further local decode context, e.g. a scaler every rank already agreed on.
        stats: per-tensor statistics as 0-d tensors on the payload's device (no host sync).
    """

    payload: Tensor
    shape: torch.Size
    dtype: torch.dtype
    ctx: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Exact number of bytes this packet puts on the wire."""
        return self.payload.numel() * self.payload.element_size()

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return self.shape.numel()

    def with_payload(self, payload: Tensor) -> "Packet":
        """A packet with another rank's (or a summed) payload and this rank's local decode context."""
        return replace(self, payload=payload, stats={})


@dataclass
class FlatPacket:
    """The compressed form of a group of layers laid out in one flat tensor (:class:`Segments`).

    A batched compressor makes one from the whole group in a fixed number of ops; the default, built from
    :class:`Packet` s one layer at a time, keeps them in ``layers``.

    Attributes:
        payload: a 1-D tensor, exactly what crosses the wire for the group.
        segments: the group's layout (names, shapes).
        dtype: dtype of the original gradients.
        layer_nbytes: bytes each layer put in ``payload``: Python ints when they depend on shapes only, else an
            int64 device tensor (read on the host only when someone asks: a logging step, a size exchange).
        ctx: further local decode context, e.g. per-layer scalers every rank agreed on.
        stats: per-layer statistics, each a ``[layers]`` tensor on the payload's device.
        layers: the per-layer packets the default (looping) path made, else ``None``.
        self_describing: whether the payload carries its own per-layer layout (a header, as WeightGrad's WAN message
            does): a variable-size gather then sends only the payload's total length ahead of it, and the decoder
            reads the layers' sizes from the payload (a received packet keeps the receiver's ``layer_nbytes``).
    """

    payload: Tensor
    segments: Segments
    dtype: torch.dtype
    layer_nbytes: "tuple[int, ...] | Tensor"
    ctx: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)
    layers: Optional[list[Packet]] = None
    self_describing: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes this packet puts on the wire."""
        return self.payload.numel() * self.payload.element_size()

    def with_payload(self, payload: Tensor, layer_nbytes: "tuple[int, ...] | Tensor | None" = None) -> "FlatPacket":
        """Another rank's (or a summed) payload with this rank's local decode context; ``layer_nbytes``: that
        rank's per-layer sizes when they differ from this rank's (variable-size payloads)."""
        sizes = self.layer_nbytes if layer_nbytes is None else layer_nbytes
        layers = None
        if self.layers is not None:
            assert isinstance(sizes, tuple), "the looping path's per-layer sizes are host integers"
            layers, offset = [], 0
            for packet, n in zip(self.layers, sizes):
                layers.append(packet.with_payload(_slice_payload(payload, offset, n, packet.payload.dtype)))
                offset += n
        return replace(self, payload=payload, layer_nbytes=sizes, stats={}, layers=layers)


def _slice_payload(raw: Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> Tensor:
    """The ``nbytes`` at byte ``offset`` of a group payload, as a 1-D tensor of ``dtype``: a slice when the group
    payload has that dtype, else bytes reinterpreted (copied first: a byte slice may be misaligned for a wider dtype)."""
    if raw.dtype == dtype:
        width = raw.element_size()
        return raw[offset // width : (offset + nbytes) // width]
    part = raw.view(torch.uint8)[offset : offset + nbytes]
    return part if dtype == torch.uint8 else part.clone().view(dtype)


__all__ = ["FlatPacket", "Packet", "Padding", "Segments", "SegmentsCache"]
