"""Character-level language modelling (next-character cross-entropy)."""

import math
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from gradcomp_lab.tasks.base import OptimizerName, TrainingTask


class CharLanguageModel(TrainingTask):
    """Trains a model mapping ``(B, T)`` character ids to ``(B, T, V)`` logits on next-character targets.

    Logs ``train_loss``; ``val_loss``, ``val_bpc`` (bits per character) and ``val_acc`` (next-character
    accuracy); the same with ``test_``. Per-character averages are weighted by the characters in each batch.

    Args:
        model: e.g. :class:`~gradcomp_lab.models.CharLSTM`.
        optimizer: see :class:`~gradcomp_lab.tasks.base.TrainingTask` (also for the remaining args;
            char-rnn uses ``"adam"``-like RMSprop at 2e-3 with gradient clipping 5: set the Trainer's
            ``gradient_clip_val``).
        lr: base learning rate.
        **kwargs: the remaining :class:`~gradcomp_lab.tasks.base.TrainingTask` options (learning
            rate schedule, weight decay, ...), forwarded unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerName = "adam",
        lr: float = 2e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, optimizer, lr, **kwargs)
        self.save_hyperparameters(ignore=["model"])
        self.val_loss, self.val_acc = MeanMetric(), MeanMetric()
        self.test_loss, self.test_acc = MeanMetric(), MeanMetric()

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss + self.regularization()

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        logits = self.model(x).flatten(0, 1)
        loss_metric, acc_metric = (self.val_loss, self.val_acc) if stage == "val" else (self.test_loss, self.test_acc)
        loss_metric(F.cross_entropy(logits, y.flatten()), weight=y.numel())
        acc_metric((logits.argmax(-1) == y.flatten()).float().mean(), weight=y.numel())
        self.log(f"{stage}_loss", loss_metric, prog_bar=True)
        self.log(f"{stage}_acc", acc_metric)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def on_validation_epoch_end(self) -> None:
        self.log("val_bpc", self.val_loss.compute() / math.log(2.0))

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def on_test_epoch_end(self) -> None:
        self.log("test_bpc", self.test_loss.compute() / math.log(2.0))
