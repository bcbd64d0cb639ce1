"""Lightning callbacks of the package (one export line per callback)."""

from lightning_gradcomp.callbacks.ema import ExponentialMovingAverage  # noqa: F401
