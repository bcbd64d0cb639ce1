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
"""

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp_flat import (
    BinLayout,
    bin_mean,
    decode_group_words,
    encode_group_kernels,
    encode_group_words,
    select_bins,
)
from lightning_gradcomp.compressors.backends import BACKENDS, Backend
from lightning_gradcomp.compressors.base import Aggregation, FlatPacket, Packet, SharedStatistic
from lightning_gradcomp.compressors.sparse_fused import FusedAdaComp, FusedSumCompressor, decode_sum
from lightning_gradcomp.kernels import triton_adacomp
from lightning_gradcomp.exchange.segments import Segments
from lightning_gradcomp.wire.sparse import (
    bin_word_bits,
    decode_bin_relative,
    encode_bin_relative,
    pack_codes,
    packed_codes_nbytes,
    unpack_codes,
)
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


class AdaComp(FusedSumCompressor[FusedAdaComp]):
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
        self._offer_kernels(FusedAdaComp(self))
        self._gradients: dict[str, Tensor] = {}
        # the batched path: each group's fresh gradient (by its names) and bin layout (by names, shapes, device, L_T)
        self._flat_gradients: dict[tuple[str, ...], Tensor] = {}
        self._layouts: dict[tuple[object, ...], BinLayout] = {}
        self._kernel_tables: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}
        self._triton_tables: dict[tuple[object, ...], triton_adacomp.Tables] = {}
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

    @staticmethod
    def _bins(flat: Tensor, size: int) -> Tensor:
        """``flat`` as [bins, size]; the last, partial bin is padded with zeros (which are never sent)."""
        n = flat.numel()
        pad = -(-n // size) * size - n
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad)))
        return flat.view(-1, size)

    # -- the algorithm ----------------------------------------------------------------------------------
    def observe_gradient(self, grad: Tensor, name: str) -> None:
        self._gradients[name] = grad

    def select(self, g: Tensor, dw: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Algorithm 2 on a flat layer: the sent indices, their ternary values and the layer scale.

        Args:
            g: G = residue + dW, flat float32.
            dw: dW, flat float32.
            size: the bin length L_T.
        """
        n = g.numel()
        if n == 0:
            return g.new_zeros(0, dtype=torch.long), g.new_zeros(0, dtype=torch.long), g.new_zeros(())
        fused = self._kernels(g.device)
        if self.selection == "adaptive" and fused is not None:
            return fused.select(g, dw, size)
        bins = self._bins(g, size)
        mag = bins.abs()
        gmax = mag.amax(dim=1)
        scale = bin_mean(gmax, torch.tensor([gmax.numel()], device=g.device)).reshape(())  # as the batched path sums
        if self.selection == "adaptive":
            h = self._bins(g + (self.scale_factor - 1.0) * dw, size)
            send = h.abs() >= gmax[:, None]
        else:
            k = min(self.local_count, size)
            top = torch.topk(mag, k, dim=1).indices
            send = torch.zeros_like(mag, dtype=torch.bool).scatter_(1, top, True)
        send &= bins != 0
        if self.quantizer == "ternary":
            send &= 2 * mag >= scale  # nearest of {-s, 0, s} is not 0
        idx = torch.nonzero(send.reshape(-1)[:n]).reshape(-1)
        values = torch.sign(g[idx]).long()
        return idx, values, scale

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        dw_raw = self._gradients.pop(name, None)
        if dw_raw is None:
            raise RuntimeError(
                f"AdaComp needs this step's gradient of {name!r} apart from its residue (H = residue + 2 dW). "
                "Fix: call `observe_gradient(grad, name)` before `compress` (the gradcomp hook does)."
            )
        g = tensor.detach().reshape(-1).float()
        dw = dw_raw.detach().reshape(-1).float()
        size = self.bin_size(name, tensor.shape)
        self.layer_kinds[name] = layer_kind(name, tensor.shape)
        self.layer_bin_sizes[name] = size
        idx, values, scale = self.select(g, dw, size)
        payload = self._encode(idx, values, scale, size)
        n = g.numel()
        num_bins = -(-n // size)
        dev = g.device
        stats = {
            "sparsity": torch.tensor(1.0 - idx.numel() / max(n, 1), device=dev),
            "sent_per_bin": torch.tensor(idx.numel() / max(num_bins, 1), device=dev),
            "scale": scale.detach().reshape(()),
            "bin_size": torch.tensor(float(size), device=dev),
            # the paper's effective compression rate: fp32 bits over bits sent (an empty payload counts as
            # 1 byte, to stay finite)
            "compression_rate": torch.tensor(4.0 * n / max(payload.numel(), 1), device=dev),
        }
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, ctx={"bin_size": size}, stats=stats)

    # -- wire -------------------------------------------------------------------------------------------
    def _encode(self, idx: Tensor, values: Tensor, scale: Tensor, size: int) -> Tensor:
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=scale.device)
        head = scale.float().reshape(1).view(torch.uint8)
        if self.wire == "paper":
            if self._kernels(idx.device) is not None:
                return torch.cat((head, kernels.bin_words_encode(idx, values + 1, size)))
            return torch.cat((head, encode_bin_relative(idx, values + 1, size)))
        count = torch.tensor([idx.numel()], dtype=torch.int32, device=idx.device).view(torch.uint8)
        return torch.cat(
            (count, head, idx.to(torch.int32).view(torch.uint8), pack_codes((values > 0).long(), 1))
        )

    def _decode(self, payload: Tensor, size: int) -> tuple[Tensor, Tensor]:
        if self.wire == "paper":
            scale = payload[:4].clone().view(torch.float32)
            idx, codes = decode_bin_relative(payload[4:], size)
            return idx, (codes - 1).float() * scale
        k = int(payload[:4].clone().view(torch.int32)[0])
        scale = payload[4:8].clone().view(torch.float32)
        idx = payload[8 : 8 + 4 * k].clone().view(torch.int32).long()
        signs = unpack_codes(payload[8 + 4 * k : 8 + 4 * k + packed_codes_nbytes(k, 1)], k, 1)
        return idx, torch.where(signs == 1, 1.0, -1.0) * scale

    def decompress(self, packet: Packet) -> Tensor:
        if self.wire == "paper" and packet.payload.numel() > 0 and self._kernels(packet.payload.device) is not None:
            # one pass; sent values are +-scale, never 0, so this equals the assignment below bit for bit
            decoded = kernels.bin_words_decode_sum(packet.numel, [packet.payload], packet.ctx["bin_size"])
            return decoded.to(packet.dtype).view(packet.shape)
        out = torch.zeros(packet.numel, dtype=torch.float32, device=packet.payload.device)
        if packet.payload.numel() > 0:
            idx, val = self._decode(packet.payload, packet.ctx["bin_size"])
            out[idx] = val
        return out.to(packet.dtype).view(packet.shape)

    # -- a group of layers in one flat tensor (adacomp_flat) --------------------------------------------
    def _flat_settings(self) -> bool:
        """Whether the settings have a batched form: the adaptive selection and the paper's wire."""
        return self.selection == "adaptive" and self.wire == "paper"

    @property
    def batched(self) -> bool:  # type: ignore[override]
        """Whether the ``*_flat`` methods run a fixed number of ops per group: :meth:`_flat_settings` on the torch
        backend (the path CUDA runs), or on the fused backend with the compiled kernels (one call per group)."""
        torch_ops = self.backend == "torch" if self._chosen is None else not self._chosen
        return self._flat_settings() and (torch_ops or kernels.fused_available())

    def batch_on(self, flat: Tensor, segments: Segments) -> bool:
        """Batched for the settings of :meth:`_flat_settings` and float32 gradients, on every backend (the compiled
        kernels' group call on the CPU, torch ops or Triton on CUDA)."""
        return self._flat_settings() and flat.dtype == torch.float32

    def _bin_sizes(self, segments: Segments) -> tuple[int, ...]:
        sizes = tuple(self.bin_size(name, shape) for name, shape in zip(segments.names, segments.shapes))
        for name, shape, size in zip(segments.names, segments.shapes, sizes):
            self.layer_kinds[name] = layer_kind(name, shape)
            self.layer_bin_sizes[name] = size
        return sizes

    def _layout(self, segments: Segments, device: torch.device, sizes: tuple[int, ...]) -> BinLayout:
        key = (segments.names, segments.shapes, device, sizes)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = BinLayout.build(segments, sizes, device)
        return layout

    def _kernel_args(self, segments: Segments, sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """The group's offsets and bin lengths as int64 CPU tensors, for the group kernels."""
        key = (segments.names, segments.shapes, "kernel", sizes)
        args = self._kernel_tables.get(key)
        if args is None:
            args = self._kernel_tables[key] = (torch.tensor(segments.offsets), torch.tensor(sizes, dtype=torch.int64))
        return args

    def _tables(self, segments: Segments, device: torch.device, sizes: tuple[int, ...]) -> triton_adacomp.Tables:
        key = (segments.names, segments.shapes, device, sizes)
        tables = self._triton_tables.get(key)
        if tables is None:
            word_bytes = [bin_word_bits(size) // 8 for size in sizes]
            tables = self._triton_tables[key] = triton_adacomp.Tables(segments.numels, sizes, word_bytes, device)
        return tables

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None  # no statistic is shared (and the default would visit every layer to learn it)

    def observe_gradient_flat(self, flat: Tensor, segments: Segments) -> None:
        if self.batch_on(flat, segments):
            self._flat_gradients[segments.names] = flat
        else:
            super().observe_gradient_flat(flat, segments)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        if not self.batch_on(flat, segments):
            return super().compress_flat(flat, segments, shared)
        dw = self._flat_gradients.pop(segments.names, None)
        if dw is None:
            raise RuntimeError(
                f"AdaComp needs this step's gradient of {list(segments.names)} apart from its residue (H = residue "
                "+ 2 dW). Fix: call `observe_gradient_flat(grad, segments)` before `compress_flat` (the hook does)."
            )
        g = flat.detach()
        dw = dw.detach().float()
        device = g.device
        sizes = self._bin_sizes(segments)
        fused = self._kernels(device)
        ternary = self.quantizer == "ternary"
        numels = torch.tensor(segments.numels, dtype=torch.int64, device=device)
        bin_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        bins = -(-numels // bin_sizes)
        if fused is not None:  # one kernel call
            payload, nbytes, scale, counts = kernels.adacomp_group_encode(
                g, fused.look_ahead(g, dw), *self._kernel_args(segments, sizes), ternary
            )
        elif segments.total and self.uses_triton(g):  # four launches (bin maxima, selection, compaction)
            payload, nbytes, scale, counts = encode_group_kernels(
                g.contiguous(), dw.contiguous(), self.scale_factor - 1.0, self._layout(segments, device, sizes),
                self._tables(segments, device, sizes), ternary,
            )
        else:
            layout = self._layout(segments, device, sizes)
            send, scale = select_bins(g, g + (self.scale_factor - 1.0) * dw, layout, segments, ternary)
            if segments.total:
                payload, nbytes = encode_group_words(g, send, scale, layout, segments)
            else:
                payload, nbytes = g.new_zeros(0, dtype=torch.uint8), bins.clone()
            counts = segments.reduce(send.to(torch.int64), "sum")
        numels_f = numels.double()
        # in float64 then rounded once, as the per-layer packets compute them in Python floats
        stats = {
            "sparsity": (1.0 - counts / numels_f.clamp(min=1)).float(),
            "sent_per_bin": (counts / bins.clamp(min=1).double()).float(),
            "scale": scale,
            "bin_size": bin_sizes.float(),
            "compression_rate": (4.0 * numels_f / nbytes.clamp(min=1)).float(),
        }
        return FlatPacket(payload, segments, flat.dtype, nbytes, stats=stats)

    def _decode_group(self, packet: FlatPacket) -> tuple[Tensor, Tensor]:
        device = packet.payload.device
        nbytes = torch.as_tensor(packet.layer_nbytes, dtype=torch.int64, device=device)
        layout = self._layout(packet.segments, device, self._bin_sizes(packet.segments))
        return decode_group_words(packet.payload, nbytes, layout)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        if packet.layers is not None:
            return super().decompress_flat(packet)
        out = torch.zeros(packet.segments.total, dtype=torch.float32, device=packet.payload.device)
        return self._sum_into([packet], out).to(packet.dtype)

    def _sum_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' decoded sum written into ``out`` (float32): one compiled kernel call (CPU), or rank after rank
        onto zeros by the Triton decode or the torch ops (each rank's entries are distinct positions, the rest adds 0:
        the dense loop's sums)."""
        segments = packets[0].segments
        if self._kernels(out.device) is not None and out.is_contiguous():
            sizes = [torch.as_tensor(p.layer_nbytes, dtype=torch.int64) for p in packets]
            args = self._kernel_args(segments, self._bin_sizes(segments))
            return kernels.adacomp_group_decode_sum([p.payload for p in packets], sizes, *args, out=out)
        out.zero_()
        if self.uses_triton(out) and out.is_contiguous():  # two launches per rank, in rank order
            tables = self._tables(segments, out.device, self._bin_sizes(segments))
            for packet in packets:
                nbytes = torch.as_tensor(packet.layer_nbytes, dtype=torch.int64, device=out.device)
                triton_adacomp.decode_add(packet.payload.reshape(-1).contiguous(), nbytes, tables, out)
            return out
        for packet in packets:
            if packet.payload.numel():
                out.index_add_(0, *self._decode_group(packet))
        return out

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        if packets[0].layers is not None or packets[0].dtype != torch.float32 or out.dtype != torch.float32:
            # looping packets, or a sum the loop makes in the gradients' dtype: the base class's rank-order sum
            return super().decompress_flat_mean_into(packets, out)
        return self._sum_into(packets, out).div_(len(packets))

    def _fused_sum(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """The sum of the packets written into ``out`` (contiguous float32) by the kernels."""
        first = packets[0]
        if self.wire == "paper":  # decoded and scatter-added in one pass per payload
            flat = out.view(-1)
            kernels.bin_words_decode_sum(first.numel, [p.payload for p in packets], first.ctx["bin_size"], out=flat)
            return out.view(first.shape)
        return decode_sum(packets, lambda p: self._decode(p.payload, p.ctx["bin_size"]), out=out)
