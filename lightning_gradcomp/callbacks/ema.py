"""Exponential moving average of the parameters, evaluated in place of the raw weights (TF semantics)."""

from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.validation import check_int, check_number


class ExponentialMovingAverage(Callback):
    """``tf.train.ExponentialMovingAverage(decay, num_updates)`` over the trainable parameters.

    After every optimizer step ``t = 1, 2, ...`` (counted after the step, as TF reads the already
    incremented ``global_step`` under the train op's control dependency), each shadow becomes
    ``shadow = d * shadow + (1 - d) * param`` with ``d = min(decay, (1 + n) / (10 + n))`` and
    ``n = t // step_divisor`` (TernGrad passes ``global_step / num_nodes``). Shadows start at the initial
    parameters. Validation and test run with the shadows swapped into the model and the raw parameters
    swapped back afterwards (TernGrad's ``--restore_avg_var``). Buffers (BN statistics) are not averaged,
    as in TF where they are not trainable variables. The shadows are saved in the callback's checkpoint state.

    Every DDP rank applies the same update to identical parameters, so the shadows stay identical too.

    Args:
        decay: the maximum decay (0.9999 in TernGrad and WeightGrad).
        step_divisor: divide the step count by this before the warm-up formula.
        evaluate_with_average: swap the averages in for validation and test.
    """

    def __init__(self, decay: float = 0.9999, step_divisor: int = 1, evaluate_with_average: bool = True) -> None:
        check_number("decay", decay, minimum=0.0, maximum=1.0)
        check_int("step_divisor", step_divisor, minimum=1)
        self.decay, self.step_divisor, self.evaluate_with_average = decay, step_divisor, evaluate_with_average
        self.shadow: dict[str, Tensor] = {}
        self._backup: Optional[dict[str, Tensor]] = None
        self._last_step = 0

    def _params(self, pl_module: LightningModule) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in pl_module.named_parameters() if p.requires_grad}

    def current_decay(self, step: int) -> float:
        """The decay used by the update after optimizer step ``step``."""
        n = step // self.step_divisor
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = self._params(pl_module)
        # keep shadows restored from a checkpoint; start the rest from the current parameters
        self.shadow = {
            name: self.shadow[name].to(p.device) if name in self.shadow else p.detach().clone() for name, p in params.items()
        }
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # gradient accumulation: no optimizer step happened on this batch
        self._last_step = step
        d = self.current_decay(step)
        with torch.no_grad():
            for name, p in self._params(pl_module).items():
                self.shadow[name].lerp_(p.detach(), 1.0 - d)

    def _swap_in(self, pl_module: LightningModule) -> None:
        if not self.evaluate_with_average or not self.shadow or self._backup is not None:
            return
        params = self._params(pl_module)
        self._backup = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.shadow[name])

    def _swap_out(self, pl_module: LightningModule) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            for name, p in self._params(pl_module).items():
                p.copy_(self._backup[name])
        self._backup = None

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_in(pl_module)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._swap_out(pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"shadow": {name: t.cpu() for name, t in self.shadow.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shadow = dict(state_dict["shadow"])
