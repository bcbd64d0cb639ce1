"""``CompressionProgressBar``: the compression ratio in the progress bar, with no logger and no monitor.

:class:`~lightning_gradcomp.GradCompStrategy` adds it to every Trainer it runs in (unless a
:class:`~lightning_gradcomp.callbacks.CompressionMonitor` already shows the ratio), so compression is visible from
the first run: ``comp_ratio`` (fp32 bytes / bytes this rank sent per step, averaged over the run so far) beside
``loss`` and ``v_num``, and in ``trainer.progress_bar_metrics``.
"""

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.exchange.hook import GradCompState
from lightning_gradcomp.exchange.ledger import ByteReport

#: progress bar key of the current compression ratio
PROGRESS_BAR_KEY = "comp_ratio"


def show_compression_ratio(
    strategy: ByteReport, pl_module: "pl.LightningModule", shown: Optional[float], force: bool
) -> Optional[float]:
    """Put the strategy's compression ratio in the progress bar if it changed (or ``force``); returns what shows.

    The ratio is ``strategy.dense_bytes_per_step() / strategy.bytes_per_step()``
    (:class:`~lightning_gradcomp.exchange.ledger.ByteReport`: per rank and step, averaged over the run so far, warm-up
    included; DiLoCo's and WeightGrad's bytes between sites). The progress bar keeps the last value it got and
    ``self.log`` costs tens of microseconds: only changes are sent (a fixed-size compressor's ratio without warm-up
    never changes), plus refreshes when ``force`` (logging steps, epoch starts).
    """
    sent = strategy.bytes_per_step()
    if not sent:
        return shown
    ratio = strategy.dense_bytes_per_step() / sent
    if force or ratio != shown:
        pl_module.log(PROGRESS_BAR_KEY, ratio, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                      rank_zero_only=True)
    return ratio


class CompressionProgressBar(Callback):
    """Show ``comp_ratio`` in the progress bar after every step whose gradient exchange ran (rank 0's view)."""

    def __init__(self) -> None:
        self._state: Optional[GradCompState] = None
        self._seen_calls = 0
        self._shown: Optional[float] = None

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._state = getattr(trainer.strategy, "comm_state", None)
        self._seen_calls = 0 if self._state is None else self._state.ledger.hook_calls
        self._shown = None

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state = self._state
        if state is None or state.ledger.hook_calls == self._seen_calls:
            return  # an accumulation micro-batch: the hook did not run
        self._seen_calls = state.ledger.hook_calls
        if isinstance(trainer.strategy, ByteReport):  # each strategy's own answer (DiLoCo: bytes between sites)
            self._shown = show_compression_ratio(trainer.strategy, pl_module, self._shown, force=batch_idx == 0)
