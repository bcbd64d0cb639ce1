"""AdaComp over a group of layers in one flat tensor, in a number of ops that does not grow with the layers.

The batched torch path of :class:`~lightning_gradcomp.compressors.AdaComp` (the path CUDA runs without Triton) for the
adaptive selection and the paper's wire (``wire="paper"``); its local selection writes the same wire from its own
send mask. Each layer keeps its own bin
length L_T; a :class:`BinLayout` numbers every bin of the group, so

* the bin maxima are one ``scatter_reduce`` (amax) over bin ids, each layer's scale the mean of its bins' maxima
  (:func:`bin_mean`, which the per-layer path uses too), the selection |H| >= gmax(bin) one compare;
* the wire words are laid out in *word slots*: per layer two slots for the float32 scale, then per bin one slot
  for a marker word and one per element. Which slots are used is a mask computed over bins and elements (the
  markers from each bin's previous and next non-empty bin: a cummax and a reversed cummin), and the group payload
  is the used slots' bytes, low byte first, the high byte only for 16-bit layers: one ``masked_select`` per group,
  and the bytes are exactly the per-layer payloads back to back (``layer_nbytes`` an int64 device tensor);
* decoding walks the payload's bytes at once: each byte's layer from the per-layer sizes (``searchsorted``), the
  words' running bin a cumulative sum restarted per layer; entries are scatter-added, everything else adds 0.

Bit-identical to the per-layer oracle (``tests/oracles/adacomp.py``): the same selection, scales, payload bytes, sizes
and decoded sums.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.kernels import triton_adacomp, triton_compact
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.wire.sparse import CODE_ADVANCE, bin_word_bits

_BIG = 2**62


def bin_mean(gmax: Tensor, bins: Tensor) -> Tensor:
    """Each layer's mean of its bins' maxima: ``gmax`` holds the layers' bins back to back, ``bins`` (int64, on
    ``gmax``'s device) how many each has; 0 for a layer without bins.

    A sequential sum per layer (``torch.segment_reduce``), the same float sum whether a layer is reduced alone or
    with others, unlike ``mean()`` whose summation order depends on the tensor's length and layout.
    """
    sums = torch.segment_reduce(gmax, "sum", lengths=bins, unsafe=True)  # unsafe: no host check of the lengths
    return sums / bins.clamp(min=1).to(sums.dtype)


@dataclass(frozen=True)
class BinLayout:
    """Every bin of a group's layers, and where each word of the paper's wire would go (see the module docstring).

    Attributes:
        bin_ids: int64 ``[total]``: the group-wide bin of each element.
        in_bin: int64 ``[total]``: each element's offset in its bin.
        bins: int64 ``[layers]``: bins per layer.
        bin_sizes: int64 ``[layers]``: L_T per layer.
        field_bits: int64 ``[layers]``: bits of a word's offset field (6 or 14).
        word_bytes: int64 ``[layers]``: bytes per word (1 or 2).
        offsets: int64 ``[layers]``: each layer's first element in the group.
        bin_layer: int64 ``[bins]``: each bin's layer.
        first_bin, last_bin: int64 ``[bins]``: the first and last bin of each bin's layer.
        slots: word slots in all.
        slot_index: int64: the slots of the elements' words, the bins' markers, then each layer's two scale halves.
        wide: bool ``[slots]``: whether a slot's word has a second byte (16-bit words and the scale).
    """

    bin_ids: Tensor
    in_bin: Tensor
    bins: Tensor
    bin_sizes: Tensor
    field_bits: Tensor
    word_bytes: Tensor
    offsets: Tensor
    bin_layer: Tensor
    first_bin: Tensor
    last_bin: Tensor
    slots: int
    slot_index: Tensor
    wide: Tensor

    @staticmethod
    def build(segments: Segments, bin_sizes: tuple[int, ...], device: torch.device) -> "BinLayout":
        """The layout of ``segments`` with L_T ``bin_sizes[s]`` for layer ``s`` (built once per group on the host)."""
        numels = torch.tensor(segments.numels, dtype=torch.int64)
        sizes = torch.tensor(bin_sizes, dtype=torch.int64)
        bins = -(-numels // sizes)
        # an L_T beyond the paper's 14-bit offsets is only allowed with the index32 wire, which selects with this
        # layout but writes no words: its word fields are never read
        word_bytes = torch.tensor([bin_word_bits(min(size, 1 << 14)) // 8 for size in bin_sizes], dtype=torch.int64)
        offsets = torch.tensor(segments.offsets[:-1], dtype=torch.int64)
        first_bin = bins.cumsum(0) - bins
        slots_per_layer = 2 + numels + bins  # the scale's two halves, a marker per bin, a word per element
        first_slot = slots_per_layer.cumsum(0) - slots_per_layer
        layer = segments.ids(torch.device("cpu"))
        local = torch.arange(segments.total, dtype=torch.int64) - offsets[layer]
        local_bin = local // sizes[layer]
        bin_layer = torch.arange(len(segments)).repeat_interleave(bins)
        bin_local = torch.arange(int(bins.sum())) - first_bin[bin_layer]
        element_slot = first_slot[layer] + 2 + local + local_bin + 1
        marker_slot = first_slot[bin_layer] + 2 + bin_local * (sizes[bin_layer] + 1)
        slots = int(slots_per_layer.sum())
        slot_layer = torch.arange(len(segments)).repeat_interleave(slots_per_layer)
        wide = (word_bytes == 2)[slot_layer]
        wide[first_slot] = True
        wide[first_slot + 1] = True
        slot_index = torch.cat((element_slot, marker_slot, first_slot, first_slot + 1))
        return BinLayout(
            bin_ids=(first_bin[layer] + local_bin).to(device), in_bin=(local - local_bin * sizes[layer]).to(device),
            bins=bins.to(device), bin_sizes=sizes.to(device), field_bits=(8 * word_bytes - 2).to(device),
            word_bytes=word_bytes.to(device), offsets=offsets.to(device), bin_layer=bin_layer.to(device),
            first_bin=first_bin[bin_layer].to(device), last_bin=(first_bin + bins - 1)[bin_layer].to(device),
            slots=slots, slot_index=slot_index.to(device), wide=wide.to(device),
        )


def select_bins(g: Tensor, h: Tensor, layout: BinLayout, segments: Segments, ternary: bool) -> tuple[Tensor, Tensor]:
    """AdaComp's selection over the group: (the send mask ``[total]``, each layer's scale ``[layers]``).

    Algorithm 2 per bin: |H| >= max|G| over the bin, G != 0, and for the ternary quantizer 2|G| >= the layer scale.
    """
    magnitudes = g.abs()
    gmax = magnitudes.new_zeros(layout.bin_layer.numel())
    gmax.scatter_reduce_(0, layout.bin_ids, magnitudes, "amax", include_self=False)
    scale = bin_mean(gmax, layout.bins)
    send = (h.abs() >= gmax.index_select(0, layout.bin_ids)) & (g != 0)
    if ternary:
        send &= 2 * magnitudes >= segments.expand(scale)  # nearest of {-s, 0, s} is not 0
    return send, scale


def bin_markers(has: Tensor, first_off: Tensor, last_off: Tensor, layout: BinLayout) -> tuple[Tensor, Tensor]:
    """Which bins carry a marker word, and its word (int64 ``[bins]`` each), from which bins send (``has``) and their
    first and last sent offsets (read only where ``has``)."""
    nbins = layout.bin_layer.numel()
    ar = torch.arange(nbins, device=has.device)
    # the decoder's state before each bin: the last non-empty bin of the layer and its last offset, or the
    # layer's start (bin 0, offset -1)
    seen = torch.cummax(torch.where(has, ar, -1), 0).values
    before = torch.cat((seen.new_full((1,), -1), seen[:-1]))
    in_layer = before >= layout.first_bin
    prev_bin = torch.where(in_layer, before, layout.first_bin)
    prev_off = torch.where(in_layer, last_off.index_select(0, before.clamp(min=0)), -1)
    advance = ar - prev_bin
    implicit = (advance == 1) & (first_off <= prev_off)  # the offset does not increase: the next bin
    needs = has & (advance > 0) & ~implicit
    # markers of a bin b that needs them sit at bins b' + 1, b' + 1 + max_advance, ... <= b (b' its prev_bin), the
    # last carrying the remainder: a marker at bin c advances min(max_advance, b - c + 1)
    field_bits = layout.field_bits.index_select(0, layout.bin_layer)
    max_advance = (1 << field_bits) - 1
    upcoming = torch.where(has, ar, _BIG).flip(0).cummin(0).values.flip(0)
    target = upcoming.clamp(max=max(nbins - 1, 0))
    start = prev_bin.index_select(0, target)
    marker = (upcoming <= layout.last_bin) & needs.index_select(0, target) & (ar > start)
    marker &= (ar - start - 1) % max_advance == 0
    return marker, (CODE_ADVANCE << field_bits) | torch.minimum(max_advance, target - ar + 1)


def header_words(
    has: Tensor, first_off: Tensor, last_off: Tensor, counts: Tensor, scale: Tensor, layout: BinLayout
) -> tuple[Tensor, Tensor, Tensor]:
    """The words of the slots after the elements' (``layout.slot_index[total:]``: the bins' markers, then each
    layer's scale halves), whether each is sent, and each layer's bytes (int64 ``[layers]``), given the bins'
    selection (see :func:`bin_markers`) and each layer's sent count."""
    marker, marker_word = bin_markers(has, first_off, last_off, layout)
    markers = counts.new_zeros(counts.numel()).scatter_add_(0, layout.bin_layer, marker.to(torch.int64))
    scale_bits = scale.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nonempty = counts > 0
    words = torch.cat((marker_word, scale_bits & 0xFFFF, scale_bits >> 16))
    nbytes = torch.where(nonempty, 4 + layout.word_bytes * (counts + markers), 0)
    return words, torch.cat((marker, nonempty, nonempty)), nbytes


