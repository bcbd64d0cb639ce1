"""One synchronisation at the end of ``fit`` for strategies whose ranks are apart between two synchronisations.

DiLoCo and Streaming DiLoCo (local steps between outer rounds) and 0/1 Adam (local steps between 1-bit
synchronisations) leave each rank with its own weights until the next scheduled synchronisation. A ``fit`` that ends
between two would return a different model on every rank, and its last checkpoint would hold rank 0's. Such a
strategy has a ``final_synchronisation()`` (:class:`SynchronisesAtEnd`) and inserts :class:`FinalSynchronisation`
among the callbacks at setup (:meth:`FinalSynchronisation.attach`); the callback calls it once, right after the
last training step, so the checkpoints, the validation and every ``on_train_end`` that follow see the weights every
rank leaves ``fit`` with.
"""

from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, Checkpoint
from typing_extensions import override


@runtime_checkable
class SynchronisesAtEnd(Protocol):
    """A strategy whose ranks may be apart between two synchronisations, and that brings them together on request.

    ``final_synchronisation`` is called on every rank at the same point; it exchanges only when the ranks may be
    apart (a decision from counters identical on every rank), and a second call without a training step between is
    a no-op.
    """

    def final_synchronisation(self) -> None: ...


class FinalSynchronisation(Callback):
    """Calls the strategy's ``final_synchronisation()`` (:class:`SynchronisesAtEnd`) when ``fit`` ends.

    After the last training step (``max_steps`` reached, or the last batch of the last epoch), in that batch's
    ``on_train_batch_end`` after the other callbacks' and before the checkpoint callbacks' (which Lightning runs
    last): the module's own ``on_train_batch_end``, the validation, the checkpoints and ``on_train_end`` that follow
    see the synchronised weights. The other callbacks see the last step as they see every step. Again at
    ``on_train_end``, for a ``fit`` stopped otherwise (early stopping, ``max_time``); a no-op when it already ran.
    """

    @staticmethod
    def attach(trainer: "pl.Trainer") -> None:
        """Insert the callback into ``trainer.callbacks`` once, right before the checkpoint callbacks (or last).

        Called from the strategy's ``setup``, after Lightning moved the checkpoint callbacks to the end of the list.
        """
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if any(isinstance(c, FinalSynchronisation) for c in callbacks):
            return
        at = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
        callbacks.insert(at, FinalSynchronisation())

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, SynchronisesAtEnd) and ends_fit(trainer):
            strategy.final_synchronisation()

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = trainer.strategy
        if isinstance(strategy, SynchronisesAtEnd):
            strategy.final_synchronisation()


def ends_fit(trainer: "pl.Trainer") -> bool:
    """Whether ``fit`` stops after the current batch: ``max_steps`` reached, or the last batch of the last epoch
    (the same on every rank: the step count and the number of batches are)."""
    if 0 <= trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or trainer.current_epoch + 1 < max_epochs:
        return False
    # the epoch loop's own end-of-epoch test (its `_num_ready_batches_reached`)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready == trainer.num_training_batches
