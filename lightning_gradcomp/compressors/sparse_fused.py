"""The sparse compressors' fused backend: Gradient Dropping and AdaComp through :mod:`lightning_gradcomp.kernels`.

The same maths as the torch backend (the compressors' own torch ops), with fewer passes over the tensor:

* Gradient Dropping: the threshold sample is drawn by :func:`~lightning_gradcomp.kernels.sample_abs` (no
  dense |x|), the floor(R * m)-th smallest sampled value by :func:`~lightning_gradcomp.kernels.kth_smallest`
  (an exact order statistic, like ``torch.kthvalue``), and the survivors |x| > threshold by one compaction
  pass (:func:`~lightning_gradcomp.kernels.select_above`) instead of |x|, a mask, ``nonzero`` and a gather.
* AdaComp: bin maxima and the selection |H| >= gmax(bin) in one pass per bin
  (:func:`~lightning_gradcomp.kernels.adacomp_select`) instead of padded copies, |G|, |H|, two masks and
  ``nonzero``; the G = 0 and ternary rules then filter the few selected entries. The paper's wire words are
  written in one pass (:func:`~lightning_gradcomp.kernels.bin_words_encode`).
* Decoding the sum of N ranks' payloads: one dense output, each payload scatter-added in rank order
  (:func:`~lightning_gradcomp.kernels.sparse_decode_sum`; AdaComp's paper wire decoded in the same pass,
  :func:`~lightning_gradcomp.kernels.bin_words_decode_sum`) instead of N dense decodes and N - 1 dense adds.

What is exactly the same as the torch backend, and what is not:

* The selected set, its order, the sent values, the threshold and the payload bytes are bit-identical for
  ``sample="exact"`` and ``"strided"``, both scopes, every quantizer and wire format (AdaComp's adaptive
  selection with both quantizers and wires); tests compare both backends byte for byte.
* ``sample="random"`` draws its sample positions from the counter-based stream of
  :mod:`lightning_gradcomp.kernels.rng` (keyed by seed, rank, parameter name and a per-name counter),
  not from ``torch.Generator``: same sample size, same uniform positions with replacement, different draws,
  so the threshold differs by sampling noise. Given the threshold, everything else is bit-identical.
* The decoded sum equals the torch backend's value for value (``torch.equal``); only an element whose every
  contribution is -0.0 sums to +0.0 instead of -0.0 (the dense sum starts from +0.0). Every rank runs the
  same code on the same payloads in rank order, so replicas stay bit-identical.
* AdaComp's ``selection="local"`` (a top-k per bin) has no kernel: it stays on torch ops.
"""

import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Compressor, Packet
from lightning_gradcomp.kernels.rng import stream_id, stream_key

if TYPE_CHECKING:
    from lightning_gradcomp.compressors.adacomp import AdaComp
    from lightning_gradcomp.compressors.graddrop import GradientDropping

Backend = Literal["auto", "torch", "fused"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "fused")


def fused_enabled(backend: str, device: torch.device) -> bool:
    """Whether a compressor with this ``backend`` takes the fused path for a tensor on ``device``.

    ``"auto"`` is fused on CPU when the compiled kernels load here; ``"fused"`` is fused everywhere (torch-ops
    kernels off CPU or without a compiler); ``"torch"`` never.
    """
    if backend != "auto":
        return backend == "fused"
    return device.type == "cpu" and kernels.fused_available()


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


def _writes_into(packets: Sequence[Packet], out: Tensor, backend: str) -> bool:
    """Whether the kernels can decode straight into ``out``: the fused backend on float32 gradients and a
    contiguous float32 destination (the kernels write flat float32)."""
    return (
        packets[0].dtype == torch.float32
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.numel() == packets[0].numel
        and fused_enabled(backend, packets[0].payload.device)
    )


