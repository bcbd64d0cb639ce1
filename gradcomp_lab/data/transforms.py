"""Per-sample image transforms written with torch ops (no torchvision), for ``(C, H, W)`` tensors.

Each transform is a small picklable class, so datasets that hold them work with spawned DataLoader workers.
Randomness comes from torch's global generator, which DataLoader seeds per worker.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# ImageNet RGB statistics used by the standard ResNet/GoogLeNet pipelines
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Compose:
    """Apply transforms in order."""

    def __init__(self, transforms: Sequence[object]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Tensor) -> Tensor:
        for transform in self.transforms:
            x = transform(x)  # type: ignore[operator]
        return x

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


class ToUnit:
    """uint8 (or 0..``max_value`` float) pixels to float32 in [0, 1]."""

    def __init__(self, max_value: float = 255.0) -> None:
        self.max_value = max_value

    def __call__(self, x: Tensor) -> Tensor:
        return x.to(torch.float32) / self.max_value


class Symmetric:
    """[0, 1] to [-1, 1] as ``(x - 0.5) * 2`` (TernGrad's LeNet input scaling)."""

    def __call__(self, x: Tensor) -> Tensor:
        return (x - 0.5) * 2.0


class Standardize:
    """Per-channel ``(x - mean) / std`` with fixed dataset statistics."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


class PerImageStandardize:
    """``tf.image.per_image_standardization``: ``(x - mean) / max(std, 1/sqrt(numel))`` over the whole image."""

    def __call__(self, x: Tensor) -> Tensor:
        mean = x.mean()
        # population std, floored so that a constant image does not divide by zero (TF's rule)
        std = x.std(correction=0).clamp_min(1.0 / math.sqrt(x.numel()))
        return (x - mean) / std


class RandomCrop:
    """A uniformly placed ``size x size`` crop (``tf.random_crop``), after optional zero padding."""

    def __init__(self, size: int, padding: int = 0) -> None:
        self.size, self.padding = size, padding

    def __call__(self, x: Tensor) -> Tensor:
        if self.padding:
            x = F.pad(x, (self.padding,) * 4)
        h, w = x.shape[-2:]
        top = int(torch.randint(0, h - self.size + 1, ()))
        left = int(torch.randint(0, w - self.size + 1, ()))
        return x[..., top : top + self.size, left : left + self.size]


class CenterCrop:
    """The central ``size x size`` crop (``tf.image.resize_image_with_crop_or_pad`` when shrinking)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: Tensor) -> Tensor:
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, x: Tensor) -> Tensor:
        return x.flip(-1) if float(torch.rand(())) < self.p else x


class RandomBrightness:
    """``tf.image.random_brightness``: add one delta drawn from U[-max_delta, max_delta] to every pixel."""

    def __init__(self, max_delta: float) -> None:
        self.max_delta = max_delta

    def __call__(self, x: Tensor) -> Tensor:
        return x + (torch.rand(()) * 2.0 - 1.0) * self.max_delta


class RandomContrast:
    """``tf.image.random_contrast``: scale each channel's deviation from its mean by U[lower, upper]."""

    def __init__(self, lower: float, upper: float) -> None:
        self.lower, self.upper = lower, upper

    def __call__(self, x: Tensor) -> Tensor:
        factor = self.lower + torch.rand(()) * (self.upper - self.lower)
        mean = x.mean(dim=(-2, -1), keepdim=True)
        return (x - mean) * factor + mean


def resize(x: Tensor, size: tuple[int, int]) -> Tensor:
    """Bilinear, antialiased resize of a ``(C, H, W)`` float image to ``size = (height, width)``."""
    return F.interpolate(x.unsqueeze(0), size=size, mode="bilinear", align_corners=False, antialias=True)[0]


class ResizeShorter:
    """Resize so that the shorter side is ``size``, keeping the aspect ratio (the eval pipeline's first step)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: Tensor) -> Tensor:
        h, w = x.shape[-2:]
        if h <= w:
            return resize(x, (self.size, max(1, round(w * self.size / h))))
        return resize(x, (max(1, round(h * self.size / w)), self.size))


class RandomResizedCrop:
    """Inception-style crop: random area fraction in ``scale`` and log-uniform aspect ``ratio``, then resize.

    Ten attempts at a crop that fits, then the central crop with the ratio clamped into range (the
    standard ImageNet training transform of the ResNet and GoogLeNet reference pipelines).
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    ) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio

    def _box(self, h: int, w: int) -> tuple[int, int, int, int]:
        area = h * w
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * float(torch.empty(()).uniform_(*self.scale))
            aspect = math.exp(float(torch.empty(()).uniform_(log_lo, log_hi)))
            cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(torch.randint(0, h - ch + 1, ()))
                left = int(torch.randint(0, w - cw + 1, ()))
                return top, left, ch, cw
        aspect = w / h
        if aspect < self.ratio[0]:
            cw, ch = w, round(w / self.ratio[0])
        elif aspect > self.ratio[1]:
            ch, cw = h, round(h * self.ratio[1])
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def __call__(self, x: Tensor) -> Tensor:
        top, left, ch, cw = self._box(*x.shape[-2:])
        return resize(x[..., top : top + ch, left : left + cw], (self.size, self.size))
