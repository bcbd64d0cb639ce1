"""The sparse compressors' fused backend: Gradient Dropping and AdaComp through :mod:`lightning_gradcomp.kernels`.

The same maths as the torch backend (the compressors' own torch ops), with fewer passes over the tensor:

* Gradient Dropping: the threshold sample is drawn by :func:`~lightning_gradcomp.kernels.sample_abs` (no
  dense |x|), the floor(R * m)-th smallest sampled value by :func:`~lightning_gradcomp.kernels.kth_smallest`
  (an exact order statistic, like ``torch.kthvalue``), and the survivors |x| > threshold by one compaction
  pass (:func:`~lightning_gradcomp.kernels.select_above`) instead of |x|, a mask, ``nonzero`` and a gather.
* AdaComp: H = G + (c - 1) dW in a reused buffer (:meth:`FusedAdaComp.look_ahead`), for the group kernels
  (:func:`~lightning_gradcomp.kernels.adacomp_group_encode`: bin maxima, selection and the paper's wire words of
  every layer in one call); the ``index32`` wire's selection one layer at a time (:meth:`FusedAdaComp.select`:
  :func:`~lightning_gradcomp.kernels.adacomp_select`, then the G = 0 and ternary rules on the selected entries).
* Decoding the sum of N ranks' payloads: one dense output, each payload scatter-added in rank order
  (:func:`~lightning_gradcomp.kernels.sparse_decode_sum`; AdaComp's paper wire decoded in the same pass,
  :func:`~lightning_gradcomp.kernels.adacomp_group_decode_sum`) instead of N dense decodes and N - 1 dense adds.

What is exactly the same as the torch backend, and what is not:

* The selected set, its order, the sent values, the threshold and the payload bytes are bit-identical for
  every ``sample``, both scopes, every quantizer and wire format (AdaComp's adaptive selection with both
  quantizers and wires); tests compare both backends byte for byte. ``sample="random"`` draws its positions from
  the counter-based stream of :mod:`lightning_gradcomp.kernels.rng` (keyed by seed, rank, parameter name and a
  per-name counter) on both backends: ``hash(i) mod n``, in the kernels as in the torch ops.
* The decoded sum equals the torch backend's value for value (``torch.equal``); only an element whose every
  contribution is -0.0 sums to +0.0 instead of -0.0 (the dense sum starts from +0.0). Every rank runs the
  same code on the same payloads in rank order, so replicas stay bit-identical.
* AdaComp's ``selection="local"`` (a top-k per bin) has no kernel: it stays on torch ops.

The fused classes read their compressor's settings through the protocols declared here (at each call, so a
scheduled setting reaches them) and get the random streams they need: the compressor modules import this one,
never the reverse.
"""

import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Optional, Protocol, TypeVar

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp_flat import bin_mean
from lightning_gradcomp.compressors.backends import KernelBacked
from lightning_gradcomp.compressors.base import Packet
from lightning_gradcomp.compressors.streams import CounterStreams

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
    """A sparse compressor whose ranks' sum the kernels decode (Gradient Dropping, AdaComp).

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


class GradientDroppingSettings(Protocol):
    """The settings of :class:`~lightning_gradcomp.compressors.GradientDropping` the fused path reads (at each call)."""

    @property
    def sample(self) -> str: ...

    @property
    def sample_fraction(self) -> float: ...

    @property
    def min_sample(self) -> int: ...

    @property
    def max_sample(self) -> int: ...

    @property
    def quantize(self) -> str: ...

    @property
    def values(self) -> str: ...


class FusedGradientDropping:
    """Gradient Dropping's fused steps: the threshold's sample and the survivors above a threshold.

    :class:`~lightning_gradcomp.compressors.GradientDropping` composes them with its own threshold selection
    (which keeps the global scope's pool).

    Args:
        settings: the compressor's settings, read at each call (a schedule may change them between steps).
        streams: the random sample's streams (their counters are checkpointed by the compressor).
    """

    def __init__(self, settings: GradientDroppingSettings, streams: CounterStreams) -> None:
        self.settings = settings
        self.streams = streams

    def threshold_sample(self, flat: Tensor, name: str) -> tuple[Tensor, float]:
        """:meth:`GradientDropping.threshold_sample` on the values (not their magnitudes): the same sample
        for ``"exact"`` and ``"strided"``, counter-based random positions for ``"random"``."""
        n = flat.numel()
        if self.settings.sample == "exact" or n == 0:
            return flat.abs(), 1.0
        if self.settings.sample == "strided":
            size = min(self.settings.max_sample, n)
            return kernels.sample_abs(flat, size, "strided"), n / size
        size = max(self.settings.min_sample, math.ceil(self.settings.sample_fraction * n))
        if size >= n:
            return flat.abs(), 1.0
        return kernels.sample_abs(flat, size, "random", self.streams.key(name)), n / size

    def survivors(self, flat: Tensor, thr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(indices, values, fp16 overflow count) of the survivors |x| > ``thr`` of a flat float32 tensor, as
        ``GradientDropping`` selects them on the torch backend."""
        idx, kept = kernels.select_above(flat, thr)  # not at or below the threshold: NaN is sent
        if idx.numel() == 0 and thr > 0:  # nothing above it: every |x| ties with it, send the ties
            idx, kept = kernels.select_above(flat, thr, inclusive=True)
        overflow = flat.new_zeros(())
        if self.settings.quantize == "none" and self.settings.values == "fp16":
            # fp16 would turn these into inf on every rank; they wait in the residual instead (counted)
            fits = ~(kept.abs() > torch.finfo(torch.float16).max)
            overflow = (~fits).sum().float()
            idx, kept = idx[fits], kept[fits]
        return idx.long(), kept, overflow


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


__all__ = ["FusedAdaComp", "FusedGradientDropping", "FusedSumCompressor", "decode_sum"]
