"""Gradient compressors: pure tensor code, usable without a process group."""

from lightning_gradcomp.compressors.adacomp import AdaComp
from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.terngrad import TernGrad

__all__ = ["AdaComp", "Aggregation", "Compressor", "GradientDropping", "Identity", "Packet", "TernGrad"]
