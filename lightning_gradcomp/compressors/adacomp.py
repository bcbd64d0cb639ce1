"""AdaComp (Chen et al., AAAI 2018): adaptive residual gradient compression by local selection in bins.

Algorithm 2 (``pack()``), per layer, with dW this step's gradient and G the gradient plus the residue:

1. G = residue + dW; H = G + dW (``scale_factor`` 2: H = residue + 2 dW);
2. split G into bins of L_T elements (row-major, i.e. NumOut x NumIn x kH x kW for a convolution);
   gmax(i) = max |G| over bin i;
3. send entry j of bin i when |H(j)| >= gmax(i); its value is sign(G(j)) times one scale per layer, the mean
   of gmax over all bins; residue = G - sent (the hook's error feedback).

Choices the paper leaves open (documented in ``docs/compressors.md``):

* the last bin may be shorter than L_T: it is a bin of its own, with its own gmax, and counts as one bin in
  the scale's mean;
* an entry with G = 0 is never sent (its sign is 0, it would carry nothing); so an all-zero bin sends nothing;
* L_T by layer type from the tensor's shape: 3 or more dimensions is a convolution (L_T 50); everything else,
  i.e. fully connected and recurrent weight matrices, embeddings, and 1-D biases and norm parameters, uses
  the fully connected L_T (500). ``bin_sizes`` overrides it per parameter-name pattern (fnmatch, first match).
* ``quantizer="ternary"``: the value is the nearest of {-scale, 0, +scale}; entries that round to 0 are not
  sent (they stay in the residue).
* ``selection="local"`` is the paper's "LS" baseline: the ``local_count`` largest |G| of each bin, no soft
  threshold.

The paper's wire format (``wire="paper"``): one float32 scale per layer, then a word per sent entry, 8 bits for
L_T < 64 and 16 bits otherwise, 2 bits of which carry the ternary value and the rest the entry's offset in
its bin, plus a marker word wherever the bin cannot be inferred (:func:`~lightning_gradcomp.wire.sparse.encode_bin_relative`).
``wire="index32"`` is the third-party MXNet layout: int32 count, float32 scale, int32 absolute indices, one sign
bit per entry. A layer that sends nothing sends 0 bytes.

The code is written once, for a group of layers in one flat tensor: the hook's group methods (``compress_flat``,
``decompress_flat_mean_into``, ...) run every setting, and the per-tensor calls (``per_tensor(compressor).compress(tensor, name)``,
``decompress(packet)``, ...) run them on a group of one. The adaptive selection with the paper's wire runs a fixed
number of ops per group (:mod:`~lightning_gradcomp.compressors.adacomp_group`, the compiled group kernels on CPU, Triton
on CUDA); the local selection picks per layer (:func:`local_send`, then the group's wire at once) and the index32 wire
writes and reads each layer's bytes in turn (:func:`encode_index32`, :func:`decode_index32`). A gradient of any float
dtype is selected in float32, and the ranks' decoded values are summed in the gradients' dtype.
"""

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp_group import (
    BinLayout,
    bin_mean,
    encode_words,
    select_bins,
)
from lightning_gradcomp.compressors.backends import BACKENDS, Backend, KernelBacked
from lightning_gradcomp.compressors.base import Aggregation, GradientObserver, SharedStatistic, SelectsElements
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.adacomp_kernels import ADACOMP_KERNELS, AdaCompKernels
from lightning_gradcomp.wire.sparse import bin_word_bits, pack_codes, packed_codes_nbytes, unpack_codes
from lightning_gradcomp.validation import check_choice, check_int, check_number

Quantizer = Literal["binary", "ternary"]
Selection = Literal["adaptive", "local"]
Wire = Literal["paper", "index32"]
LayerKind = Literal["conv", "fc", "recurrent"]

