"""Lightning callbacks: per-layer pipeline steps (clipping, momentum correction), monitoring."""

from lightning_gradcomp._deprecated import moved_names as _moved_names
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

# a spelling of an earlier release, kept for one more with a DeprecationWarning (not in __all__). The EMA callback
# is the recipes' (the lab's): the lab is imported only when a script asks for this old name, never when the
# library is imported, so the library still imports and runs without the lab (tests/unit/test_layout.py)
__getattr__ = _moved_names(__name__, {"ExponentialMovingAverage": "gradcomp_lab.ema:ExponentialMovingAverage"})
