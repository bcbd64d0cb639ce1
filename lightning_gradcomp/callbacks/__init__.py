"""Lightning callbacks: per-layer pipeline steps (clipping, momentum correction) and monitoring."""

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.callbacks.clipping import SigmaClip, SigmaClipping
from lightning_gradcomp.callbacks.monitor import CompressionMonitor

__all__ = ["PipelineCallback", "SigmaClip", "SigmaClipping", "CompressionMonitor"]