_RECURRENT_NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def layer_kind(name: str, shape: torch.Size) -> LayerKind:
    """Layer type of a parameter: ``"conv"`` for 3 or more dimensions, ``"recurrent"`` for torch RNN/LSTM/GRU
    parameters (by name), ``"fc"`` for everything else (weight matrices, embeddings, biases, norms)."""
    if len(shape) >= 3:
        return "conv"
    if any(part in name for part in _RECURRENT_NAMES):
        return "recurrent"
    return "fc"


def local_send(g: Tensor, size: int, count: int) -> tuple[Tensor, Tensor]:
    """The paper's LS baseline on one layer: (the send mask, the layer's scale as a 0-d tensor).

    Per bin of ``size`` elements of the flat float32 G (the last bin may be shorter), the ``count`` largest |G| as
    ``torch.topk`` picks them (ties by its order), never a G = 0; the scale is the mean of the bins' max |G|
    (:func:`~lightning_gradcomp.compressors.adacomp_group.bin_mean`, as the adaptive selection's).
    """
    n = g.numel()
    if n == 0:
        return g.new_zeros(0, dtype=torch.bool), g.new_zeros(())
    pad = -(-n // size) * size - n
    bins = (torch.cat((g, g.new_zeros(pad))) if pad else g).view(-1, size)  # zero padding is never sent
    magnitudes = bins.abs()
    gmax = magnitudes.amax(dim=1)
    scale = bin_mean(gmax, torch.tensor([gmax.numel()], device=g.device)).reshape(())
    top = torch.topk(magnitudes, min(count, size), dim=1).indices
    send = torch.zeros_like(magnitudes, dtype=torch.bool).scatter_(1, top, True) & (bins != 0)
    return send.reshape(-1)[:n], scale


def encode_index32(idx: Tensor, signs: Tensor, scale: Tensor) -> Tensor:
    """One layer in the index32 wire (the MXNet layout): int32 count, float32 scale, int32 indices (ascending), one
    bit per entry (1: positive, ``signs`` > 0), as uint8; nothing when no entry is sent."""
    if idx.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=scale.device)
    count = torch.tensor([idx.numel()], dtype=torch.int32, device=idx.device).view(torch.uint8)
    head = scale.float().reshape(1).view(torch.uint8)
    return torch.cat((count, head, idx.to(torch.int32).view(torch.uint8), pack_codes((signs > 0).long(), 1)))


def decode_index32(payload: Tensor) -> tuple[Tensor, Tensor]:
    """(int64 indices, float32 values +-scale) of one layer's non-empty :func:`encode_index32` bytes."""
    k = int(payload[:4].clone().view(torch.int32)[0])
    scale = payload[4:8].clone().view(torch.float32)
    idx = payload[8 : 8 + 4 * k].clone().view(torch.int32).long()
    signs = unpack_codes(payload[8 + 4 * k : 8 + 4 * k + packed_codes_nbytes(k, 1)], k, 1)
    return idx, torch.where(signs == 1, 1.0, -1.0) * scale


