"""Per-layer gradient clipping inside the hook, before compression: one design, two rules.

* :class:`SigmaClipping` (TernGrad Eq. 21): clip each element of a worker's layer gradient at ``c * sigma``
  of that layer.
* :class:`LocalGradientClipping` (DGC): rescale each worker's layer gradient to an L2 norm of at most
  ``max_norm * N**-0.5``. With i.i.d. worker gradients the norm of one worker's gradient is about
  ``N**0.5`` times the norm of the N-worker average, so this matches clipping the average at ``max_norm``.

Both are a :class:`Clip` transform (the rule) attached by a :class:`ClippingCallback` (the Lightning side).
Clipping happens before anything accumulates: a clipping callback must come before
:class:`~lightning_gradcomp.callbacks.MomentumCorrection` in ``trainer.callbacks`` (DGC clips before adding
to its momentum and accumulator), and refuses to be attached after it.

The per-layer norm is a deliberate reading of DGC: its threshold is stated for "the gradient", but inside
DDP's per-bucket hook the whole model's norm is not known before the first bucket must be sent.
"""

from abc import abstractmethod

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.exchange.host import HookHost
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.validation import check_number


class Clip(LayerTransform):
    """A clipping rule applied to each worker's own layer gradient before compression."""

    def __init__(self) -> None:
        #: share of elements changed by the clip in the last step, per parameter (0-d tensors, no host sync)
        self.clipped_fraction: dict[str, Tensor] = {}

    @abstractmethod
    def clip(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        """The clipped gradient (a new tensor) and the share of its elements the clip changed."""

    @override
    def before_compress(self, grad: Tensor, name: str) -> Tensor:
        clipped, fraction = self.clip(grad)
        self.clipped_fraction[name] = fraction
        return clipped


class SigmaClip(Clip):
    """Clip each element of a worker's gradient at ``c * sigma`` of that tensor (TernGrad Eq. 21).

    sigma is the population standard deviation of the tensor's elements (mean subtracted), computed on each
    worker's own gradient, so every worker clips at its own threshold (the paper's form).
    """

    def __init__(self, clip_factor: float) -> None:
        super().__init__()
        self.clip_factor = clip_factor

    @override
    def clip(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        threshold = self.clip_factor * grad.float().std(correction=0)
        fraction = (grad.abs() > threshold).float().mean()
        return torch.maximum(torch.minimum(grad, threshold), -threshold).to(grad.dtype), fraction


class NormClip(Clip):
    """Rescale a worker's layer gradient to an L2 norm of at most ``max_norm * world_size**exponent``.

    Args:
        max_norm: the threshold for the averaged gradient.
        exponent: how the threshold scales with the number of workers (DGC: -0.5); set at :meth:`setup`.
    """

    def __init__(self, max_norm: float, exponent: float = -0.5) -> None:
        super().__init__()
        self.max_norm = max_norm
        self.exponent = exponent
        self.threshold = max_norm

    @override
    def setup(self, names: list[str], rank: int, world_size: int) -> None:
        self.threshold = self.max_norm * world_size**self.exponent

    @override
    def clip(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        norm = grad.float().norm()
        # no host sync: the factor is 1 when the norm is within the threshold
        factor = torch.clamp(self.threshold / (norm + 1e-12), max=1.0)
        return (grad * factor).to(grad.dtype), (factor < 1.0).float()


class ClippingCallback(PipelineCallback):
    """Base of callbacks that attach a :class:`Clip`; checks it runs before any accumulating transform."""

    @abstractmethod
    def make_clip(self, strategy: HookHost) -> Clip:
        """Build the clip rule (validating it against the strategy's configuration)."""

    @override
    def make_transform(self, strategy: HookHost) -> LayerTransform:
        from lightning_gradcomp.callbacks.momentum import MomentumCorrect

        if any(isinstance(t, MomentumCorrect) for t in strategy.transforms):
            raise ValueError(
                f"Expected {type(self).__name__} to run before MomentumCorrection (DGC clips each gradient before "
                f"it enters the momentum and the accumulator), but MomentumCorrection is attached first. "
                f"Fix: list {type(self).__name__} before MomentumCorrection in the Trainer's `callbacks`."
            )
        return self.make_clip(strategy)


class SigmaClipping(ClippingCallback):
    """Clip every compressed layer's gradient at ``clip_factor`` standard deviations before compression.

    Works with any compressor of a :class:`~lightning_gradcomp.GradCompStrategy`. TernGrad already clips by
    itself (its ``clip_factor``); using both is refused rather than clipping twice.

    Args:
        clip_factor: c in c*sigma; the TernGrad paper uses 2.5.
    """

    def __init__(self, clip_factor: float = 2.5) -> None:
        super().__init__()
        check_number("clip_factor", clip_factor, minimum=0.0, min_open=True, fix="use 2.5 (the TernGrad paper)")
        self.clip_factor = float(clip_factor)

    @override
    def make_clip(self, strategy: HookHost) -> Clip:
        own = getattr(strategy.compressor, "clip_factor", 0.0)
        if own:
            raise ValueError(
                f"Expected one sigma clipping, but the compressor {type(strategy.compressor).__name__} already clips "
                f"with `clip_factor={own}` and SigmaClipping is attached too. Fix: set the compressor's "
                f"`clip_factor=0` to clip with the callback, or remove the SigmaClipping callback."
            )
        return SigmaClip(self.clip_factor)


class LocalGradientClipping(ClippingCallback):
    """DGC's local gradient clipping: each worker clips its layer gradient's L2 norm at ``max_norm * N**-0.5``.

    Args:
        max_norm: the norm threshold meant for the averaged gradient; each of the N workers clips its own
            gradient at ``max_norm / sqrt(N)``.
    """

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        check_number("max_norm", max_norm, minimum=0.0, min_open=True, fix="use the norm you would clip plain SGD at")
        self.max_norm = float(max_norm)

    @override
    def make_clip(self, strategy: HookHost) -> Clip:
        return NormClip(self.max_norm, exponent=-0.5)
