"""Lightning callbacks: per-layer pipeline steps (clipping, momentum correction), monitoring, evaluation."""

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.callbacks.clipping import SigmaClip, SigmaClipping
from lightning_gradcomp.callbacks.ema import ExponentialMovingAverage

__all__ = ["ExponentialMovingAverage", "PipelineCallback", "SigmaClip", "SigmaClipping"]
