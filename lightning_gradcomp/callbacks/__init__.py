"""Lightning callbacks: per-layer pipeline steps (clipping, momentum correction) and monitoring."""

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.callbacks.clipping import SigmaClip, SigmaClipping

__all__ = ["PipelineCallback", "SigmaClip", "SigmaClipping"]