def slot_bytes(words: Tensor, used: Tensor, wide: Tensor) -> tuple[Tensor, Tensor]:
    """uint8 ``[slots, 2]``: each word's low and high byte, and bool ``[slots, 2]``: which are sent (the high byte of
    a wide slot only)."""
    low_high = torch.stack((words & 0xFF, (words >> 8) & 0xFF), dim=1).to(torch.uint8)
    return low_high, torch.stack((used, used & wide), dim=1)


def encode_group_words(
    g: Tensor, send: Tensor, scale: Tensor, layout: BinLayout, segments: Segments
) -> tuple[Tensor, Tensor]:
    """The paper's wire for every layer, back to back, and each layer's bytes (int64 ``[layers]``): per layer with
    entries, ``[float32 scale][bin-relative words]`` as :func:`~lightning_gradcomp.wire.sparse.encode_bin_relative`
    writes them (markers included); nothing for a layer without."""
    nbins = layout.bin_layer.numel()
    sent = send.to(torch.int64)
    counts = segments.reduce(sent, "sum")
    has = sent.new_zeros(nbins).scatter_reduce_(0, layout.bin_ids, sent, "amax", include_self=False) > 0
    first_off = torch.where(send, layout.in_bin, _BIG)
    first_off = first_off.new_full((nbins,), _BIG).scatter_reduce_(0, layout.bin_ids, first_off, "amin")
    last_off = torch.where(send, layout.in_bin, -1)
    last_off = last_off.new_full((nbins,), -1).scatter_reduce_(0, layout.bin_ids, last_off, "amax")
    header, header_used, nbytes = header_words(has, first_off, last_off, counts, scale, layout)
    element_bits = segments.expand(layout.field_bits)
    entry_word = ((torch.sign(g).to(torch.int64) + 1) << element_bits) | layout.in_bin
    words = torch.cat((entry_word, header))
    used = torch.cat((send, header_used))
    slot_words = words.new_zeros(layout.slots).scatter_(0, layout.slot_index, words)
    slot_used = used.new_zeros(layout.slots).scatter_(0, layout.slot_index, used)
    payload = torch.masked_select(*slot_bytes(slot_words, slot_used, layout.wide))
    return payload, nbytes


