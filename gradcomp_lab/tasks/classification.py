"""Image (or any) classification with cross-entropy and accuracy metrics."""

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from gradcomp_lab.tasks.base import OptimizerName, TrainingTask
from lightning_gradcomp.validation import check_int


class ImageClassifier(TrainingTask):
    """Cross-entropy training of ``model``; logs ``train_loss``, ``val_loss``/``val_acc``, ``test_loss``/``test_acc``.

    With ``top_k > 1`` it also logs ``val_acc_top{k}`` and ``test_acc_top{k}`` (ImageNet top-5).

    Args:
        model: the classifier network; its output is ``(B, num_classes)`` logits.
        num_classes: number of classes the metrics expect.
        top_k: also report top-k accuracy for this k (1: only top-1).
        optimizer: see :class:`~gradcomp_lab.tasks.base.TrainingTask` (also for the remaining args).
        lr: base learning rate.
        **kwargs: the remaining :class:`~gradcomp_lab.tasks.base.TrainingTask` options (learning
            rate schedule, weight decay, ...), forwarded unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int = 10,
        top_k: int = 1,
        optimizer: OptimizerName = "momentum",
        lr: float = 0.01,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, optimizer, lr, **kwargs)
        check_int("num_classes", num_classes, minimum=2)
        check_int("top_k", top_k, minimum=1)
        if top_k > num_classes:
            raise ValueError(f"Expected `top_k` to be at most num_classes={num_classes}, but got {top_k}.")
        self.save_hyperparameters(ignore=["model"])
        self.num_classes, self.top_k = num_classes, top_k
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc_top = MulticlassAccuracy(num_classes, top_k=top_k, average="micro") if top_k > 1 else None
        self.test_acc_top = MulticlassAccuracy(num_classes, top_k=top_k, average="micro") if top_k > 1 else None

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def _logits(self, x: Tensor) -> Tensor:
        logits = self.model(x)
        if logits.shape[-1] != self.num_classes:
            raise ValueError(
                f"Expected the model to output {self.num_classes} logits (`num_classes`), but got {logits.shape[-1]}. "
                "Fix: give the task and the model the same `num_classes`."
            )
        return logits

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self._logits(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss + self.regularization()

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        logits = self._logits(x)
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True)
        acc, top = (self.val_acc, self.val_acc_top) if stage == "val" else (self.test_acc, self.test_acc_top)
        acc(logits, y)
        self.log(f"{stage}_acc", acc, prog_bar=True)
        if top is not None:
            top(logits, y)
            self.log(f"{stage}_acc_top{self.top_k}", top)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")
