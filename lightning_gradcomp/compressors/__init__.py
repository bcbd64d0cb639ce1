"""Gradient compressors: pure tensor code, usable without a process group."""

from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.terngrad import TernGrad

__all__ = ["Aggregation", "Compressor", "Identity", "Packet", "TernGrad"]
