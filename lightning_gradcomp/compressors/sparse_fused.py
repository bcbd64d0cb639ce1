"""AdaComp's fused backend through :mod:`lightning_gradcomp.kernels` (Gradient Dropping, written at group level,
calls the kernels' group forms itself: ``compressors/graddrop.py``).

The same maths as the torch backend (the compressor's own torch ops), with fewer passes over the tensor:

* AdaComp: H = G + (c - 1) dW in a reused buffer (:meth:`FusedAdaComp.look_ahead`), for the group kernels
  (:func:`~lightning_gradcomp.kernels.adacomp_group_encode`: bin maxima, selection and the paper's wire words of
  every layer in one call); the ``index32`` wire's selection one layer at a time (:meth:`FusedAdaComp.select`:
  :func:`~lightning_gradcomp.kernels.adacomp_select`, then the G = 0 and ternary rules on the selected entries).
* Decoding the sum of N ranks' payloads: one dense output, each payload scatter-added in rank order
  (:func:`~lightning_gradcomp.kernels.sparse_decode_sum`; AdaComp's paper wire decoded in the same pass,
  :func:`~lightning_gradcomp.kernels.adacomp_group_decode_sum`) instead of N dense decodes and N - 1 dense adds.

What is exactly the same as the torch backend, and what is not:

* The selected set, its order, the sent values and the payload bytes are bit-identical for AdaComp's adaptive
  selection with both quantizers and wires; tests compare both backends byte for byte.
* The decoded sum equals the torch backend's value for value (``torch.equal``); only an element whose every
  contribution is -0.0 sums to +0.0 instead of -0.0 (the dense sum starts from +0.0). Every rank runs the
  same code on the same payloads in rank order, so replicas stay bit-identical.
* AdaComp's ``selection="local"`` (a top-k per bin) has no kernel: it stays on torch ops.

The fused class reads its compressor's settings through the protocol declared here (at each call, so a scheduled
setting reaches it): the compressor module imports this one, never the reverse.
"""

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Optional, Protocol, TypeVar

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp_flat import bin_mean
from lightning_gradcomp.compressors.backends import KernelBacked
from lightning_gradcomp.compressors.base import Packet

F = TypeVar("F")


def decode_sum(
    packets: Sequence[Packet], decode: Callable[[Packet], tuple[Tensor, Tensor]], out: Optional[Tensor] = None
) -> Tensor:
    """The dense float32 sum of sparse packets, scatter-added payload by payload in the given (rank) order.

    Args:
        packets: one packet per rank, in rank order (empty payloads contribute nothing).
        decode: (indices, float32 values) of one non-empty packet.
        out: a contiguous float32 tensor of the packets' numel to write into (overwritten), or None.
    """
    first = packets[0]
    pairs = [decode(p) for p in packets if p.payload.numel() > 0]
    indices, values = [i for i, _ in pairs], [v for _, v in pairs]
    if out is None:
        out = torch.empty(first.numel, dtype=torch.float32, device=first.payload.device)
    return kernels.sparse_decode_sum(first.numel, indices, values, out=out.view(-1)).view(first.shape)


def _writes_into(packets: Sequence[Packet], out: Tensor) -> bool:
    """Whether the kernels can decode straight into ``out``: float32 gradients and a contiguous float32
    destination (the kernels write flat float32)."""
    return (
        packets[0].dtype == torch.float32
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.numel() == packets[0].numel
    )


class FusedSumCompressor(KernelBacked[F]):
    """A sparse compressor whose ranks' sum the kernels decode (AdaComp).

    Subclasses offer their fused implementation (:meth:`_offer_kernels`) and implement :meth:`_fused_sum`; the
    torch backend, and gradients that are not float32 (the torch backend adds decoded tensors in the gradient's
    dtype), keep the base class's sums.
    """

    @abstractmethod
    def _fused_sum(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """The sum of ``packets`` written into ``out`` (contiguous float32, overwritten) by the kernels."""

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        first = packets[0]
        if first.dtype != torch.float32 or self._kernels(first.payload.device) is None:
            return super().decompress_sum(packets)
        return self._fused_sum(packets, torch.empty(first.numel, dtype=torch.float32, device=first.payload.device))

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        if not _writes_into(packets, out) or self._kernels(packets[0].payload.device) is None:
            return super().decompress_sum_into(packets, out)
        self._fused_sum(packets, out)
        return out


class AdaCompSettings(Protocol):
    """The settings of :class:`~lightning_gradcomp.compressors.AdaComp` the fused path reads (at each call)."""

    @property
    def scale_factor(self) -> float: ...

    @property
    def quantizer(self) -> str: ...


class FusedAdaComp:
    """AdaComp's fused adaptive selection.

    Args:
        settings: the compressor's settings, read at each call (a schedule may change them between steps).
    """

    def __init__(self, settings: AdaCompSettings) -> None:
        self.settings = settings
        # H lives here between its computation and the selection: one buffer the size of the largest parameter,
        # reused, because a fresh one per tensor costs its page faults (as much as the selection itself)
        self._scratch: Optional[Tensor] = None

    def look_ahead(self, g: Tensor, dw: Tensor) -> Tensor:
        """H = G + (scale_factor - 1) dW, bit for bit the torch backend's ``g + (c - 1) * dw``."""
        n = g.numel()
        if self._scratch is None or self._scratch.numel() < n or self._scratch.device != g.device:
            self._scratch = torch.empty(n, dtype=torch.float32, device=g.device)
        h = self._scratch[:n]
        factor = self.settings.scale_factor - 1.0
        if factor == 1.0:  # the paper's H = G + dW (an fma by 1 rounds once, like the plain sum)
            return torch.add(g, dw, out=h)
        torch.mul(dw, factor, out=h)
        return h.add_(g)  # (c - 1) dW + G: float addition commutes

    def select(self, g: Tensor, dw: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """AdaComp's adaptive selection of one layer (its ``index32`` wire's): the sent indices, ternary values and
        scale."""
        sel = kernels.adacomp_select(g, self.look_ahead(g, dw), size)
        scale = bin_mean(sel.gmax, torch.tensor([sel.gmax.numel()], device=g.device)).reshape(())
        keep = sel.values != 0  # G = 0 is never sent
        if self.settings.quantizer == "ternary":
            keep &= 2 * sel.values.abs() >= scale  # nearest of {-s, 0, s} is not 0
        values = sel.values[keep]
        return sel.index[keep].long(), torch.sign(values).long(), scale


__all__ = ["FusedAdaComp", "FusedSumCompressor", "decode_sum"]
