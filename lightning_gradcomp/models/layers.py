"""Layers and initialisers shared by the paper models: TF-style SAME pooling, Caffe LRN, TF/Caffe init."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def same_out(size: int, stride: int) -> int:
    """Output size of a TF ``SAME`` convolution or pooling: ``ceil(size / stride)``."""
    return -(-size // stride)


class SameMaxPool2d(nn.Module):
    """``tf.nn.max_pool(..., padding="SAME")``: pads only as needed, more at the bottom/right, with -inf.

    PyTorch's ``padding`` pads both sides equally, which shifts the windows relative to TF.
    """

    def __init__(self, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x: Tensor) -> Tensor:
        pads = []
        for size in (x.shape[-1], x.shape[-2]):
            total = max((same_out(size, self.stride) - 1) * self.stride + self.kernel_size - size, 0)
            pads += [total // 2, total - total // 2]
        if any(pads):
            x = F.pad(x, pads, value=float("-inf"))
        return F.max_pool2d(x, self.kernel_size, self.stride)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding=SAME"


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
    """``tf.truncated_normal_initializer(stddev=std)``: normal, redrawn beyond two standard deviations."""
    return nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


def caffe_xavier_(tensor: Tensor) -> Tensor:
    """Caffe's ``xavier`` filler: uniform in ``+-sqrt(3 / fan_in)``."""
    fan_in = tensor[0].numel()
    bound = math.sqrt(3.0 / fan_in)
    with torch.no_grad():
        return tensor.uniform_(-bound, bound)


def weights(module: nn.Module) -> list[nn.Parameter]:
    """Multi-dimensional parameters (conv and linear weights): what TF's ``l2_regularizer`` usually covers."""
    return [p for p in module.parameters() if p.ndim > 1]
