"""VGG-A (VGG-11, Simonyan & Zisserman 2015, configuration A): TernGrad's perf model and WeightGrad's CIFAR runs."""

from torch import Tensor, nn

from gradcomp_lab.models.layers import CenterOnlyBatchNorm2d, weights
from lightning_gradcomp.validation import check_int, check_number

CONFIG_A = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGGA(nn.Module):
    """Eight 3x3 convs in five max-pooled stages, then fc ``classifier_width`` x2 and the logits.

    At 224x224 the classifier sees 7x7x512 (132.9M parameters with 1000 classes); at 32x32 (CIFAR) it sees
    1x1x512. ``image_size`` picks the pooled grid as ``image_size // 32``.

    Args:
        num_classes: output logits.
        in_channels: input channels.
        image_size: input height = width (224 ImageNet, 32 CIFAR-10).
        classifier_width: hidden fc width (4096 in the paper).
        dropout: dropout ratio before the two hidden fc layers.
        batch_norm: BN after every conv, as TernGrad's TF-slim VGG-A does (``normalizer_fn=slim.batch_norm``:
            shift only, no scale, eps 1e-3); Simonyan & Zisserman have none.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        in_channels: int = 3,
        image_size: int = 224,
        classifier_width: int = 4096,
        dropout: float = 0.5,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=1)
        check_int("image_size", image_size, minimum=32)
        check_int("classifier_width", classifier_width, minimum=1)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        layers: list[nn.Module] = []
        channels = in_channels
        for item in CONFIG_A:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            layers.append(nn.Conv2d(channels, int(item), 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(CenterOnlyBatchNorm2d(int(item), eps=1e-3))
            layers.append(nn.ReLU(inplace=True))
            channels = int(item)
        self.features = nn.Sequential(*layers)
        grid = image_size // 32
        self.pool = nn.AdaptiveAvgPool2d((grid, grid))
        self.classifier = nn.Sequential(
            nn.Linear(512 * grid * grid, classifier_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(classifier_width, classifier_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(classifier_width, num_classes),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))

    def regularized_parameters(self) -> list[nn.Parameter]:
        """Conv and fc weights."""
        return weights(self)
