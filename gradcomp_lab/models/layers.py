"""Layers and initialisers shared by the paper models: TF-style SAME pooling, Caffe LRN, TF/Caffe init."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def same_out(size: int, stride: int) -> int:
    """Output size of a TF ``SAME`` convolution or pooling: ``ceil(size / stride)``."""
    return -(-size // stride)


def _same_pads(x: Tensor, kernel_size: int, stride: int) -> list[int]:
    # F.pad order: (left, right, top, bottom); TF puts the odd pixel at the bottom/right
    pads = []
    for size in (x.shape[-1], x.shape[-2]):
        total = max((same_out(size, stride) - 1) * stride + kernel_size - size, 0)
        pads += [total // 2, total - total // 2]
    return pads


class SamePad2d(nn.Module):
    """Zero padding that makes the following ``kernel_size``/``stride`` conv behave like TF's ``SAME``.

    PyTorch's ``padding`` pads both sides equally; TF pads only as needed, more at the bottom/right, which
    matters for strided convs (AlexNet's conv1: 11x11/4 on 224 pads 3 and 4).
    """

    def __init__(self, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x, _same_pads(x, self.kernel_size, self.stride))

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}"


class SameMaxPool2d(nn.Module):
    """``tf.nn.max_pool(..., padding="SAME")``: pads only as needed, more at the bottom/right, with -inf."""

    def __init__(self, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x: Tensor) -> Tensor:
        pads = _same_pads(x, self.kernel_size, self.stride)
        if any(pads):
            x = F.pad(x, pads, value=float("-inf"))
        return F.max_pool2d(x, self.kernel_size, self.stride)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding=SAME"


class CenterOnlyBatchNorm2d(nn.BatchNorm2d):
    """Batch norm with a learned shift (beta) but no scale (gamma): inception-slim's ``batch_norm(scale=False)``.

    Args:
        num_features: channels.
        eps: variance epsilon (slim: 0.001).
        momentum: PyTorch momentum, ``1 - decay`` of TF's moving averages.
    """

    def __init__(self, num_features: int, eps: float = 1e-3, momentum: float = 0.1) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=False)
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.bias.view(1, -1, 1, 1)


def tf_lrn(depth_radius: int, bias: float, alpha: float, beta: float) -> nn.LocalResponseNorm:
    """``tf.nn.lrn`` as ``nn.LocalResponseNorm``.

    TF sums ``alpha * x^2`` over ``2 * depth_radius + 1`` channels; torch divides ``alpha`` by that window size,
    so the torch ``alpha`` is TF's times the window.
    """
    size = 2 * depth_radius + 1
    return nn.LocalResponseNorm(size, alpha=alpha * size, beta=beta, k=bias)


class WithinChannelLRN(nn.Module):
    """Caffe's ``LRN`` with ``norm_region: WITHIN_CHANNEL``: ``x / (1 + alpha/n^2 * sum_{n x n} x^2)^beta``."""

    def __init__(self, local_size: int, alpha: float, beta: float) -> None:
        super().__init__()
        self.local_size, self.alpha, self.beta = local_size, alpha, beta

    def forward(self, x: Tensor) -> Tensor:
        # zero-padded average over the n x n window = Caffe's sum / n^2
        mean_sq = F.avg_pool2d(x * x, self.local_size, stride=1, padding=self.local_size // 2, count_include_pad=True)
        return x / (1.0 + self.alpha * mean_sq).pow(self.beta)


def trunc_normal_tf_(tensor: Tensor, std: float) -> Tensor:
    """``tf.truncated_normal_initializer(stddev=std)``: normal draws, redrawn while beyond two standard deviations.

    Redrawing the ~4.6% outliers is much faster than ``nn.init.trunc_normal_``'s inverse-CDF sampling on
    large fc layers (37M weights: ~0.5 s instead of ~10 s on one CPU core) and is what TF does.
    """
    with torch.no_grad():
        tensor.normal_(0.0, std)
        if tensor.is_meta:
            return tensor
        flat = tensor.view(-1)  # parameters are contiguous
        redraw = (flat.abs() > 2.0 * std).nonzero().squeeze(1)
        while redraw.numel():
            fresh = torch.randn(redraw.numel(), dtype=tensor.dtype, device=tensor.device) * std
            flat[redraw] = fresh
            redraw = redraw[fresh.abs() > 2.0 * std]
    return tensor


def caffe_xavier_(tensor: Tensor) -> Tensor:
    """Caffe's ``xavier`` filler: uniform in ``+-sqrt(3 / fan_in)``."""
    fan_in = tensor[0].numel()
    bound = math.sqrt(3.0 / fan_in)
    with torch.no_grad():
        return tensor.uniform_(-bound, bound)


def weights(module: nn.Module) -> list[nn.Parameter]:
    """Multi-dimensional parameters (conv and linear weights): what TF's ``l2_regularizer`` usually covers."""
    return [p for p in module.parameters() if p.ndim > 1]
