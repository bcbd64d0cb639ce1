"""AlexNet (Krizhevsky et al. 2012, two-tower grouping), with batch norm on the convs as in TernGrad."""

from torch import Tensor, nn

from lightning_gradcomp.models.layers import weights
from lightning_gradcomp.validation import check_int, check_number


def _conv(c_in: int, c_out: int, kernel: int, stride: int, padding: int, groups: int, batch_norm: bool) -> list[nn.Module]:
    # with batch norm the conv bias is redundant (slim's conv2d drops it when a normalizer is given)
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel, stride, padding, groups=groups, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(c_out, eps=1e-3))
    layers.append(nn.ReLU(inplace=True))
    return layers


class AlexNet(nn.Module):
    """conv1 96@11x11/4 -> conv2 256@5x5 -> conv3 384 -> conv4 384 -> conv5 256 -> fc6 4096 -> fc7 4096 -> logits.

    ``groups=2`` reproduces the two-tower split (conv2, conv4, conv5 see only their tower's channels);
    ``groups=1`` is the single-tower variant. With ``batch_norm`` (TernGrad, NOTES.md §1.4) every conv is
    followed by BN; without it, LRN follows conv1 and conv2 as in the original. 3x3/2 max pools follow conv1,
    conv2 and conv5; an adaptive 6x6 average pool makes the classifier input size-independent (identity at
    224x224 input).

    Args:
        num_classes: output logits.
        in_channels: input channels.
        dropout: dropout ratio before fc6 and fc7 (0.5 original; TernGrad uses 0.2 with ternary gradients).
        batch_norm: BN after each conv (True) or the original LRN (False).
        groups: 2 for the two-tower model, 1 for a single tower.
    """

    def __init__(
        self, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5, batch_norm: bool = True, groups: int = 2
    ) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=1)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        if groups not in (1, 2):
            raise ValueError(f"Expected `groups` to be 1 or 2, but got {groups!r}.")
        lrn: list[nn.Module] = [] if batch_norm else [nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0)]
        self.features = nn.Sequential(
            *_conv(in_channels, 96, 11, 4, 2, 1, batch_norm), *lrn, nn.MaxPool2d(3, 2),
            *_conv(96, 256, 5, 1, 2, groups, batch_norm), *lrn, nn.MaxPool2d(3, 2),
            *_conv(256, 384, 3, 1, 1, 1, batch_norm),
            *_conv(384, 384, 3, 1, 1, groups, batch_norm),
            *_conv(384, 256, 3, 1, 1, groups, batch_norm), nn.MaxPool2d(3, 2),
        )  # fmt: skip
        self.pool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))

    def regularized_parameters(self) -> list[nn.Parameter]:
        """Conv and fc weights (TernGrad's AlexNet: weight decay 0.0005 on weights)."""
        return weights(self)
