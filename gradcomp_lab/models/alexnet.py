"""AlexNet as in TernGrad's TF code (``inception/slim/models.py``): two towers, BN on the convs, LRN, SAME convs."""

from collections import OrderedDict
from typing import Literal

from torch import Tensor, nn

from gradcomp_lab.models.layers import CenterOnlyBatchNorm2d, SamePad2d, tf_lrn, trunc_normal_tf_, weights
from lightning_gradcomp.validation import check_choice, check_int, check_number


class AlexNet(nn.Module):
    """conv1 96@11x11/4 -> conv2 256@5x5 -> conv3 384 -> conv4 384 -> conv5 256 -> fc6 4096 -> fc7 4096 -> logits.

    Follows TernGrad's TF model (NOTES.md §1.4): TF ``SAME`` convs (conv1's padding is asymmetric), ReLU, then
    LRN (depth radius 2, bias 2, alpha 1e-4, beta 0.75) after conv1 and conv2, 3x3/2 ``VALID`` max pools after
    conv1, conv2, conv5. ``groups=2`` is the two-tower split (conv2, conv4, conv5 see only their tower; conv1 and
    conv3 see everything, as two 48-/192-filter convs on the full input do). With ``batch_norm`` each conv is
    followed by inception-slim's batch norm (shift only, no scale, eps 1e-3, moving-average decay 0.9997) and
    has no bias. ``init="terngrad"``: truncated normal std 0.01 (convs, logits) and 0.005 (fc6, fc7); biases
    0.1, except conv1, conv3 and the logits (0). An adaptive 6x6 average pool (identity at 224x224) lets tests
    use small inputs.

    Args:
        num_classes: output logits.
        in_channels: input channels.
        dropout: dropout ratio before fc7 and the logits (TernGrad script: keep_prob 0.8, i.e. 0.2; float 0.5).
        batch_norm: BN after each conv.
        lrn: LRN after conv1 and conv2.
        groups: 2 for the two-tower model, 1 for a single tower.
        bn_momentum: PyTorch BN momentum (``1 - 0.9997`` in the TernGrad code).
        init: ``"terngrad"`` or ``"torch"`` (PyTorch defaults).
        classifier_width: width of fc6 and fc7 (4096 in the paper; 38M of the 61M parameters are fc6's).
    """

    def __init__(
        self,
        num_classes: int = 1000,
        in_channels: int = 3,
        dropout: float = 0.5,
        batch_norm: bool = True,
        lrn: bool = True,
        groups: int = 2,
        bn_momentum: float = 0.0003,
        init: Literal["terngrad", "torch"] = "terngrad",
        classifier_width: int = 4096,
    ) -> None:
        super().__init__()
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        check_number("bn_momentum", bn_momentum, minimum=0.0, maximum=1.0)
        check_choice("init", init, ("terngrad", "torch"))
        check_int("classifier_width", classifier_width, minimum=1)
        if groups not in (1, 2):
            raise ValueError(f"Expected `groups` to be 1 or 2, but got {groups!r}.")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"Expected `num_classes` to be an integer >= 1, but got {num_classes!r}.")

        def conv(c_in: int, c_out: int, kernel: int, stride: int, n_groups: int, bias: float) -> list[nn.Module]:
            layer = nn.Conv2d(c_in, c_out, kernel, stride, padding=0, groups=n_groups, bias=not batch_norm)
            self._init(layer, 0.01, bias, init)
            norm = [CenterOnlyBatchNorm2d(c_out, 1e-3, bn_momentum)] if batch_norm else []
            return [SamePad2d(kernel, stride), layer, *norm, nn.ReLU(inplace=True)]

        def norm() -> list[nn.Module]:
            return [tf_lrn(2, 2.0, 1e-4, 0.75)] if lrn else []

        self.features = nn.Sequential(
            *conv(in_channels, 96, 11, 4, 1, 0.0), *norm(), nn.MaxPool2d(3, 2),
            *conv(96, 256, 5, 1, groups, 0.1), *norm(), nn.MaxPool2d(3, 2),
            *conv(256, 384, 3, 1, 1, 0.0),
            *conv(384, 384, 3, 1, groups, 0.1),
            *conv(384, 256, 3, 1, groups, 0.1), nn.MaxPool2d(3, 2),
        )  # fmt: skip
        self.pool = nn.AdaptiveAvgPool2d((6, 6))
        fc6 = nn.Linear(256 * 6 * 6, classifier_width)
        fc7, logits = nn.Linear(classifier_width, classifier_width), nn.Linear(classifier_width, num_classes)
        for layer, std, bias in ((fc6, 0.005, 0.1), (fc7, 0.005, 0.1), (logits, 0.01, 0.0)):
            self._init(layer, std, bias, init)
        # named so that parameter patterns read like the paper: "classifier.logits.*"
        self.classifier = nn.Sequential(
            OrderedDict(
                fc6=fc6, relu6=nn.ReLU(inplace=True), dropout6=nn.Dropout(dropout),
                fc7=fc7, relu7=nn.ReLU(inplace=True), dropout7=nn.Dropout(dropout),
                logits=logits,
            )
        )  # fmt: skip

    @staticmethod
    def _init(layer: nn.Conv2d | nn.Linear, std: float, bias: float, init: str) -> None:
        if init == "terngrad":
            trunc_normal_tf_(layer.weight, std)
            if layer.bias is not None:
                nn.init.constant_(layer.bias, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))

    def regularized_parameters(self) -> list[nn.Parameter]:
        """Conv and fc weights (the TF code's weight decay 0.0005 covers weights only)."""
        return weights(self)
