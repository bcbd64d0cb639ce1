"""Per-layer gradient clipping inside the hook: TernGrad's c*sigma clipping for any compressor."""

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.pipeline import LayerTransform
from lightning_gradcomp.validation import check_number

if TYPE_CHECKING:
    from lightning_gradcomp.strategy import GradCompStrategy


class SigmaClip(LayerTransform):
    """Clip each element of a worker's gradient at ``c * sigma`` of that tensor (TernGrad Eq. 21).

    sigma is the population standard deviation of the tensor's elements (mean subtracted), computed on each
    worker's own gradient, so every worker clips at its own threshold (the paper's form).
    """

    def __init__(self, clip_factor: float) -> None:
        self.clip_factor = clip_factor
        #: share of elements clipped in the last step, per parameter (0-d tensors, no host sync)
        self.clipped_fraction: dict[str, Tensor] = {}

    @override
    def before_compress(self, grad: Tensor, name: str) -> Tensor:
        threshold = self.clip_factor * grad.float().std(correction=0)
        self.clipped_fraction[name] = (grad.abs() > threshold).float().mean()
        return torch.maximum(torch.minimum(grad, threshold), -threshold).to(grad.dtype)


class SigmaClipping(PipelineCallback):
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
    def make_transform(self, strategy: "GradCompStrategy") -> LayerTransform:
        own = getattr(strategy.compressor, "clip_factor", 0.0)
        if own:
            raise ValueError(
                f"Expected one sigma clipping, but the compressor {type(strategy.compressor).__name__} already clips "
                f"with `clip_factor={own}` and SigmaClipping is attached too. Fix: set the compressor's "
                f"`clip_factor=0` to clip with the callback, or remove the SigmaClipping callback."
            )
        return SigmaClip(self.clip_factor)
