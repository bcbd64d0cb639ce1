"""WeightGrad (Akter & Adnan, KDD 2020): two-level LAN/WAN training with ternary gradients and weights."""

from lightning_gradcomp.weightgrad.quantize import decode, encode, loss_aware_ternary, stochastic_ternary
from lightning_gradcomp.weightgrad.significance import SignificanceFilter
from lightning_gradcomp.weightgrad.strategy import GatheredFP32, WeightGradStrategy
from lightning_gradcomp.weightgrad.synchronizer import GradientSynchronizer

__all__ = [
    "GatheredFP32",
    "GradientSynchronizer",
    "SignificanceFilter",
    "WeightGradStrategy",
    "decode",
    "encode",
    "loss_aware_ternary",
    "stochastic_ternary",
]
