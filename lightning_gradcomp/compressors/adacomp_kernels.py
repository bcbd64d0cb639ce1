"""AdaComp's kernel providers: the operations of its group step (:class:`AdaCompKernels`) on torch ops, on the
compiled CPU kernels (:func:`~lightning_gradcomp.kernels.adacomp_group_encode`: bin maxima, selection and the paper's
wire words of every layer in one call; :func:`~lightning_gradcomp.kernels.adacomp_select` per layer for the
``index32`` wire; :func:`~lightning_gradcomp.kernels.adacomp_group_decode_sum`: every rank's payload decoded and
added in one call) and on Triton's (:mod:`lightning_gradcomp.kernels.triton_adacomp`: bin maxima, selection and
compaction, decode-and-add per rank).

What is exactly the same as the torch ops, and what is not:

* The selected set, its order, the sent values and the payload bytes are bit-identical for the adaptive selection
  with both quantizers and wires; tests compare the providers byte for byte.
* The compiled decode-and-sum equals the torch ops' value for value (``torch.equal``); only an element whose every
  contribution is -0.0 sums to +0.0 instead of -0.0 (the dense sum starts from +0.0). Every rank runs the same
  code on the same payloads in rank order, so replicas stay bit-identical.
* ``selection="local"`` (a top-k per bin) has no kernel: it stays on torch ops, which every provider inherits.

A provider reads its compressor's settings through :class:`AdaCompSettings` (at each call, so a scheduled setting
reaches it): the compressor module imports this one, never the reverse.
"""

from collections.abc import Callable, Sequence
from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp_group import (
    BinLayout,
    bin_mean,
    decode_group_words,
    encode_group_kernels,
    encode_words,
    select_bins,
)
from lightning_gradcomp.compressors.backends import Kernels
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.kernels import triton_adacomp
from lightning_gradcomp.wire.sparse import bin_word_bits

#: one layer's selection for the index32 wire: (sent indices, their signs, the layer's scale)
LayerPick = tuple[Tensor, Tensor, Tensor]


class AdaCompSettings(Protocol):
    """The settings of :class:`~lightning_gradcomp.compressors.AdaComp` its providers read (at each call)."""

    @property
    def scale_factor(self) -> float: ...

    @property
    def quantizer(self) -> str: ...

    @property
    def selection(self) -> str: ...

    def bin_layout(self, segments: Segments, device: torch.device, sizes: tuple[int, ...]) -> BinLayout:
        """The group's bins (built once per group and L_T)."""
        ...


