"""How the hook cuts a bucket into groups of layers compressed together (the batched pipeline's unit).

A group is the layers of one bucket, within one pipelined chunk, routed to one compressor. Its gradients are taken
from the bucket's flat buffer in one op (a slice when the layers are adjacent, else one ``index_select``) and its
decoded mean written back in one op, so the hook's op count grows with the number of groups (compressors per
bucket, chunks), never with the number of layers. Groups depend only on names, shapes, positions and the route, the
same on every rank, so every rank issues the same collectives; they are made once per layout and kept.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import Segments


class HookBucket(Protocol):
    """What the hook reads of a bucket: DDP's ``dist.GradBucket``, or a stand-in (an outer round's flat
    pseudo-gradients, a local rank's share of a bucket in the hierarchical exchange).

    A stand-in whose parameters do not lie back to back from the start of ``buffer()`` adds ``layer_offsets()``:
    each parameter's first element in ``buffer()``.
    """

    def buffer(self) -> Tensor: ...

    def parameters(self) -> Sequence[Tensor]: ...

    def index(self) -> int: ...

    def is_last(self) -> bool: ...


def layer_offsets(bucket: HookBucket) -> tuple[int, ...]:
    """Each parameter's first element in ``bucket.buffer()`` (DDP's buckets hold them back to back)."""
    own = getattr(bucket, "layer_offsets", None)
    if own is not None:
        return tuple(own())
    offsets, at = [], 0
    for p in bucket.parameters():
        offsets.append(at)
        at += p.numel()
    return tuple(offsets)


def layer_shapes(bucket: HookBucket) -> list[torch.Size]:
    """Each layer's shape in ``bucket.buffer()``: the parameters' own, unless the bucket holds parts of them (a
    sharded model's gradient shards say so through ``layer_shapes()``)."""
    own = getattr(bucket, "layer_shapes", None)
    if own is not None:
        return [torch.Size(s) for s in own()]
    return [p.shape for p in bucket.parameters()]


class LayerViews(Sequence[Tensor]):
    """Each layer's gradient as a view of the bucket's buffer, made only when first asked for (a planner's first
    look, a raise naming the bad layer, a monitor, per-layer transforms): an op per layer the batched pipeline
    otherwise never dispatches."""

    def __init__(self, buffer: Tensor, offsets: Sequence[int], shapes: Sequence[torch.Size]) -> None:
        self._buffer, self._offsets, self._shapes = buffer, offsets, shapes
        self._views: Optional[list[Tensor]] = None

    def _all(self) -> list[Tensor]:
        if self._views is None:
            self._views = [self._buffer[o : o + s.numel()].view(s) for o, s in zip(self._offsets, self._shapes)]
        return self._views

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._shapes)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._all())


