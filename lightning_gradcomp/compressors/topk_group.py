"""The wire of :class:`~lightning_gradcomp.compressors.TopK` and ``DGC``: a whole group of layers
(:class:`~lightning_gradcomp.flat.Segments`) encoded and decoded in a fixed number of ops, and top-k's
selection (:func:`top_k_segment` for one layer, looped by :func:`select_top_k`; :func:`select_top_k_batched` for
the whole group at once).

A group payload is one ``uint8`` tensor of four sections, each 4-byte aligned where it starts (so each is a view
of the payload, not a copy, when the payload itself is aligned):

``[dense layers' fp32 values][int2: one fp32 scale per sparse layer][int32 indices][values]``

* dense layers (``dim() <= 1`` with ``dense_1d``): their elements in flat order, as float32;
* indices: positions within the group's flat tensor (global, not per layer), layer after layer;
* values: ``fp32`` / ``fp16`` per index, or ``int2``'s 2-bit codes, each layer's codes padded with zeros to a
  whole byte (as a per-layer :func:`~lightning_gradcomp.wire.bits.pack_bits` pads them).

Each layer accounts for ``4 n`` bytes dense, ``k (4 + value bytes)`` sparse, ``4 + 4 k + ceil(k / 4)`` with
``int2`` (what a layer sent on its own, as a group of one, puts on the wire). Decoding writes bit for bit what a
decode of each layer alone writes (the per-layer oracle, ``tests/oracles/topk.py``): ``sent`` copies each value into
zeros; the ranks' sum starts from +0.0 at sparse positions and -0.0 at dense ones (``-0.0 + v == v`` for every
``v``: what a dense layer's sum, which starts from rank 0's values, gives) and adds the ranks in order, one
``scatter_add_`` per rank (no duplicate index within a rank, so even CUDA's atomics add each element in rank order).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.wire.bits import pack_bits, unpack_bits
from lightning_gradcomp.kernels import triton_compact, triton_topk
from lightning_gradcomp.flat import Segments

#: int2 codes 0..3 stand for (code - 1.5) * s
INT2_HALF_RANGE = 1.5
_INT2 = "int2"


@dataclass
class SparseLayout:
    """What a group's shapes and the compressor's settings fix about its payload (made once per group and ratio).

    Attributes:
        segments: the group.
        value_dtype: ``"fp32"``, ``"fp16"`` or ``"int2"``.
        dense: per layer, whether it travels dense.
        counts: per layer, the elements a top-k sends (0 for dense and empty layers); DGC's are at most these.
        dense_index: int64 flat positions of the dense layers' elements.
        sparse_layers: int64 indices of the sparse layers (those with an int2 scale).
        firsts: with a per-segment descending sort, the flat positions of each layer's top ``counts`` elements.
        selection: the sent elements' layout (``counts`` per layer), for int2's per-layer scales and padding.
    """

    segments: Segments
    value_dtype: str
    dense: tuple[bool, ...]
    counts: tuple[int, ...]
    device: torch.device
    dense_index: Tensor = field(init=False)
    sparse_layers: Tensor = field(init=False)
    selection: Segments = field(init=False)
    _templates: dict[torch.dtype, Tensor] = field(default_factory=dict, init=False, repr=False)
    _constants: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False)
    _select: Optional[triton_topk.SelectTables] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        seg = self.segments
        dense_pos = [torch.arange(o, o + n) for o, n, d in zip(seg.offsets, seg.numels, self.dense) if d]
        self.dense_index = (torch.cat(dense_pos) if dense_pos else torch.zeros(0, dtype=torch.int64)).to(self.device)
        sparse = [i for i, d in enumerate(self.dense) if not d]
        self.sparse_layers = torch.tensor(sparse, dtype=torch.int64).to(self.device)
        self.selection = Segments(seg.names, [torch.Size([k]) for k in self.counts])

    @property
    def dense_total(self) -> int:
        return sum(n for n, d in zip(self.segments.numels, self.dense) if d)

    @property
    def n_sparse(self) -> int:
        return len(self.dense) - sum(self.dense)

    @property
    def value_nbytes(self) -> int:
        return 4 if self.value_dtype == "fp32" else 2

    def fixed_nbytes(self) -> tuple[int, ...]:
        """Bytes per layer when every sparse layer sends its ``counts`` elements (top-k)."""
        return self.nbytes_of(self.counts)

    def nbytes_of(self, sent: Sequence[int]) -> tuple[int, ...]:
        """Bytes per layer when each sparse layer sends ``sent`` elements (dense layers their ``4 n``)."""
        out = []
        for n, k, d in zip(self.segments.numels, sent, self.dense):
            if d:
                out.append(4 * n)
            elif self.value_dtype == _INT2:
                out.append(4 + 4 * k + -(-k // 4))
            else:
                out.append(k * (4 + self.value_nbytes))
        return tuple(out)

    def selection_of(self, sent: Sequence[int]) -> Segments:
        """The sent elements' layout when each layer sends ``sent`` elements (int2's scales and padding follow it):
        :attr:`selection` for the top-k counts, else made anew (DGC's counts differ by rank and step)."""
        sent = tuple(sent)
        if sent == self.counts:
            return self.selection
        return Segments(self.segments.names, [torch.Size([k]) for k in sent])

    def constant(self, name: str, make: Callable[[], Tensor]) -> Tensor:
        """A per-layout constant tensor ``make()`` on the layout's device, made on first use."""
        cached = self._constants.get(name)
        if cached is None:
            cached = self._constants[name] = make().to(self.device)
        return cached

    def select_tables(self) -> triton_topk.SelectTables:
        """The Triton selection's tables of this group's ``counts`` (made on first use)."""
        if self._select is None:
            self._select = triton_topk.SelectTables(self.segments.numels, self.counts, self.device)
        return self._select

    def sum_template(self, dtype: torch.dtype) -> Tensor:
        """The start of a ranks' sum: -0.0 at dense positions, +0.0 elsewhere (see the module's docstring)."""
        cached = self._templates.get(dtype)
        if cached is None:
            cached = torch.zeros(self.segments.total, dtype=dtype, device=self.device)
            cached.index_fill_(0, self.dense_index, -0.0)
            self._templates[dtype] = cached
        return cached


def top_k_segment(magnitudes: Tensor, k: int) -> Tensor:
    """int64 positions, ascending, of the ``k`` largest of the 1-D ``magnitudes`` (``1 <= k <= numel``): NaN above
    +inf, and of the values equal to the k-th largest the lowest positions (a stable descending sort's first ``k``).

    One partial selection (``torch.topk``) and a count of what reaches its k-th largest; only when that count says
    values equal to it were left out (``torch.topk`` chooses among ties as its kernel happens to) or a NaN is among
    the top ``k``, the stable sort that states the rule.
    """
    values, index = torch.topk(magnitudes, k, sorted=False)
    if k < magnitudes.numel() and int((magnitudes >= values.min()).sum()) != k:  # a NaN minimum reaches nothing
        index = torch.sort(magnitudes, descending=True, stable=True).indices[:k]
    return index.sort().values


def select_top_k(magnitudes: Tensor, layout: SparseLayout) -> Tensor:
    """Every sparse layer's top ``layout.counts`` of ``magnitudes`` (``[segments.total]``): int64 flat positions,
    ascending. One :func:`top_k_segment` per layer (a CPU's fastest: a partial selection costs less than the batched
    form's sorts of the whole group)."""
    seg = layout.segments
    parts = [top_k_segment(magnitudes[o : o + n], k).add_(o) for o, n, k in zip(seg.offsets, seg.numels, layout.counts)
             if k]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=magnitudes.device)