class AdaComp(KernelBacked[AdaCompKernels], GradientObserver, SelectsElements):
    """AdaComp: per-bin local selection with a soft threshold, sign x layer-scale values, residual feedback.

    Args:
        bin_size_conv: L_T of convolution weights (paper: 50).
        bin_size_fc: L_T of every other parameter: fully connected and recurrent layers (paper: 500), biases.
        bin_sizes: parameter-name pattern (fnmatch) -> L_T, checked in order before the layer-type default.
        scale_factor: H = residue + scale_factor * dW (paper: 2; 1.5 to 3 studied).
        quantizer: ``"binary"`` (sign x scale, the paper's quantizer) or ``"ternary"`` (nearest of
            {-scale, 0, +scale}; zeros are not sent).
        selection: ``"adaptive"`` (AdaComp's soft threshold) or ``"local"`` (the paper's LS baseline: the
            ``local_count`` largest |G| per bin).
        local_count: entries per bin sent by ``selection="local"``.
        wire: ``"paper"`` (8/16-bit bin-relative words) or ``"index32"`` (int32 indices + sign bits).
        backend: ``"torch"`` (torch ops: the reference), ``"fused"`` (:mod:`lightning_gradcomp.kernels`: bin
            maxima and selection in one pass per bin, the sum of all ranks' payloads decoded into one dense
            tensor; compiled on CPU, torch ops elsewhere) or ``"auto"`` (fused on CPU when the kernels compile
            here, else torch). Both send the same bytes; ``selection="local"`` always selects with torch ops.

    Written at group level: ``per_tensor(adacomp)`` runs the group methods on a group of one (a standalone per-tensor
    user calls its ``observe_gradient`` with the fresh gradient before ``compress``).
    """

    aggregation = Aggregation.GATHER
    uses_memory = True
    fixed_size = False

    def __init__(
        self,
        bin_size_conv: int = 50,
        bin_size_fc: int = 500,
        bin_sizes: Optional[Mapping[str, int]] = None,
        scale_factor: float = 2.0,
        quantizer: Quantizer = "binary",
        selection: Selection = "adaptive",
        local_count: int = 1,
        wire: Wire = "paper",
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        check_int("bin_size_conv", bin_size_conv, minimum=1, fix="use 50 (the paper)")
        check_int("bin_size_fc", bin_size_fc, minimum=1, fix="use 500 (the paper)")
        overrides = dict(bin_sizes or {})
        for pattern, size in overrides.items():
            check_int(f"bin_sizes[{pattern!r}]", size, minimum=1, fix="use a bin length L_T >= 1")
        check_number("scale_factor", scale_factor, minimum=1.0, fix="use 2.0 (the paper)")
        check_choice("quantizer", quantizer, ("binary", "ternary"))
        check_choice("selection", selection, ("adaptive", "local"))
        check_int("local_count", local_count, minimum=1, fix="use 1 (one entry per bin)")
        check_choice("wire", wire, ("paper", "index32"))
        check_choice(
            "backend", backend, BACKENDS, fix="use 'auto' (fused on CPU when the kernels compile), 'torch' or 'fused'"
        )
        if wire == "paper":
            for size in (bin_size_conv, bin_size_fc, *overrides.values()):
                bin_word_bits(size)  # raises for L_T > 16384, which 14-bit offsets cannot address
        self.bin_size_conv = bin_size_conv
        self.bin_size_fc = bin_size_fc
        self.bin_sizes = overrides
        self.scale_factor = float(scale_factor)
        self.quantizer = quantizer
        self.selection = selection
        self.local_count = local_count
        self.wire = wire
        self.backend = backend
        # each group's fresh gradient (by its names), bin layout and counts (by names, shapes, device, L_T)
        self._flat_gradients: dict[tuple[str, ...], Tensor] = {}
        self._layouts: dict[tuple[object, ...], BinLayout] = {}
        self._counts: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}
        #: per parameter name: layer type and L_T, filled at first compression
        self.layer_kinds: dict[str, LayerKind] = {}
        self.layer_bin_sizes: dict[str, int] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "compressor": "AdaComp",
            "bin_size_conv": self.bin_size_conv,
            "bin_size_fc": self.bin_size_fc,
            "bin_sizes": dict(self.bin_sizes),
            "scale_factor": self.scale_factor,
            "quantizer": self.quantizer,
            "selection": self.selection,
            "local_count": self.local_count,
            "wire": self.wire,
            "backend": self.backend,
        }

    def bin_size(self, name: str, shape: torch.Size) -> int:
        """L_T of a parameter: the first matching ``bin_sizes`` pattern, else by :func:`layer_kind`."""
        for pattern, size in self.bin_sizes.items():
            if fnmatch.fnmatchcase(name, pattern):
                return size
        return self.bin_size_conv if layer_kind(name, shape) == "conv" else self.bin_size_fc

    # -- the group code (a single tensor is a group of one) ---------------------------------------------
    #: the kernel sets that run the groups (:mod:`~lightning_gradcomp.compressors.adacomp_kernels`)
    providers = ADACOMP_KERNELS

    def _flat_settings(self) -> bool:
        """Whether the settings have a batched form: the adaptive selection and the paper's wire."""
        return self.selection == "adaptive" and self.wire == "paper"

    @property
    def batched(self) -> bool:
        """Whether the ``*_flat`` methods run a fixed number of ops per group: :meth:`_flat_settings` on the torch
        backend (the path CUDA runs), or on the fused backend with the compiled kernels (one call per group). The
        other settings loop over the group's layers inside the group methods."""
        return self._flat_settings() and (self._torch_ops_form() or kernels.fused_available())

    def _bin_sizes(self, segments: Segments) -> tuple[int, ...]:
        sizes = tuple(self.bin_size(name, shape) for name, shape in zip(segments.names, segments.shapes))
        for name, shape, size in zip(segments.names, segments.shapes, sizes):
            self.layer_kinds[name] = layer_kind(name, shape)
            self.layer_bin_sizes[name] = size
        return sizes

    def _bin_counts(self, segments: Segments, device: torch.device, sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """Each layer's L_T and number of bins, int64 ``[layers]`` on ``device`` (built once per group and L_T)."""
        key = (segments.names, segments.shapes, device, sizes)
        counts = self._counts.get(key)
        if counts is None:
            bin_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
            counts = self._counts[key] = (bin_sizes, -(-segments.lengths(device) // bin_sizes))
        return counts

    def bin_layout(self, segments: Segments, device: torch.device, sizes: tuple[int, ...]) -> BinLayout:
        """The group's bins (built once per group, device and L_T)."""
        key = (segments.names, segments.shapes, device, sizes)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = BinLayout.build(segments, sizes, device)
        return layout

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None  # no statistic is shared (and the default would visit every layer to learn it)

    def observe_gradient_flat(self, flat: Tensor, segments: Segments) -> None:
        self._flat_gradients[segments.names] = flat

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        dw = self._flat_gradients.pop(segments.names, None)
        if dw is None:
            raise RuntimeError(
                f"Expected this step's gradient of {list(segments.names)} apart from its residue (H = residue + 2 dW) "
                "but got none. Fix: call `observe_gradient_flat(grad, segments)` before `compress_flat` (the gradcomp hook "
                "does), or `per_tensor(compressor).observe_gradient(grad, name)` before its `compress`."
            )
        # selected in float32 whatever the gradients' dtype (widening bf16 or fp16 is exact)
        g = flat.detach().float()
        dw = dw.detach().float()
        device = g.device
        sizes = self._bin_sizes(segments)
        numels = segments.lengths(device)
        bin_sizes, bins = self._bin_counts(segments, device, sizes)
        if self.wire == "index32":
            payload, nbytes, scale, counts = self._encode_index32(g, dw, segments, sizes)
        elif self.selection == "adaptive":  # in a fixed number of ops, by the kernels
            payload, nbytes, scale, counts = self.kernels(device).encode_adaptive(g, dw, segments, sizes)
        else:
            send, scale = self._select(g, dw, segments, sizes)
            payload, nbytes = encode_words(g, send, scale, segments, bins, lambda: self.bin_layout(segments, device, sizes))
            counts = segments.reduce(send.to(torch.int64), "sum")
        numels_f = numels.double()
        # in float64 then rounded once, as Python floats would compute them per layer
        stats = {
            "sparsity": (1.0 - counts / numels_f.clamp(min=1)).float(),
            "sent_per_bin": (counts / bins.clamp(min=1).double()).float(),
            "scale": scale,
            "bin_size": bin_sizes.float(),
            # the paper's effective compression rate: fp32 bits over bits sent (an empty payload counts as 1 byte,
            # to stay finite)
            "compression_rate": (4.0 * numels_f / nbytes.clamp(min=1)).float(),
        }
        return FlatPacket(payload, segments, flat.dtype, nbytes, ctx={"bin_sizes": sizes}, stats=stats)

    def _select(self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """Algorithm 2's selection by torch ops: (the send mask ``[total]``, each layer's scale ``[layers]``); the
        adaptive selection over the whole group at once, the local one layer after layer."""
        ternary = self.quantizer == "ternary"
        if self.selection == "adaptive":
            layout = self.bin_layout(segments, g.device, sizes)
            return select_bins(g, g + (self.scale_factor - 1.0) * dw, layout, segments, ternary)
        layers = [g[offset : offset + n] for offset, n in zip(segments.offsets, segments.numels)]
        picks = [local_send(x, size, self.local_count) for x, size in zip(layers, sizes)]
        send = torch.cat([mask.reshape(-1) for mask, _ in picks])
        scale = torch.stack([s for _, s in picks])
        if ternary:
            send &= 2 * g.abs() >= segments.expand(scale)  # nearest of {-s, 0, s} is not 0
        return send, scale

    def _encode_index32(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The index32 wire, layer after layer: (payload, bytes, scale, sent count per layer). The compiled kernels'
        adaptive selection runs per layer, the torch ops select over the group first."""
        picks, scale = self.kernels(g.device).select_layers(
            g, dw, segments, sizes, lambda: self._select(g, dw, segments, sizes)
        )
        parts = [encode_index32(idx, signs, layer_scale) for idx, signs, layer_scale in picks]
        payload = torch.cat(parts) if parts else g.new_zeros(0, dtype=torch.uint8)
        nbytes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=g.device)
        return payload, nbytes, scale, torch.tensor([p[0].numel() for p in picks], dtype=torch.int64, device=g.device)

    # -- decoding ---------------------------------------------------------------------------------------
    def _packet_sizes(self, packet: FlatPacket) -> tuple[int, ...]:
        """The packet's L_T per layer: its context's (a per-layer packet's group of one has no name), else by name."""
        sizes = packet.ctx.get("bin_sizes")
        return tuple(sizes) if sizes is not None else self._bin_sizes(packet.segments)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        out = torch.zeros(packet.segments.total, dtype=torch.float32, device=packet.payload.device)
        return self._sum_into([packet], out).to(packet.dtype)

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return self.decompress_flat(packet)

    def _sum_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' decoded sum written into ``out`` (float32), rank after rank onto zeros (each rank's entries are
        distinct positions, the rest adds 0: a dense loop's sums): one compiled kernel call (CPU, the paper's wire),
        the Triton decode, or torch ops."""
        segments = packets[0].segments
        sizes = self._packet_sizes(packets[0])
        if self.wire == "index32":
            out.zero_()
            for packet in packets:
                if packet.payload.numel():
                    out.index_add_(0, *self._decode_index32(packet))
            return out
        return self.kernels(out.device).sum_words_into(packets, out, segments, sizes)

    def _decode_index32(self, packet: FlatPacket) -> tuple[Tensor, Tensor]:
        """(group indices, float32 values) of an index32 packet, layer after layer (its sizes read on the host)."""
        nbytes = packet.layer_nbytes
        sizes = nbytes.tolist() if isinstance(nbytes, Tensor) else list(nbytes)
        raw = packet.payload.reshape(-1).view(torch.uint8)
        indices, values, at = [], [], 0
        for offset, size in zip(packet.segments.offsets, sizes):
            if size:
                idx, val = decode_index32(raw[at : at + size])
                indices.append(idx + offset)
                values.append(val)
            at += size
        return torch.cat(indices), torch.cat(values)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        if packets[0].dtype != torch.float32 or out.dtype != torch.float32:
            # the ranks' decoded tensors summed in the gradients' dtype: the base class's rank-order sum of
            # decompress_flat
            return super().decompress_flat_mean_into(packets, out)
        return self._sum_into(packets, out).div_(len(packets))
