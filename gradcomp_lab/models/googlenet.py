"""GoogLeNet (Inception v1, Szegedy et al. 2015) with batch norm and without the auxiliary classifiers."""

import torch
from torch import Tensor, nn

from gradcomp_lab.models.layers import CenterOnlyBatchNorm2d
from lightning_gradcomp.validation import check_int, check_number


class ConvBN(nn.Sequential):
    """conv (no bias) -> BatchNorm (with or without the scale gamma) -> ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, padding: int = 0, bn_scale: bool = True) -> None:
        norm = nn.BatchNorm2d(c_out, eps=1e-3) if bn_scale else CenterOnlyBatchNorm2d(c_out, eps=1e-3)
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False), norm, nn.ReLU(inplace=True))


class Inception(nn.Module):
    """Four branches concatenated: 1x1; 1x1 -> 3x3; 1x1 -> 5x5 (or 3x3); 3x3 max pool -> 1x1."""

    def __init__(
        self, c_in: int, c1: int, c3_reduce: int, c3: int, c5_reduce: int, c5: int, pool_proj: int, slim: bool = False
    ) -> None:
        super().__init__()
        k = 3 if slim else 5
        scale = not slim
        self.branch1 = ConvBN(c_in, c1, 1, bn_scale=scale)
        self.branch3 = nn.Sequential(ConvBN(c_in, c3_reduce, 1, bn_scale=scale), ConvBN(c3_reduce, c3, 3, padding=1, bn_scale=scale))
        self.branch5 = nn.Sequential(ConvBN(c_in, c5_reduce, 1, bn_scale=scale), ConvBN(c5_reduce, c5, k, padding=k // 2, bn_scale=scale))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), ConvBN(c_in, pool_proj, 1, bn_scale=scale))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x), self.branch_pool(x)], dim=1)


class GoogLeNet(nn.Module):
    """Inception v1 with BN after every conv (TernGrad Table 3: "no auxiliary classifiers, BN on convs").

    Module widths follow Table 1 of Szegedy et al. ``slim=True`` (default) gives the TF-slim ``inception_v1``
    that TernGrad's code trains: the "5x5" branches use 3x3 convs and batch norm has no scale (shift only);
    ``slim=False`` uses real 5x5 convs and BN with scale. Global average pooling before the classifier makes any
    input of at least 32x32 valid (slim's stem pools differ slightly: 2x2 before inception 5; not reproduced).

    Args:
        num_classes: output logits.
        in_channels: input channels.
        dropout: dropout ratio before the classifier (0.4 original; TernGrad: 0.2 float, 0.08 TernGrad).
        slim: the TF-slim variant described above.
    """

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.4, slim: bool = True) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=1)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        scale = not slim
        self.stem = nn.Sequential(
            ConvBN(in_channels, 64, 7, stride=2, padding=3, bn_scale=scale),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            ConvBN(64, 64, 1, bn_scale=scale),
            ConvBN(64, 192, 3, padding=1, bn_scale=scale),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        )
        self.inception3 = nn.Sequential(
            Inception(192, 64, 96, 128, 16, 32, 32, slim), Inception(256, 128, 128, 192, 32, 96, 64, slim), nn.MaxPool2d(3, 2, ceil_mode=True)
        )
        self.inception4 = nn.Sequential(
            Inception(480, 192, 96, 208, 16, 48, 64, slim),
            Inception(512, 160, 112, 224, 24, 64, 64, slim),
            Inception(512, 128, 128, 256, 24, 64, 64, slim),
            Inception(512, 112, 144, 288, 32, 64, 64, slim),
            Inception(528, 256, 160, 320, 32, 128, 128, slim),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        )
        self.inception5 = nn.Sequential(Inception(832, 256, 160, 320, 32, 128, 128, slim), Inception(832, 384, 192, 384, 48, 128, 128, slim))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inception5(self.inception4(self.inception3(self.stem(x))))
        return self.fc(self.dropout(x.mean(dim=(-2, -1))))
