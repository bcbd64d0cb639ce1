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

from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp_flat import bin_mean


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


__all__ = ["FusedAdaComp"]