@dataclass(eq=False)
class LayerGroup:
    """Layers of one bucket and chunk routed to one compressor, laid out back to back as ``segments``.

    Attributes:
        compressor: the layers' compressor (as routed for this bucket).
        segments: the group's flat layout (names, shapes).
        members: the layers' indices in the bucket.
        chunk: the pipelined chunk the group belongs to.
        positions: each layer's first element in the bucket's buffer.
    """

    compressor: Compressor
    segments: Segments
    members: tuple[int, ...]
    chunk: int
    positions: tuple[int, ...]
    _index: dict[torch.device, Tensor] = field(default_factory=dict, repr=False)
    #: the group's element range in the buffer when its layers lie there back to back, else ``None``
    span: Optional[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        start = self.positions[0]
        adjacent = all(p - start == o for p, o in zip(self.positions, self.segments.offsets))
        self.span = (start, start + self.segments.total) if adjacent else None

    def index(self, device: torch.device) -> Tensor:
        """int64 ``[segments.total]``: each element's position in the buffer (cached per device)."""
        cached = self._index.get(device)
        if cached is None:
            starts = torch.tensor([p - o for p, o in zip(self.positions, self.segments.offsets)], dtype=torch.int64)
            shift = starts.repeat_interleave(torch.tensor(self.segments.numels, dtype=torch.int64))
            cached = self._index[device] = (torch.arange(self.segments.total) + shift).to(device)
        return cached

    def take(self, buffer: Tensor) -> Tensor:
        """The group's gradients, flat (a view of ``buffer`` when the layers are adjacent, else a gathered copy)."""
        span = self.span
        if span is not None:
            return buffer[span[0] : span[1]]
        return buffer.index_select(0, self.index(buffer.device))

    def target(self, buffer: Tensor) -> Tensor:
        """Where to decode the group's mean: the buffer's own range when adjacent, else a new flat tensor that
        :meth:`put` then scatters."""
        span = self.span
        if span is not None:
            return buffer[span[0] : span[1]]
        return buffer.new_empty(self.segments.total)

    def fill(self, buffer: Tensor, value: float) -> None:
        """Set the group's places in ``buffer`` to ``value`` (one op)."""
        span = self.span
        if span is None:
            buffer.index_fill_(0, self.index(buffer.device), value)
        else:
            buffer[span[0] : span[1]].fill_(value)

    def put(self, buffer: Tensor, values: Tensor) -> None:
        """Write the group's flat ``values`` into its places in ``buffer`` (nothing when ``values`` is already
        the buffer's own range)."""
        span = self.span
        if span is None:
            buffer.scatter_(0, self.index(buffer.device), values)
        elif values.data_ptr() != buffer.data_ptr() + span[0] * buffer.element_size():
            buffer[span[0] : span[1]].copy_(values)


def pipeline_chunks(nbytes: Sequence[int], limit: Optional[int]) -> list[list[int]]:
    """Consecutive parameter indices grouped so each group holds about ``limit`` bytes of input.

    A group closes once it reaches ``limit``; a parameter is never split. ``None`` (or 0): one group. Sizes
    are the same on every rank, so every rank forms the same groups and issues the same collectives.
    """
    if not limit:
        return [list(range(len(nbytes)))] if nbytes else []
    chunks: list[list[int]] = [[]]
    filled = 0
    for i, n in enumerate(nbytes):
        if chunks[-1] and filled >= limit:
            chunks.append([])
            filled = 0
        chunks[-1].append(i)
        filled += n
    return chunks


class Layouts:
    """The groups of every bucket layout seen, made once (their index tensors with them)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[object, ...], list[LayerGroup]] = {}

    def groups(
        self,
        names: Sequence[str],
        shapes: Sequence[torch.Size],
        positions: Sequence[int],
        route: Sequence[Compressor],
        element_size: int,
        pipeline_bytes: Optional[int],
    ) -> list[LayerGroup]:
        """The bucket's groups: chunk by chunk (``pipeline_bytes`` of input each), one per compressor in the order
        its first layer comes."""
        key = (tuple(names), tuple(positions), tuple(route), pipeline_bytes)
        cached = self._groups.get(key)
        if cached is None:
            cached = []
            nbytes = [s.numel() * element_size for s in shapes]
            for c, chunk in enumerate(pipeline_chunks(nbytes, pipeline_bytes)):
                by_compressor: dict[int, list[int]] = {}
                order: list[Compressor] = []
                for i in chunk:
                    if id(route[i]) not in by_compressor:
                        by_compressor[id(route[i])] = []
                        order.append(route[i])
                    by_compressor[id(route[i])].append(i)
                for compressor in order:
                    members = by_compressor[id(compressor)]
                    segments = Segments([names[i] for i in members], [shapes[i] for i in members])
                    cached.append(LayerGroup(compressor, segments, tuple(members), c, tuple(positions[i] for i in members)))
            self._groups[key] = cached
        return cached


__all__ = ["HookBucket", "LayerGroup", "LayerViews", "Layouts", "layer_offsets", "pipeline_chunks"]


class TensorBucket:
    """Tensors laid out back to back in one flat buffer, shaped as DDP's ``GradBucket`` for the hook: a rank's
    gradients outside DDP (an emulated worker's, a probe's). The hook writes the decoded mean into ``buffer``.

    Args:
        buffer: the flat tensors (not copied).
        parameters: the tensors the hook names them by (``GradCompState.names``: ``id(parameter)`` -> name).
        shapes: each layer's shape in ``buffer`` (default: the parameters' shapes).
        index: the bucket's index (the hook keeps per-bucket records under it).
    """

    def __init__(self, buffer: Tensor, parameters: Sequence[Tensor], shapes: Optional[Sequence[torch.Size]] = None,
                 index: int = 0) -> None:
        self._buffer, self._parameters, self._index = buffer, list(parameters), index
        self._shapes = [p.shape for p in parameters] if shapes is None else [torch.Size(s) for s in shapes]

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> Sequence[Tensor]:
        return self._parameters

    def layer_shapes(self) -> list[torch.Size]:
        return list(self._shapes)

    def layer_offsets(self) -> tuple[int, ...]:
        """Each layer's first element in ``buffer``: back to back, in ``shapes`` (not the parameters' sizes)."""
        offsets, at = [], 0
        for shape in self._shapes:
            offsets.append(at)
            at += shape.numel()
        return tuple(offsets)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True
