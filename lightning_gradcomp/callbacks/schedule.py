"""Warm-up and schedules for compression: any compressor attribute over epochs or steps, and dense first steps.

DGC warms up by raising sparsity epoch by epoch (75%, 93.75%, 98.4375%, 99.6%, 99.9%), and trains the first
epochs dense in some configurations; PowerSGD starts compressing only after a few dense iterations. One
callback covers all of them: before each training batch it sets ``compressor.<attribute>`` to the scheduled
value and tells the hook whether this step is sent dense.

Both decisions depend only on ``trainer.global_step`` / ``trainer.current_epoch``, which every rank advances
identically, so every rank compresses the same step the same way (nothing to agree over the network).
"""

from collections.abc import Sequence
from typing import Literal, Optional, Union, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.compressors.topk import DGC_PAPER_WARMUP
from lightning_gradcomp.exchange.host import HookHost
from lightning_gradcomp.validation import check_choice, check_dense_steps, check_int, resolve_dense_steps, run_steps

Unit = Literal["epoch", "step"]


class CompressionSchedule(Callback):
    """Set a compressor attribute from a list of values over epochs or steps; send the first steps dense.

    Value ``i`` of ``values`` applies during units ``[i * period, (i + 1) * period)``; the last value stays.

    Args:
        attribute: the compressor attribute to schedule (``"ratio"`` for top-k/DGC, ``"levels"`` for QSGD,
            ``"approximation_rank"`` for PowerSGD, ...); ``None`` schedules nothing but ``dense_steps``.
        values: the scheduled values, e.g. :data:`~lightning_gradcomp.compressors.DGC_PAPER_WARMUP`.
        unit: ``"epoch"`` or ``"step"`` (optimizer steps).
        period: units per value.
        dense_steps: the first optimizer steps that are plain fp32 all-reduce: a number of steps (``int``), or a
            fraction of the run (``float`` in (0, 1)) resolved when training starts from the Trainer's ``max_steps``
            (or the steps of ``max_epochs``), to the nearest step and at least one
            (:func:`~lightning_gradcomp.validation.resolve_dense_steps`). A fraction needs a run with an end.

    Attributes:
        steps_dense: ``dense_steps`` resolved to steps (``None`` until training starts with a fraction).

    Example (DGC's paper warm-up over the first 4 epochs, then 99.9% sparsity)::

        Trainer(strategy="dgc", callbacks=[CompressionSchedule.dgc_warmup()])
    """

    def __init__(
        self,
        attribute: Optional[str] = None,
        values: Sequence[float] = (),
        unit: Unit = "epoch",
        period: int = 1,
        dense_steps: Union[int, float] = 0,
    ) -> None:
        check_choice("unit", unit, ("epoch", "step"))
        check_int("period", period, minimum=1)
        check_dense_steps("dense_steps", dense_steps)
        if attribute is not None and not list(values):
            raise ValueError(
                f"Expected `values` to be a non-empty list for `attribute={attribute!r}`, but got {values!r}. "
                f"Fix: e.g. `values={list(DGC_PAPER_WARMUP)}` for DGC's warm-up."
            )
        if attribute is None and list(values):
            raise ValueError(f"Expected `attribute` with `values={list(values)!r}`, but got None. Fix: e.g. 'ratio'.")
        self.attribute = attribute
        self.values = list(values)
        self.unit: Unit = unit
        self.period = period
        self.dense_steps = dense_steps
        self.steps_dense: Optional[int] = dense_steps if isinstance(dense_steps, int) else None
        self.current: Optional[float] = None

    @classmethod
    def dgc_warmup(cls, values: Sequence[float] = DGC_PAPER_WARMUP,
                   dense_steps: Union[int, float] = 0) -> "CompressionSchedule":
        """DGC's exponential sparsity warm-up, one value per epoch (default: the paper's schedule)."""
        return cls(attribute="ratio", values=values, unit="epoch", dense_steps=dense_steps)

    def value_at(self, epoch: int, step: int) -> Optional[float]:
        """The scheduled value for a given epoch and optimizer step (``None`` without an attribute)."""
        if self.attribute is None:
            return None
        index = (epoch if self.unit == "epoch" else step) // self.period
        return self.values[min(index, len(self.values) - 1)]

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, HookHost):
            raise ValueError(
                f"Expected the Trainer's strategy to be a GradCompStrategy for CompressionSchedule, but got "
                f"{type(strategy).__name__}. Fix: use a registered compressor name, e.g. `strategy='dgc'`."
            )
        if self.attribute is not None:
            if not hasattr(strategy.compressor, self.attribute):
                compressor = strategy.compressor
                settable = {k for k in dir(type(compressor)) if getattr(getattr(type(compressor), k), "fset", None)}
                public = sorted(settable | {k for k in vars(compressor) if not k.startswith("_")} - {"rank", "world_size"})
                raise ValueError(
                    f"Expected `attribute` to name a setting of {type(strategy.compressor).__name__}, but got "
                    f"{self.attribute!r}. Fix: use one of {public}."
                )
            for value in self.values:  # fail before training on a value the compressor rejects
                setattr(strategy.compressor, self.attribute, value)
            setattr(strategy.compressor, self.attribute, self.values[0])

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # here and not in setup: a preset adds this callback in the strategy's setup, after the callbacks' setup ran,
        # and the run's length is known once the dataloaders are (estimated_stepping_batches)
        self.steps_dense = resolve_dense_steps(self.dense_steps, run_steps(trainer))

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: object,
                             batch_idx: int) -> None:
        # checked in setup; a cast, not an isinstance: a protocol check reads every member, on every batch
        strategy = cast(HookHost, trainer.strategy)
        step, epoch = trainer.global_step, trainer.current_epoch
        self.current = self.value_at(epoch, step)
        if self.attribute is not None:
            setattr(strategy.compressor, self.attribute, self.current)
        state = strategy.comm_state
        if state is not None:
            assert self.steps_dense is not None  # resolved at on_train_start
            state.router.set_dense(step < self.steps_dense)