def select_top_k_batched(magnitudes: Tensor, layout: SparseLayout) -> Tensor:
    """:func:`select_top_k` in a fixed number of ops, no host read: a segmented stable sort (descending), then each
    layer's first ``counts`` positions (a GPU's form without Triton)."""
    seg = layout.segments
    _, order = seg.sort(magnitudes, descending=True)
    return order.index_select(0, seg.firsts(layout.counts, magnitudes.device)).sort().values


def int2_codes(values: Tensor, scale: Tensor) -> Tensor:
    """int2 codes (float, 0..3) of ``values`` given their layer's scale ``s = max|value| / 1.5`` (per value, or
    one broadcast): the nearest of ``{-1.5, -0.5, 0.5, 1.5} * s``."""
    step = torch.where(scale > 0, scale, 1.0)  # no host read: an all-zero selection codes 0 * anything
    return (values / step + INT2_HALF_RANGE).round_().clamp_(0, 3)


def int2_values(codes: Tensor, scale: Tensor) -> Tensor:
    """The values int2 ``codes`` stand for: ``(code - 1.5) * scale``."""
    return (codes - INT2_HALF_RANGE) * scale


def _as(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """Bytes ``raw`` reinterpreted as ``dtype``: a view where aligned, else a copy (a gathered payload may start
    anywhere in its rank's buffer)."""
    if dtype == torch.uint8:
        return raw
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def _bytes(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)


_WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def encode(flat: Tensor, layout: SparseLayout, indices: Tensor, selection: Optional[Segments] = None) -> Tensor:
    """The group payload of ``flat`` sending ``indices`` (int64 flat positions of sparse layers' elements, layer
    after layer; for int2, exactly ``selection``'s counts per layer: by default ``layout.selection``, the top-k
    counts)."""
    dense = flat.index_select(0, layout.dense_index).float()
    picked = flat.index_select(0, indices)
    index_bytes = _bytes(indices.to(torch.int32))
    if layout.value_dtype != _INT2:
        return torch.cat((_bytes(dense), index_bytes, _bytes(picked.to(_WIRE_DTYPES[layout.value_dtype]))))
    sel = layout.selection if selection is None else selection
    values = picked.float()
    scale = sel.reduce(values.abs(), "amax") / INT2_HALF_RANGE  # an empty layer: 0, as the per-layer path
    codes = int2_codes(values, sel.expand(scale))
    packed = pack_bits(sel.padding(4).pad(codes, 0.0), 2)
    scales = scale.index_select(0, layout.sparse_layers)
    return torch.cat((_bytes(dense), _bytes(scales), index_bytes, packed))


def encode_top_k(flat: Tensor, layout: SparseLayout) -> Tensor:
    """The group payload of every sparse layer's top ``layout.counts`` of ``|flat|`` by the Triton kernels
    (:mod:`~lightning_gradcomp.kernels.triton_topk` selects; fp32 / fp16 values compacted into the payload, int2's
    coded by :func:`encode`): :func:`encode` of the torch path's selection, byte for byte, with no host read (the
    count is known)."""
    x = flat.float().contiguous()
    mask = triton_topk.select(x, layout.select_tables())
    if layout.value_dtype != _INT2:
        return encode_mask(x, layout, mask, layout.selection.total)
    index = torch.empty(layout.selection.total, dtype=torch.int32, device=x.device)
    triton_compact.compact(mask, x, index, torch.empty_like(index, dtype=torch.float32))
    return encode(flat, layout, index.long())  # int2's scales and codes: the torch ops


def encode_mask(x: Tensor, layout: SparseLayout, mask: Tensor, count: Optional[int] = None) -> Tensor:
    """The fp32 / fp16 group payload sending the elements of the float32 contiguous ``x`` that the uint8 ``mask``
    selects (sparse layers' only), by :func:`~lightning_gradcomp.kernels.triton_compact.compact` writing the indices
    and values in place: :func:`encode` of ``nonzero(mask)``. ``count``: how many are selected, when known; else it
    is read from the device (one host read, where ``torch.nonzero`` on CUDA reads it too)."""
    counts = None
    if count is None:
        counts = triton_compact.tile_counts(mask)
        count = int(counts.sum())
    dense_bytes = 4 * layout.dense_total
    payload = torch.empty(dense_bytes + (4 + layout.value_nbytes) * count, dtype=torch.uint8, device=x.device)
    torch.index_select(x, 0, layout.dense_index, out=payload[:dense_bytes].view(torch.float32))
    index = payload[dense_bytes : dense_bytes + 4 * count].view(torch.int32)
    values = payload[dense_bytes + 4 * count :].view(_WIRE_DTYPES[layout.value_dtype])
    triton_compact.compact(mask, x, index, values, counts)
    return payload


def sparse_count(layout: SparseLayout, payload_nbytes: int) -> int:
    """How many indices a payload of ``payload_nbytes`` holds (a host integer from its size, no read)."""
    if layout.value_dtype == _INT2:
        return layout.selection.total
    return (payload_nbytes - 4 * layout.dense_total) // (4 + layout.value_nbytes)


def int2_counts(layout: SparseLayout, layer_nbytes: "Sequence[int] | Tensor") -> tuple[int, ...]:
    """Each layer's sent count of an int2 payload from its bytes per layer (``4 + 4 k + ceil(k / 4)`` for a sparse
    layer; 0 for a dense one)."""
    sizes = layer_nbytes.tolist() if isinstance(layer_nbytes, Tensor) else layer_nbytes
    out = []
    for nbytes, dense in zip(sizes, layout.dense):
        total = int(nbytes) - 4
        k = 0 if dense else max(0, total * 4 // 17 - 1)  # 4k + ceil(k / 4) == total: start just below and step up
        while not dense and 4 * k + -(-k // 4) < total:
            k += 1
        out.append(k)
    return tuple(out)


def sections(payload: Tensor, layout: SparseLayout) -> tuple[Tensor, Tensor, Tensor]:
    """``(dense float32 values, int32 indices, values as they travel)`` of an fp32 / fp16 group payload, views of it
    where aligned."""
    count = sparse_count(layout, payload.numel())
    offset = 4 * layout.dense_total
    dense = _as(payload[:offset], torch.float32)
    indices = _as(payload[offset : offset + 4 * count], torch.int32)
    return dense, indices, _as(payload[offset + 4 * count :], _WIRE_DTYPES[layout.value_dtype])


def decode(payload: Tensor, layout: SparseLayout, selection: Optional[Segments] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dense float32 values, int64 indices, values)`` of a group payload (values as they travel: fp32, fp16,
    or int2's dequantized float32; int2's sent counts per layer are ``selection``'s, by default the top-k ones)."""
    if layout.value_dtype != _INT2:
        dense, indices, values = sections(payload, layout)
        return dense, indices.long(), values
    sel = layout.selection if selection is None else selection
    count = sel.total
    offset = 4 * layout.dense_total
    dense = _as(payload[:offset], torch.float32)
    scales = _as(payload[offset : offset + 4 * layout.n_sparse], torch.float32)
    offset += 4 * layout.n_sparse
    indices = _as(payload[offset : offset + 4 * count], torch.int32).long()
    offset += 4 * count
    padding = sel.padding(4)
    codes = padding.unpad(unpack_bits(payload[offset:], padding.total, 2)).float()
    scale = scales.new_zeros(len(sel)).scatter_(0, layout.sparse_layers, scales)
    return dense, indices, int2_values(codes, sel.expand(scale))


def decode_sent(payload: Tensor, layout: SparseLayout, dtype: torch.dtype, selection: Optional[Segments] = None) -> Tensor:
    """The flat tensor a payload stands for (each value copied into zeros). ``selection``: as :func:`decode`'s."""
    out = torch.zeros(layout.segments.total, dtype=dtype, device=payload.device)
    dense, indices, values = decode(payload, layout, selection)
    out.scatter_(0, layout.dense_index, dense.to(dtype))
    return out.scatter_(0, indices, values.to(dtype))


def scatter_sent(payload: Tensor, layout: SparseLayout, dtype: torch.dtype) -> Tensor:
    """:func:`decode_sent` of fp32 / fp16 values by :func:`~lightning_gradcomp.kernels.triton_compact.scatter`."""
    out = torch.zeros(layout.segments.total, dtype=dtype, device=payload.device)
    dense, index, values = sections(payload, layout)
    triton_compact.scatter(layout.dense_index, dense, out)
    return triton_compact.scatter(index, values, out)


#: one rank's payload added into the ranks' sum: ``(payload, its selection as decode's, the sum)``
AddRank = Callable[[Tensor, Optional[Segments], Tensor], None]


def add_decoded(payload: Tensor, layout: SparseLayout, selection: Optional[Segments], total: Tensor) -> None:
    """One rank's payload decoded and added into ``total`` by torch ops."""
    dense, indices, values = decode(payload, layout, selection)
    total.scatter_add_(0, layout.dense_index, dense.to(total.dtype))
    total.scatter_add_(0, indices, values.to(total.dtype))


def add_sections(payload: Tensor, layout: SparseLayout, total: Tensor) -> None:
    """One rank's fp32 / fp16 values added into ``total`` by :func:`~lightning_gradcomp.kernels.triton_compact
    .scatter_add`."""
    dense, index, values = sections(payload, layout)
    triton_compact.scatter_add(layout.dense_index, dense, total)
    triton_compact.scatter_add(index, values, total)


def decode_mean_into(
    payloads: Sequence[Tensor], layout: SparseLayout, dtype: torch.dtype, out: Tensor, add: AddRank,
    selections: Optional[Sequence[Optional[Segments]]] = None,
) -> Tensor:
    """The ranks' mean of gathered payloads (in rank order) in ``out``, bit for bit the per-layer sum then division;
    ``add`` adds each rank's payload (:func:`add_decoded`, or :func:`add_sections` for the Triton kernels).
    ``selections``: each payload's, as :func:`decode`'s."""
    total = out if out.dtype == dtype and out.is_contiguous() else torch.empty(
        layout.segments.total, dtype=dtype, device=out.device)
    total.copy_(layout.sum_template(dtype))
    for r, payload in enumerate(payloads):
        add(payload, None if selections is None else selections[r], total)
    if total is not out:
        out.copy_(total)
    return out.div_(len(payloads))


def density(layout: SparseLayout, sent: "Sequence[int] | Tensor") -> Tensor:
    """float32 ``[layers]``: sent / numel per layer (1 for dense layers), rounded as the per-layer stat is
    (a float64 quotient, then float32)."""
    numels = layout.segments.numels
    if not isinstance(sent, Tensor):
        per = [1.0 if d else k / max(1, n) for k, n, d in zip(sent, numels, layout.dense)]
        return torch.tensor(per, dtype=torch.float32, device=layout.device)
    denominators = layout.constant("numel", lambda: torch.tensor([float(max(1, n)) for n in numels], dtype=torch.float64))
    dense = layout.constant("dense", lambda: torch.tensor(layout.dense, dtype=torch.bool))
    return torch.where(dense, 1.0, sent.double() / denominators).float()


def sent_nbytes(layout: SparseLayout, sent: "Sequence[int] | Tensor") -> "tuple[int, ...] | Tensor":
    """The bytes each layer puts on the wire when it sends ``sent`` elements (dense layers their ``4 n``): host
    integers for host counts (:meth:`SparseLayout.nbytes_of`), else int64 ``[layers]`` (fp32 / fp16 values)."""
    if not isinstance(sent, Tensor):
        return layout.nbytes_of(sent)
    dense = layout.constant("dense_nbytes", lambda: torch.tensor(
        [4 * n if d else 0 for n, d in zip(layout.segments.numels, layout.dense)], dtype=torch.int64))
    return sent * (4 + layout.value_nbytes) + dense

__all__ = ["INT2_HALF_RANGE", "int2_codes", "int2_values", "SparseLayout", "AddRank", "add_decoded", "add_sections", "decode", "decode_mean_into",
           "decode_sent", "scatter_sent",
           "density", "encode", "encode_mask", "encode_top_k", "int2_counts", "sections", "select_top_k",
           "select_top_k_batched", "sent_nbytes", "sparse_count", "top_k_segment"]
