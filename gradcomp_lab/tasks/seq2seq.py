"""Sequence-to-sequence training (translation-like), teacher-forced, with optional greedy BLEU."""

from typing import Any, Protocol, runtime_checkable

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import BLEUScore
from typing_extensions import override

from gradcomp_lab.tasks.base import OptimizerName, TrainingTask
from lightning_gradcomp.validation import check_int, check_number

PAD_ID, EOS_ID = 0, 3  # gradcomp_lab.data.parallel_text.Vocab


def _tokens(ids: Tensor) -> str:
    out = []
    for i in ids.tolist():
        if i == EOS_ID:
            break
        if i != PAD_ID:
            out.append(str(i))
    return " ".join(out)


@runtime_checkable
class GreedyDecoder(Protocol):
    """A model that BLEU can score: ``greedy_decode(src, src_lengths, max_len)`` returns ``(B, <= max_len)`` ids."""

    def greedy_decode(self, src: Tensor, src_lengths: Tensor, max_len: int) -> Tensor: ...


class Seq2SeqTask(TrainingTask):
    """Token-level cross-entropy on batches ``(src, src_lengths, tgt_in, tgt_out)``, padding ignored.

    Logs ``train_loss``; ``val_loss`` (per target token), ``val_ppl`` and ``val_acc`` (token accuracy); with
    ``bleu=True`` also ``val_bleu`` from greedy decoding (BLEU-4 on token ids, so it equals word BLEU on the
    tokenised text); the same with ``test_``.

    Args:
        model: e.g. :class:`~gradcomp_lab.models.Seq2SeqAttention`; ``model(src, src_lengths, tgt_in)``
            returns ``(B, T, V)`` logits, and ``model.greedy_decode(src, src_lengths, max_len)`` is needed for BLEU.
        label_smoothing: cross-entropy label smoothing.
        bleu: decode greedily during validation/test and report BLEU.
        max_decode_len: longest greedy output.
        optimizer: see :class:`~gradcomp_lab.tasks.base.TrainingTask` (also for the remaining args).
        lr: base learning rate.
        **kwargs: the remaining :class:`~gradcomp_lab.tasks.base.TrainingTask` options (learning
            rate schedule, weight decay, ...), forwarded unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        label_smoothing: float = 0.0,
        bleu: bool = False,
        max_decode_len: int = 60,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, optimizer, lr, **kwargs)
        check_number("label_smoothing", label_smoothing, minimum=0.0, maximum=1.0, max_open=True)
        check_int("max_decode_len", max_decode_len, minimum=1)
        if bleu and not isinstance(model, GreedyDecoder):
            raise ValueError(
                f"Expected `model` to have `greedy_decode(src, src_lengths, max_len)` with `bleu=True`, but got "
                f"{type(model).__name__}. Fix: set `bleu=False` or use e.g. Seq2SeqAttention."
            )
        self.save_hyperparameters(ignore=["model"])
        self.label_smoothing, self.bleu, self.max_decode_len = label_smoothing, bleu, max_decode_len
        self.val_loss, self.val_acc, self.val_bleu = MeanMetric(), MeanMetric(), BLEUScore()
        self.test_loss, self.test_acc, self.test_bleu = MeanMetric(), MeanMetric(), BLEUScore()

    @override
    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> Tensor:
        return self.model(src, src_lengths, tgt_in)

    def _loss(self, logits: Tensor, tgt_out: Tensor, smoothing: float) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID, label_smoothing=smoothing)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        src, src_lengths, tgt_in, tgt_out = batch
        loss = self._loss(self.model(src, src_lengths, tgt_in), tgt_out, self.label_smoothing)
        self.log("train_loss", loss, prog_bar=True)
        return loss + self.regularization()

    def _evaluate(self, batch: Any, stage: str) -> None:
        src, src_lengths, tgt_in, tgt_out = batch
        logits = self.model(src, src_lengths, tgt_in)
        mask = tgt_out != PAD_ID
        n_tokens = int(mask.sum())
        loss_m, acc_m, bleu_m = (
            (self.val_loss, self.val_acc, self.val_bleu) if stage == "val" else (self.test_loss, self.test_acc, self.test_bleu)
        )
        loss_m(self._loss(logits, tgt_out, 0.0), weight=n_tokens)
        acc_m(((logits.argmax(-1) == tgt_out) & mask).sum() / max(n_tokens, 1), weight=n_tokens)
        self.log(f"{stage}_loss", loss_m, prog_bar=True)
        self.log(f"{stage}_acc", acc_m)
        if self.bleu:
            decoder = self.model
            assert isinstance(decoder, GreedyDecoder)  # __init__ checked it when bleu is on
            hypotheses = decoder.greedy_decode(src, src_lengths, self.max_decode_len)
            bleu_m([_tokens(h) for h in hypotheses], [[_tokens(r)] for r in tgt_out])
            self.log(f"{stage}_bleu", bleu_m)

    def _log_ppl(self, stage: str) -> None:
        loss = (self.val_loss if stage == "val" else self.test_loss).compute()
        self.log(f"{stage}_ppl", loss.exp())

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_ppl("val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_ppl("test")