class AdaCompKernels(Protocol):
    """The operations of AdaComp's group step that a kernel set runs; each gives the torch ops' bits."""

    @property
    def name(self) -> str:
        """The kernel set: ``"torch"``, ``"fused"`` or ``"triton"``."""
        ...

    def encode_adaptive(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The adaptive selection in the paper's wire: (payload, bytes, scale, sent count per layer)."""
        ...

    def select_layers(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...],
        select: Callable[[], tuple[Tensor, Tensor]],
    ) -> tuple[list[LayerPick], Tensor]:
        """Every layer's selection for the index32 wire, and the scales ``[layers]`` (``select``: the torch ops'
        selection of the group, a send mask and the scales)."""
        ...

    def sum_words_into(
        self, packets: Sequence[FlatPacket], out: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> Tensor:
        """The ranks' paper-wire payloads decoded and added into ``out`` (float32) in rank order, onto zeros."""
        ...


class TorchAdaComp:
    """AdaComp's group step in torch ops (the reference the other providers equal bit for bit).

    Args:
        settings: the compressor's settings, read at each call (a schedule may change them between steps).
    """

    name: Kernels = "torch"

    def __init__(self, settings: AdaCompSettings) -> None:
        self.settings = settings

    def encode_adaptive(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = self.settings
        layout = s.bin_layout(segments, g.device, sizes)
        send, scale = select_bins(g, g + (s.scale_factor - 1.0) * dw, layout, segments, s.quantizer == "ternary")
        payload, nbytes = encode_words(g, send, scale, segments, layout.bins, lambda: layout)
        return payload, nbytes, scale, segments.reduce(send.to(torch.int64), "sum")

    def select_layers(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...],
        select: Callable[[], tuple[Tensor, Tensor]],
    ) -> tuple[list[LayerPick], Tensor]:
        send, scale = select()
        picks = []
        for s, (offset, n) in enumerate(zip(segments.offsets, segments.numels)):
            idx = torch.nonzero(send[offset : offset + n]).reshape(-1)
            picks.append((idx, torch.sign(g[offset : offset + n][idx]), scale[s]))
        return picks, scale

    def sum_words_into(
        self, packets: Sequence[FlatPacket], out: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> Tensor:
        out.zero_()
        layout = self.settings.bin_layout(segments, out.device, sizes)
        for packet in packets:
            if packet.payload.numel():
                nbytes = torch.as_tensor(packet.layer_nbytes, dtype=torch.int64, device=out.device)
                out.index_add_(0, *decode_group_words(packet.payload, nbytes, layout))
        return out


class CompiledAdaComp(TorchAdaComp):
    """AdaComp's group step in the compiled kernels (their torch-ops forms where they cannot run)."""

    name: Kernels = "fused"

    def __init__(self, settings: AdaCompSettings) -> None:
        super().__init__(settings)
        # H lives here between its computation and the selection: one buffer the size of the largest parameter,
        # reused, because a fresh one per tensor costs its page faults (as much as the selection itself)
        self._scratch: Optional[Tensor] = None
        # each group's offsets and L_T as int64 CPU tensors, by names, shapes and L_T
        self._args: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}

    def kernel_args(self, segments: Segments, sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """The group's offsets and bin lengths as int64 CPU tensors, for the group kernels."""
        key = (segments.names, segments.shapes, sizes)
        args = self._args.get(key)
        if args is None:
            args = self._args[key] = (torch.tensor(segments.offsets), torch.tensor(sizes, dtype=torch.int64))
        return args

    def look_ahead(self, g: Tensor, dw: Tensor) -> Tensor:
        """H = G + (scale_factor - 1) dW, bit for bit the torch ops' ``g + (c - 1) * dw``."""
        n = g.numel()
        if self._scratch is None or self._scratch.numel() < n or self._scratch.device != g.device:
            self._scratch = torch.empty(n, dtype=torch.float32, device=g.device)
        h = self._scratch[:n]
        factor = self.settings.scale_factor - 1.0
        if factor == 1.0:  # the paper's H = G + dW (an fma by 1 rounds once, like the plain sum)
            return torch.add(g, dw, out=h)
        torch.mul(dw, factor, out=h)
        return h.add_(g)  # (c - 1) dW + G: float addition commutes

    def select_layer(self, g: Tensor, dw: Tensor, size: int) -> LayerPick:
        """The adaptive selection of one layer (its ``index32`` wire's): the sent indices, signs and scale."""
        sel = kernels.adacomp_select(g, self.look_ahead(g, dw), size)
        scale = bin_mean(sel.gmax, torch.tensor([sel.gmax.numel()], device=g.device)).reshape(())
        keep = sel.values != 0  # G = 0 is never sent
        if self.settings.quantizer == "ternary":
            keep &= 2 * sel.values.abs() >= scale  # nearest of {-s, 0, s} is not 0
        values = sel.values[keep]
        return sel.index[keep].long(), torch.sign(values).long(), scale

    def encode_adaptive(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ternary = self.settings.quantizer == "ternary"
        return kernels.adacomp_group_encode(g, self.look_ahead(g, dw), *self.kernel_args(segments, sizes), ternary)

    def select_layers(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...],
        select: Callable[[], tuple[Tensor, Tensor]],
    ) -> tuple[list[LayerPick], Tensor]:
        if self.settings.selection != "adaptive":  # the local selection has no kernel
            return super().select_layers(g, dw, segments, sizes, select)
        picks: list[LayerPick] = []
        for offset, n, size in zip(segments.offsets, segments.numels, sizes):
            if n:
                picks.append(self.select_layer(g[offset : offset + n], dw[offset : offset + n], size))
            else:
                picks.append((g.new_zeros(0, dtype=torch.int64), g.new_zeros(0), g.new_zeros(())))
        return picks, torch.stack([p[2] for p in picks]) if picks else g.new_zeros(0)

    def sum_words_into(
        self, packets: Sequence[FlatPacket], out: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> Tensor:
        if not out.is_contiguous():
            return super().sum_words_into(packets, out, segments, sizes)
        layer_nbytes = [torch.as_tensor(p.layer_nbytes, dtype=torch.int64) for p in packets]
        args = self.kernel_args(segments, sizes)
        return kernels.adacomp_group_decode_sum([p.payload for p in packets], layer_nbytes, *args, out=out)


class TritonAdaComp(TorchAdaComp):
    """AdaComp's adaptive selection and paper-wire decode in Triton kernels."""

    name: Kernels = "triton"

    def __init__(self, settings: AdaCompSettings) -> None:
        super().__init__(settings)
        self._tables: dict[tuple[object, ...], triton_adacomp.Tables] = {}

    def tables(self, segments: Segments, device: torch.device, sizes: tuple[int, ...]) -> triton_adacomp.Tables:
        """The kernels' tables of a group on ``device`` (built once per group and L_T)."""
        key = (segments.names, segments.shapes, device, sizes)
        tables = self._tables.get(key)
        if tables is None:
            word_bytes = [bin_word_bits(size) // 8 for size in sizes]
            tables = self._tables[key] = triton_adacomp.Tables(segments.numels, sizes, word_bytes, device)
        return tables

    def encode_adaptive(
        self, g: Tensor, dw: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if not segments.total:  # no tile to launch
            return super().encode_adaptive(g, dw, segments, sizes)
        # four launches (bin maxima, selection, compaction)
        s, device = self.settings, g.device
        return encode_group_kernels(
            g.contiguous(), dw.contiguous(), s.scale_factor - 1.0, s.bin_layout(segments, device, sizes),
            self.tables(segments, device, sizes), s.quantizer == "ternary",
        )

    def sum_words_into(
        self, packets: Sequence[FlatPacket], out: Tensor, segments: Segments, sizes: tuple[int, ...]
    ) -> Tensor:
        if not out.is_contiguous():
            return super().sum_words_into(packets, out, segments, sizes)
        out.zero_()
        tables = self.tables(segments, out.device, sizes)
        for packet in packets:  # two launches per rank, in rank order
            nbytes = torch.as_tensor(packet.layer_nbytes, dtype=torch.int64, device=out.device)
            triton_adacomp.decode_add(packet.payload.reshape(-1).contiguous(), nbytes, tables, out)
        return out


#: AdaComp's provider of each kernel set
ADACOMP_KERNELS: dict[Kernels, type[TorchAdaComp]] = {
    "torch": TorchAdaComp,
    "fused": CompiledAdaComp,
    "triton": TritonAdaComp,
}

__all__ = ["ADACOMP_KERNELS", "AdaCompKernels", "AdaCompSettings", "CompiledAdaComp", "LayerPick", "TorchAdaComp",
           "TritonAdaComp"]
