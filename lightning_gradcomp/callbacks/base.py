"""Callbacks whose work happens inside the communication hook, before compression.

A :class:`PipelineCallback` lives in ``trainer.callbacks`` (so YAML configures it like any callback) but
does its per-layer work through a :class:`~lightning_gradcomp.exchange.pipeline.LayerTransform` that it attaches to
the :class:`~lightning_gradcomp.GradCompStrategy` at setup: Lightning's own gradient hooks run after DDP has
already averaged the gradients, which is too late.
"""

from abc import ABC, abstractmethod

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.exchange.host import HookHost
from lightning_gradcomp.exchange.pipeline import LayerTransform


class PipelineCallback(Callback, ABC):
    """Base class of callbacks that attach a per-layer transform to the strategy's pipeline."""

    def __init__(self) -> None:
        self.transform: LayerTransform | None = None

    @abstractmethod
    def make_transform(self, strategy: HookHost) -> LayerTransform:
        """Build the transform (validating it against the strategy's configuration).

        Args:
            strategy: the strategy whose hook runs the transform: a ``GradCompStrategy`` or, under Fabric, a
                ``GradCompFabricStrategy``.
        """

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        # a Trainer's strategy that hosts the hook is a GradCompStrategy (or a subclass): the Fabric one never
        # reaches a Trainer. The protocol keeps the callbacks free of an import of the strategies, which import them.
        if not isinstance(strategy, HookHost):
            raise ValueError(
                f"Expected the Trainer's strategy to be a GradCompStrategy for {type(self).__name__}, but got "
                f"{type(strategy).__name__}. Fix: use e.g. `strategy='terngrad'` or `strategy='fp32'` (fp32 "
                f"gradients through the compression pipeline)."
            )
        if self.transform is None or self.transform not in strategy.transforms:
            self.transform = self.make_transform(strategy)
            strategy.add_transform(self.transform)
