"""WeightGrad (Akter & Adnan, KDD 2020): two-level LAN/WAN training with ternary gradients and weights."""

import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp._deprecated import moved_names as _moved_names
from lightning_gradcomp.compressors.loss_aware import LossAwareTernary
from lightning_gradcomp.compressors.terngrad_group import ternary_from_uniforms
from lightning_gradcomp.weightgrad.quantize import WanMessage, decode, encode
from lightning_gradcomp.weightgrad.significance import SignificanceFilter
from lightning_gradcomp.weightgrad.strategy import GatheredFP32, WeightGradStrategy
from lightning_gradcomp.weightgrad.synchronizer import GradientSynchronizer

__all__ = [
    "GatheredFP32",
    "GradientSynchronizer",
    "SignificanceFilter",
    "WanMessage",
    "WeightGradStrategy",
    "decode",
    "encode",
]


def _loss_aware_ternary(x: Tensor, d: Optional[Tensor] = None, iterations: int = 10) -> tuple[Tensor, Tensor]:
    """``(alpha, b)`` of :meth:`LossAwareTernary.ternarize` under the metric ``d`` (``None``: all ones)."""

    class _Metric(LossAwareTernary):
        def metric(self, name: str) -> Optional[Tensor]:
            return None if d is None else d.detach().float()

    b, alpha = _Metric(iterations=iterations).ternarize(x)
    return alpha, b.view(x.shape)


def _stochastic_ternary(x: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``(scale, b)`` of TernGrad's unbiased ternarization with scale ``max|x|`` (``E[scale * b] == x``), its
    uniforms drawn from ``generator``, which moves on: every call a fresh draw, as the function always did."""
    xf = x.detach().float()
    scale = xf.abs().max() if xf.numel() else xf.new_zeros(())
    u = torch.rand(xf.shape, generator=generator, device=xf.device)
    return scale, ternary_from_uniforms(xf, u, scale)


_DEPRECATED_QUANTIZERS = {"loss_aware_ternary": ("LossAwareTernary(...).ternarize", _loss_aware_ternary),
                          "stochastic_ternary": ("TernGrad(clip_factor=0.0, ...).ternarize", _stochastic_ternary)}

# spellings of an earlier release, kept for one more with a DeprecationWarning (not in __all__): the sites serve
# every site strategy, not WeightGrad only
_moved = _moved_names(__name__, {
    "SiteGroups": "lightning_gradcomp.sites.layout:SiteGroups",
    "SiteLayout": "lightning_gradcomp.sites.layout:SiteLayout",
    "new_site_groups": "lightning_gradcomp.sites.layout:new_site_groups",
    "register": "lightning_gradcomp.weightgrad.strategy:register",
    "site_layout": "lightning_gradcomp.sites.layout:site_layout",
}, stacklevel=3)


def __getattr__(name: str) -> Any:
    # the WAN quantizers became compressors: their function spellings still work for one release
    if name in _DEPRECATED_QUANTIZERS:
        replacement, function = _DEPRECATED_QUANTIZERS[name]
        warnings.warn(f"`{__name__}.{name}` is deprecated and will be removed in the next release; WeightGrad's WAN "
                      f"quantizers are compressors. Fix: use `{replacement}`.", DeprecationWarning, stacklevel=2)
        return function
    return _moved(name)
