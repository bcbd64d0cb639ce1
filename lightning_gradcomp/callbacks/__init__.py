"""Lightning callbacks: per-layer pipeline steps (clipping, momentum correction) and monitoring."""

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.callbacks.clipping import SigmaClip, SigmaClipping
from lightning_gradcomp.callbacks.clipping import Clip, ClippingCallback, LocalGradientClipping, NormClip
from lightning_gradcomp.callbacks.momentum import MomentumCorrect, MomentumCorrection
from lightning_gradcomp.callbacks.schedule import CompressionSchedule

__all__ = ["PipelineCallback", "SigmaClip", "SigmaClipping"]
__all__ += ["Clip", "ClippingCallback", "CompressionSchedule", "LocalGradientClipping", "MomentumCorrect",
            "MomentumCorrection", "NormClip"]
