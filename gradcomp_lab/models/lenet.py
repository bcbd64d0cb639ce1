"""LeNet as in TernGrad's TF code ("Caffe LeNet" with SAME padding) and AdaComp's MNIST-CNN (VALID)."""

from typing import Literal

import torch
from torch import Tensor, nn

from gradcomp_lab.models.layers import SameMaxPool2d, caffe_xavier_, same_out, trunc_normal_tf_, weights
from lightning_gradcomp.validation import check_choice, check_int


class LeNet(nn.Module):
    """conv 20@5x5 -> maxpool 2/2 -> conv 50@5x5 -> maxpool 2/2 -> fc 500 + ReLU -> fc ``num_classes``.

    NOTES.md §1.4: TernGrad's ``slim/models.lenet`` uses SAME padding, so fc3 sees 7*7*50 inputs
    (7*7*50*500 = 1,225,000 weights, 1,256,080 parameters in all); Caffe's VALID padding gives 4*4*50 inputs
    (431,080 parameters, AdaComp's 1.7 MB MNIST-CNN). TernGrad's ``ops.conv2d`` applies ReLU after each conv
    (its default activation); Caffe's LeNet has none (``conv_relu=False``).

    Args:
        num_classes: output logits.
        in_channels: input channels (1 for MNIST).
        image_size: input height = width (28 for MNIST).
        padding: ``"same"`` (TernGrad) or ``"valid"`` (Caffe).
        init: ``"tf"`` (truncated normal, std 0.05 convs, 0.048 fc3, 0.0767 logits; biases 0, as in the
            TernGrad code), ``"caffe"`` (xavier weights, zero biases) or ``"torch"`` (PyTorch defaults).
        conv_relu: ReLU after each conv (TernGrad's TF code) or not (Caffe).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        padding: Literal["same", "valid"] = "same",
        init: Literal["tf", "caffe", "torch"] = "tf",
        conv_relu: bool = True,
    ) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=1)
        check_int("in_channels", in_channels, minimum=1)
        check_choice("padding", padding, ("same", "valid"))
        check_choice("init", init, ("tf", "caffe", "torch"))
        pad = 2 if padding == "same" else 0
        size = image_size
        for _ in range(2):
            size = same_out(size, 2) if padding == "same" else (size - 4) // 2
        check_int("image_size", image_size, minimum=12 if padding == "valid" else 1)
        self.conv1 = nn.Conv2d(in_channels, 20, 5, padding=pad)
        self.pool1 = SameMaxPool2d(2, 2) if padding == "same" else nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(20, 50, 5, padding=pad)
        self.pool2 = SameMaxPool2d(2, 2) if padding == "same" else nn.MaxPool2d(2, 2)
        self.fc3 = nn.Linear(50 * size * size, 500)
        self.fc4 = nn.Linear(500, num_classes)
        self.act = nn.ReLU() if conv_relu else nn.Identity()
        if init != "torch":
            for layer, std in ((self.conv1, 0.05), (self.conv2, 0.05), (self.fc3, 0.048), (self.fc4, 0.0767)):
                trunc_normal_tf_(layer.weight, std) if init == "tf" else caffe_xavier_(layer.weight)
                assert layer.bias is not None  # every layer above is built with its default bias=True
                nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool2(self.act(self.conv2(self.pool1(self.act(self.conv1(x))))))
        return self.fc4(torch.relu(self.fc3(x.flatten(1))))

    def regularized_parameters(self) -> list[nn.Parameter]:
        """Parameters under the TF code's L2 weight decay: every weight, no bias."""
        return weights(self)


class MnistCNN(LeNet):
    """AdaComp's MNIST-CNN (Table 2: 2 conv 5x5, 2 FC, 1.7 MB): Caffe's LeNet (VALID padding, xavier init, no
    ReLU after the convs).

    Args:
        num_classes: output logits.
        in_channels: input channels.
        image_size: input height = width.
        init: as :class:`LeNet` (default ``"caffe"``).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        init: Literal["tf", "caffe", "torch"] = "caffe",
    ) -> None:
        super().__init__(num_classes, in_channels, image_size, padding="valid", init=init, conv_relu=False)
