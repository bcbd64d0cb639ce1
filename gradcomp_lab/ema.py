"""Exponential moving average of the parameters, evaluated in place of the raw weights (TF semantics).

Why not Lightning's ``WeightAveraging``/``EMAWeightAveraging``: the arithmetic can be the papers' (pass
:func:`tf_ema_avg_fn` as ``avg_fn`` with ``use_buffers=False``, which also evaluates with the current batch-norm
statistics as TF does, and update once at fit start), as ``tests/unit/test_ema_library.py`` shows step by step.
What it cannot express without overriding its private members:

* the shadows start at the initial weights (TF); its first update copies the weights after step 1;
* after training it copies the averages into the model for good; TF's ``--restore_avg_var`` evaluation (and this
  callback) keep the raw weights, which resumed training continues from, and swap the averages in for test too;
* checkpoints: it writes the averages as the model's ``state_dict``; here the shadows are the callback's state
  and the model's weights stay the raw ones.

``EMAWeightAveraging`` itself uses a fixed decay, without TF's ``(1 + n) / (10 + n)`` warm-up.
"""

from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.validation import check_int, check_number


def tf_decay(decay: float, t: int) -> float:
    """TF's ``ExponentialMovingAverage(decay, num_updates=t)`` decay: ``min(decay, (1 + t) / (10 + t))``."""
    return min(decay, (1.0 + t) / (10.0 + t))


def tf_ema_avg_fn(decay: float = 0.9999, step_divisor: int = 1) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """TF's EMA update as an ``avg_fn`` for ``torch.optim.swa_utils.AveragedModel`` (and Lightning's ``WeightAveraging``).

    ``avg_fn(shadow, param, n)`` moves ``shadow`` in place to ``d * shadow + (1 - d) * param`` with
    ``d = min(decay, (1 + t) / (10 + t))``, ``t = n // step_divisor``, and returns it. ``n`` is the number of
    updates so far: the optimizer step when the average was seeded with the initial weights.
    """

    def avg_fn(shadow: Tensor, param: Tensor, num_averaged: Tensor) -> Tensor:
        return shadow.lerp_(param, 1.0 - tf_decay(decay, int(num_averaged) // step_divisor))

    return avg_fn


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
        self._avg_fn = tf_ema_avg_fn(decay, step_divisor)
        self.shadow: dict[str, Tensor] = {}
        self._backup: Optional[dict[str, Tensor]] = None
        self._last_step = 0

    def _params(self, pl_module: LightningModule) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in pl_module.named_parameters() if p.requires_grad}

    def current_decay(self, step: int) -> float:
        """The decay used by the update after optimizer step ``step``."""
        return tf_decay(self.decay, step // self.step_divisor)

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
        count = torch.tensor(step)
        with torch.no_grad():
            for name, p in self._params(pl_module).items():
                self._avg_fn(self.shadow[name], p.detach(), count)

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