def encode_words(
    g: Tensor, send: Tensor, scale: Tensor, segments: Segments, bins: Tensor, layout: Callable[[], BinLayout]
) -> tuple[Tensor, Tensor]:
    """The paper's wire of a selection: (payload, bytes per layer); an empty group sends nothing (``bins``: its bins
    per layer; ``layout``: its :class:`BinLayout`, asked for only when it has elements)."""
    if not segments.total:
        return g.new_zeros(0, dtype=torch.uint8), torch.zeros_like(bins)
    return encode_group_words(g, send, scale, layout(), segments)


def encode_group_kernels(
    g: Tensor, dw: Tensor, factor: float, layout: BinLayout, tables: triton_adacomp.Tables, ternary: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`select_bins` then :func:`encode_group_words` by the Triton kernels (:mod:`~lightning_gradcomp.kernels.
    triton_adacomp`; H = ``g`` + ``factor`` ``dw`` inside them): (payload, bytes, scale, sent count per layer),
    the same bits. One host read: the payload's size."""
    gmax = triton_adacomp.bin_maxima(g, tables)
    scale = bin_mean(gmax, layout.bins)
    bin_counts, first_off, last_off, words, used = triton_adacomp.select(g, dw, factor, gmax, scale, tables, ternary)
    counts = bin_counts.new_zeros(layout.bins.numel()).index_add_(0, layout.bin_layer, bin_counts)
    header, header_used, nbytes = header_words(bin_counts > 0, first_off, last_off, counts, scale, layout)
    rest = layout.slot_index[g.numel():]
    header_bytes, header_sent = slot_bytes(header, header_used, layout.wide.index_select(0, rest))
    # Whole rows of the (slots, word bytes) tables: index_copy_ copies rows, scatter_ would need a 2-D index.
    words.index_copy_(0, rest, header_bytes)
    used.index_copy_(0, rest, header_sent.to(torch.uint8))
    size = int(nbytes.sum())  # the payload's size: the one host read (masked_select's on the torch path)
    payload = torch.empty(size, dtype=torch.uint8, device=g.device)
    triton_compact.compact(used.view(-1), words.view(-1), torch.empty(size, dtype=torch.int32, device=g.device),
                           payload)
    return payload, nbytes, scale, counts


def decode_group_words(payload: Tensor, nbytes: Tensor, layout: BinLayout) -> tuple[Tensor, Tensor]:
    """(int64 indices, float32 values) of :func:`encode_group_words`'s bytes, one pair per payload byte: a byte that
    does not start an entry's word gives index 0 and value 0 (adding it changes nothing)."""
    size = payload.numel()
    raw = payload.reshape(-1).view(torch.uint8)
    ends = nbytes.cumsum(0)
    starts = ends - nbytes
    p = torch.arange(size, device=raw.device)
    layer = torch.searchsorted(ends, p, right=True)
    rel = p - starts.index_select(0, layer)
    width = layout.word_bytes.index_select(0, layer)
    bits = layout.field_bits.index_select(0, layer)
    wide = torch.cat((raw[1:], raw.new_zeros(1))).to(torch.int64)
    word = raw.to(torch.int64) | (torch.where(width == 2, wide, 0) << 8)
    starts_word = (rel >= 4) & ((rel - 4) % width == 0)
    code = word >> bits
    field = word & ((1 << bits) - 1)
    is_marker = starts_word & (code == CODE_ADVANCE)
    previous = (p - width).clamp(min=0)
    has_previous = rel - width >= 4
    prev_field = torch.where(has_previous, field.index_select(0, previous), -1)
    prev_marker = torch.where(has_previous, is_marker.index_select(0, previous), True)
    implicit = starts_word & ~is_marker & ~prev_marker & (field <= prev_field)
    advance = torch.where(is_marker, field, implicit.to(torch.int64))
    running = advance.cumsum(0)
    # each layer's bins count from 0: less the running total before the layer's first byte
    bin_in_layer = running - (running - advance).index_select(0, starts.index_select(0, layer))
    heads = (starts.unsqueeze(1) + torch.arange(4, device=raw.device)).clamp(max=max(size - 1, 0))
    scale = raw[heads.reshape(-1)].reshape(-1, 4).contiguous().view(torch.float32).reshape(-1)
    entry = starts_word & ~is_marker
    index = layout.offsets.index_select(0, layer) + bin_in_layer * layout.bin_sizes.index_select(0, layer) + field
    values = (code - 1).to(torch.float32) * scale.index_select(0, layer)
    return torch.where(entry, index, 0), torch.where(entry, values, 0.0)


__all__ = [
    "BinLayout", "bin_markers", "bin_mean", "decode_group_words", "encode_group_kernels", "encode_group_words", "encode_words",
    "header_words", "select_bins", "slot_bytes",
]
