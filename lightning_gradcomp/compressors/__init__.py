"""Gradient compressors: pure tensor code, usable without a process group."""

from lightning_gradcomp.compressors.adacomp import AdaComp
from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.int8 import Int8
from lightning_gradcomp.compressors.loss_aware import LossAwareTernary
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.compressors.cast import BF16, FP16, Cast
from lightning_gradcomp.compressors.demo import DeMo
from lightning_gradcomp.compressors.multiround import AllReduce, Exchanged, MultiRoundCompressor
from lightning_gradcomp.compressors.onebit import OneBit
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.topk import DGC, DGC_PAPER_WARMUP, TopK, dgc_code_warmup

__all__ = ["AdaComp", "Aggregation", "Compressor", "GradientDropping", "Identity", "Packet", "TernGrad"]
__all__ += ["AllReduce", "BF16", "Cast", "DGC", "DeMo", "DGC_PAPER_WARMUP", "Exchanged", "FP16", "Int8", "LossAwareTernary", "MultiRoundCompressor",
            "OneBit", "PowerSGD", "QSGD", "TopK", "dgc_code_warmup"]
