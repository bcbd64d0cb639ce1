"""Our TF-style EMA against Lightning's ``WeightAveraging``: the same arithmetic, different evaluation semantics.

Shows why ``ExponentialMovingAverage`` stays ours (``gradcomp_lab/ema.py`` docstring): with
:func:`tf_ema_avg_fn` and a first update at fit start Lightning's callback computes the same shadows step by step
(and evaluates with the current batch-norm statistics, as TF does), but it leaves the averages in the model after
training, and without that first update it starts from the step-1 weights.
"""

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, WeightAveraging
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradcomp_lab.ema import ExponentialMovingAverage, tf_ema_avg_fn


class _Net(L.LightningModule):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8) if batch_norm else nn.Identity(), nn.Linear(8, 1))
        self.val_running_means: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.net(batch[0]).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if isinstance(self.net[1], nn.BatchNorm1d):
            assert self.net[1].running_mean is not None
            self.val_running_means.append(self.net[1].running_mean.clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _SeededWeightAveraging(WeightAveraging):
    """Lightning's callback with TF's decay, seeded with the initial weights as TF's shadows are."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self._average_model is not None  # made in setup
        self._average_model.update_parameters(pl_module)


class _Compare(Callback):
    def __init__(self, ours: ExponentialMovingAverage, theirs: WeightAveraging) -> None:
        self.ours, self.theirs = ours, theirs
        self.equal_steps: list[tuple[int, bool]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        assert self.theirs._average_model is not None
        averaged = dict(self.theirs._average_model.module.named_parameters())
        same = all(torch.equal(shadow, averaged[name]) for name, shadow in self.ours.shadow.items())
        self.equal_steps.append((trainer.global_step, same))


def _first_weight(model: _Net) -> Tensor:
    layer = model.net[0]
    assert isinstance(layer, nn.Linear)
    return layer.weight


def _fit(model: L.LightningModule, callbacks: list, steps: int = 6) -> None:
    data = DataLoader(TensorDataset(torch.randn(48, 4, generator=torch.Generator().manual_seed(1))), batch_size=8)
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              val_check_interval=3, limit_val_batches=1, callbacks=callbacks).fit(model, data, data)


@pytest.mark.parametrize("step_divisor", [1, 2])
def test_weight_averaging_with_tf_avg_fn_gives_the_same_shadows(step_divisor: int) -> None:
    ours = ExponentialMovingAverage(decay=0.95, step_divisor=step_divisor)
    theirs = _SeededWeightAveraging(use_buffers=False, avg_fn=tf_ema_avg_fn(0.95, step_divisor))
    compare = _Compare(ours, theirs)
    _fit(_Net(), [ours, theirs, compare])
    assert compare.equal_steps == [(step, True) for step in range(1, 7)]


def test_weight_averaging_differs_where_tf_semantics_matter() -> None:
    ours_model, theirs_model = _Net(batch_norm=True), _Net(batch_norm=True)
    _fit(ours_model, [ExponentialMovingAverage(decay=0.95)])
    _fit(theirs_model, [_SeededWeightAveraging(use_buffers=False, avg_fn=tf_ema_avg_fn(0.95))])
    # the same: with use_buffers=False both evaluate with the current batch-norm statistics (TF's behaviour)
    for ours, theirs in zip(ours_model.val_running_means, theirs_model.val_running_means):
        assert torch.equal(ours, theirs)
    # differs: after training TF keeps the raw weights; WeightAveraging leaves the averages in the model
    raw = _Net(batch_norm=True)
    _fit(raw, [])
    assert torch.equal(_first_weight(ours_model), _first_weight(raw))
    assert not torch.equal(_first_weight(theirs_model), _first_weight(raw))


def test_unseeded_weight_averaging_starts_from_the_step_one_weights() -> None:
    """Without the seeding at fit start the first update copies the weights: not TF's shadow."""
    ours = ExponentialMovingAverage(decay=0.95)
    theirs = WeightAveraging(use_buffers=False, avg_fn=tf_ema_avg_fn(0.95))
    compare = _Compare(ours, theirs)
    _fit(_Net(), [ours, theirs, compare], steps=2)
    assert compare.equal_steps == [(1, False), (2, False)]
