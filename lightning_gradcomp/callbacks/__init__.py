"""Lightning callbacks: per-layer pipeline steps (clipping, momentum correction), monitoring."""

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.callbacks.clipping import (
    Clip,
    ClippingCallback,
    LocalGradientClipping,
    NormClip,
    SigmaClip,
    SigmaClipping,
)
from lightning_gradcomp.callbacks.momentum import MomentumCorrect, MomentumCorrection
from lightning_gradcomp.callbacks.monitor import CompressionMonitor
from lightning_gradcomp.callbacks.progress import CompressionProgressBar
from lightning_gradcomp.callbacks.schedule import CompressionSchedule

__all__ = [
    "Clip",
    "ClippingCallback",
    "CompressionMonitor",
    "CompressionProgressBar",
    "CompressionSchedule",
    "LocalGradientClipping",
    "MomentumCorrect",
    "MomentumCorrection",
    "NormClip",
    "PipelineCallback",
    "SigmaClip",
    "SigmaClipping",
]
