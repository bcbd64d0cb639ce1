"""ResNet-18/34/50/101/152 (He et al. 2016, v1.5: stride on the 3x3 conv of bottlenecks), as in AdaComp Table 2."""

from typing import Union

from torch import Tensor, nn

from lightning_gradcomp.validation import check_int

_LAYOUTS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3)),
            101: ("bottleneck", (3, 4, 23, 3)), 152: ("bottleneck", (3, 8, 36, 3))}  # fmt: skip


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    """Two 3x3 convs with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(c_in, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3))
        self.shortcut = nn.Sequential(*_conv_bn(c_in, width, 1, stride)) if stride != 1 or c_in != width else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return (self.body(x) + self.shortcut(x)).relu()


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with an identity (or projection) shortcut."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * 4
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, c_out, 1),
        )  # fmt: skip
        self.shortcut = nn.Sequential(*_conv_bn(c_in, c_out, 1, stride)) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return (self.body(x) + self.shortcut(x)).relu()


class ResNet(nn.Module):
    """ResNet with the ImageNet stem (7x7/2 conv, 3x3/2 max pool) or a CIFAR stem (3x3 conv, no pool).

    Parameter counts with 1000 classes: 11,689,512 (depth 18; AdaComp's 44.6 MB) and 25,557,032 (depth 50;
    98 MB), the same as the reference torchvision models.

    Args:
        depth: 18, 34, 50, 101 or 152.
        num_classes: output logits.
        in_channels: input channels.
        cifar_stem: replace the ImageNet stem by one 3x3 conv (for 32x32 inputs).
        zero_init_residual: start each block's last BN scale at 0 (Goyal et al.), so blocks begin as identity.
    """

    def __init__(
        self, depth: int = 18, num_classes: int = 1000, in_channels: int = 3, cifar_stem: bool = False, zero_init_residual: bool = False
    ) -> None:
        super().__init__()
        if depth not in _LAYOUTS:
            raise ValueError(f"Expected `depth` to be one of {sorted(_LAYOUTS)}, but got {depth!r}.")
        check_int("num_classes", num_classes, minimum=1)
        kind, counts = _LAYOUTS[depth]
        block: type[Union[BasicBlock, Bottleneck]] = BasicBlock if kind == "basic" else Bottleneck
        if cifar_stem:
            self.stem = nn.Sequential(*_conv_bn(in_channels, 64, 3), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
            )
        stages: list[nn.Module] = []
        c_in = 64
        for index, (count, width) in enumerate(zip(counts, (64, 128, 256, 512))):
            blocks = []
            for j in range(count):
                blocks.append(block(c_in, width, 2 if (j == 0 and index > 0) else 1))
                c_in = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, (BasicBlock, Bottleneck)):
                    last_norm = module.body[-1]
                    assert isinstance(last_norm, nn.BatchNorm2d)  # _conv_bn ends every body with its BN
                    nn.init.zeros_(last_norm.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(-2, -1)))


class ResNet18(ResNet):
    """ResNet-18 (see :class:`ResNet` for the arguments)."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, cifar_stem: bool = False, zero_init_residual: bool = False) -> None:
        super().__init__(18, num_classes, in_channels, cifar_stem, zero_init_residual)


class ResNet50(ResNet):
    """ResNet-50 (see :class:`ResNet` for the arguments)."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, cifar_stem: bool = False, zero_init_residual: bool = False) -> None:
        super().__init__(50, num_classes, in_channels, cifar_stem, zero_init_residual)