class FusedSumCompressor(Compressor):
    """A sparse compressor whose ranks' sum the kernels decode (Gradient Dropping, AdaComp).

    Subclasses set ``backend`` and implement :meth:`_fused_sum`; the torch backend, and gradients that are not
    float32 (the torch backend adds decoded tensors in the gradient's dtype), keep the base class's sums.
    """

    backend: str

    @abstractmethod
    def _fused_sum(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """The sum of ``packets`` written into ``out`` (contiguous float32, overwritten) by the kernels."""

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        first = packets[0]
        if first.dtype != torch.float32 or not fused_enabled(self.backend, first.payload.device):
            return super().decompress_sum(packets)
        return self._fused_sum(packets, torch.empty(first.numel, dtype=torch.float32, device=first.payload.device))

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        if not _writes_into(packets, out, self.backend):
            return super().decompress_sum_into(packets, out)
        self._fused_sum(packets, out)
        return out


class FusedGradientDropping:
    """The fused code path of one :class:`~lightning_gradcomp.compressors.GradientDropping` (reads its settings,
    keeps the random sample's per-name counters)."""

    def __init__(self, owner: "GradientDropping") -> None:
        self.owner = owner
        #: random samples drawn so far per parameter name: the counter-based stream's state (with seed, rank)
        self.counters: dict[str, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = dict(state.get("counters", {}))

    def _key(self, name: str) -> tuple[int, int]:
        counter = self.counters.get(name, 0)
        self.counters[name] = counter + 1
        return stream_key(self.owner.seed, self.owner.rank, counter, stream_id(name))

    def threshold_sample(self, flat: Tensor, name: str) -> tuple[Tensor, float]:
        """:meth:`GradientDropping.threshold_sample` on the values (not their magnitudes): the same sample
        for ``"exact"`` and ``"strided"``, counter-based random positions for ``"random"``."""
        owner = self.owner
        n = flat.numel()
        if owner.sample == "exact" or n == 0:
            return flat.abs(), 1.0
        if owner.sample == "strided":
            size = min(owner.max_sample, n)
            return kernels.sample_abs(flat, size, "strided"), n / size
        size = max(owner.min_sample, math.ceil(owner.sample_fraction * n))
        if size >= n:
            return flat.abs(), 1.0
        return kernels.sample_abs(flat, size, "random", self._key(name)), n / size

    def select(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(indices, values, threshold, fp16 overflow count) of the survivors |x| > threshold of a flat float32
        tensor, as :meth:`GradientDropping.compress` builds them on the torch backend."""
        owner = self.owner
        sample, weight = self.threshold_sample(flat, name)
        thr = owner.pooled_threshold(sample, weight, name, select=kth_threshold)
        idx, kept = kernels.select_above(flat, thr)  # not at or below the threshold: NaN is sent
        if idx.numel() == 0 and thr > 0:  # nothing above it: every |x| ties with it, send the ties
            idx, kept = kernels.select_above(flat, thr, inclusive=True)
        overflow = flat.new_zeros(())
        if owner.quantize == "none" and owner.values == "fp16":
            # fp16 would turn these into inf on every rank; they wait in the residual instead (counted)
            fits = ~(kept.abs() > torch.finfo(torch.float16).max)
            overflow = (~fits).sum().float()
            idx, kept = idx[fits], kept[fits]
        return idx.long(), kept, thr, overflow


def kth_threshold(sample: Tensor, ratio: float) -> Tensor:
    """:func:`~lightning_gradcomp.compressors.graddrop.select_threshold` through the order-statistic kernel."""
    from lightning_gradcomp.compressors.graddrop import drop_count  # the owner's module imports this one

    k = drop_count(ratio, sample.numel())
    if k == 0:
        return sample.new_zeros((), dtype=torch.float32)
    return kernels.kth_smallest(sample, k - 1).to(sample.device)


class FusedAdaComp:
    """The fused code path of one :class:`~lightning_gradcomp.compressors.AdaComp` (adaptive selection)."""

    def __init__(self, owner: "AdaComp") -> None:
        self.owner = owner
        # H lives here between its computation and the selection: one buffer the size of the largest parameter,
        # reused, because a fresh one per tensor costs its page faults (as much as the selection itself)
        self._scratch: Optional[Tensor] = None

    def _look_ahead(self, g: Tensor, dw: Tensor) -> Tensor:
        """H = G + (scale_factor - 1) dW, bit for bit the torch backend's ``g + (c - 1) * dw``."""
        n = g.numel()
        if self._scratch is None or self._scratch.numel() < n or self._scratch.device != g.device:
            self._scratch = torch.empty(n, dtype=torch.float32, device=g.device)
        h = self._scratch[:n]
        factor = self.owner.scale_factor - 1.0
        if factor == 1.0:  # the paper's H = G + dW (an fma by 1 rounds once, like the plain sum)
            return torch.add(g, dw, out=h)
        torch.mul(dw, factor, out=h)
        return h.add_(g)  # (c - 1) dW + G: float addition commutes

    def select(self, g: Tensor, dw: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`AdaComp.select` for ``selection="adaptive"``: the sent indices, ternary values and scale."""
        owner = self.owner
        sel = kernels.adacomp_select(g, self._look_ahead(g, dw), size)
        scale = sel.gmax.mean()
        keep = sel.values != 0  # G = 0 is never sent
        if owner.quantizer == "ternary":
            keep &= 2 * sel.values.abs() >= scale  # nearest of {-s, 0, s} is not 0
        values = sel.values[keep]
        return sel.index[keep].long(), torch.sign(values).long(), scale


__all__ = [
    "BACKENDS", "Backend", "FusedAdaComp", "FusedGradientDropping", "decode_sum", "fused_enabled", "kth_threshold",
    "FusedSumCompressor",
]

