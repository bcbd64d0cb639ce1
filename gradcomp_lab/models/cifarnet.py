"""CifarNet (the TF CIFAR-10 tutorial model used by TernGrad and WeightGrad) and AdaComp's CIFAR10-CNN."""

import torch
from torch import Tensor, nn

from gradcomp_lab.models.layers import SameMaxPool2d, WithinChannelLRN, same_out, tf_lrn, trunc_normal_tf_
from lightning_gradcomp.validation import check_int


class CifarNet(nn.Module):
    """conv 64@5x5 -> pool 3/2 -> LRN -> conv 64@5x5 -> LRN -> pool 3/2 -> fc 384 -> fc 192 -> logits.

    NOTES.md §1.4 (TF tutorial ``cifar10.py``): SAME padding everywhere, ReLU after every conv and hidden fc,
    LRN(depth_radius 4, bias 1, alpha 0.001/9, beta 0.75), truncated-normal init (std 0.05 convs, 0.04 fc,
    1/192 logits), biases 0 (conv1, logits) or 0.1 (conv2, fc3, fc4). 1,068,298 parameters at 24x24.

    Args:
        num_classes: output logits.
        in_channels: input channels.
        image_size: input height = width (24 after the tutorial's crop).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 24) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=1)
        check_int("image_size", image_size, minimum=1)
        size = same_out(same_out(image_size, 2), 2)
        self.conv1 = nn.Conv2d(in_channels, 64, 5, padding=2)
        self.pool1 = SameMaxPool2d(3, 2)
        self.norm1 = tf_lrn(4, 1.0, 0.001 / 9.0, 0.75)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.norm2 = tf_lrn(4, 1.0, 0.001 / 9.0, 0.75)
        self.pool2 = SameMaxPool2d(3, 2)
        self.fc3 = nn.Linear(size * size * 64, 384)
        self.fc4 = nn.Linear(384, 192)
        self.logits = nn.Linear(192, num_classes)
        init = ((self.conv1, 0.05, 0.0), (self.conv2, 0.05, 0.1), (self.fc3, 0.04, 0.1), (self.fc4, 0.04, 0.1))
        for layer, std, bias in (*init, (self.logits, 1.0 / 192.0, 0.0)):
            trunc_normal_tf_(layer.weight, std)
            assert layer.bias is not None  # every layer above is built with its default bias=True
            nn.init.constant_(layer.bias, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(self.pool1(torch.relu(self.conv1(x))))
        x = self.pool2(self.norm2(torch.relu(self.conv2(x))))
        x = torch.relu(self.fc3(x.flatten(1)))
        return self.logits(torch.relu(self.fc4(x)))

    def regularized_parameters(self) -> list[Tensor]:
        """The tutorial applies L2 weight decay (0.004) to the fc3 and fc4 weights only."""
        return [self.fc3.weight, self.fc4.weight]


class Cifar10CNN(nn.Module):
    """AdaComp's CIFAR10-CNN (Table 2: 3 conv 5x5 + ReLU, 1 FC, 0.3 MB): Caffe's ``cifar10_full``.

    conv 32 -> maxpool 3/2 -> ReLU -> LRN -> conv 32 -> ReLU -> avgpool 3/2 -> LRN -> conv 64 -> ReLU ->
    avgpool 3/2 -> fc. Pools round up (Caffe), LRN is within-channel (3x3, alpha 5e-5, beta 0.75), init is
    Gaussian (std 1e-4, 0.01, 0.01, fc 0.1) with zero biases. 89,578 parameters at 32x32.

    Args:
        num_classes: output logits.
        in_channels: input channels.
        image_size: input height = width.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=1)
        check_int("image_size", image_size, minimum=4)
        size = image_size
        for _ in range(3):
            size = -(-(size - 3) // 2) + 1  # Caffe pooling: ceil((size - kernel) / stride) + 1
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.ReLU(),
            WithinChannelLRN(3, 5e-5, 0.75),
            nn.Conv2d(32, 32, 5, padding=2),
            nn.ReLU(),
            nn.AvgPool2d(3, 2, ceil_mode=True),
            WithinChannelLRN(3, 5e-5, 0.75),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.AvgPool2d(3, 2, ceil_mode=True),
        )
        self.fc = nn.Linear(64 * size * size, num_classes)
        convs = [m for m in self.features if isinstance(m, nn.Conv2d)]
        layers: list[nn.Conv2d | nn.Linear] = [*convs, self.fc]
        for layer, std in zip(layers, (1e-4, 0.01, 0.01, 0.1)):
            nn.init.normal_(layer.weight, std=std)
            assert layer.bias is not None  # every layer above is built with its default bias=True
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x).flatten(1))
