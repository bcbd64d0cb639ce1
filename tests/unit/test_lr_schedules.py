"""The tasks' LR schedules are torch's schedulers; step by step they give the papers' TF schedules."""

import math

import pytest
import torch

from gradcomp_lab.models import LeNet
from gradcomp_lab.tasks import ImageClassifier


def tf_polynomial_decay(step: int, max_steps: int, power: float) -> float:
    """``tf.train.polynomial_decay(1.0, step, max_steps, end_learning_rate=0, power, cycle=False)``."""
    return (1.0 - min(step, max_steps) / max_steps) ** power


def tf_staircase_decay(step: int, decay_steps: int, rate: float) -> float:
    """``tf.train.exponential_decay(1.0, step, decay_steps, rate, staircase=True)``."""
    return rate ** (step // decay_steps)


def _lrs(task: ImageClassifier, steps: int) -> list[float]:
    config = task.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_poly_is_torch_polynomial_lr_with_tf_values(power: float) -> None:
    task = ImageClassifier(LeNet(image_size=8), lr=0.1, lr_schedule="poly", max_steps=37, poly_power=power)
    assert isinstance(task.configure_optimizers()["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.PolynomialLR)
    got = _lrs(task, 45)  # past the end: TF holds the end value (0), so does torch
    expected = [0.1 * tf_polynomial_decay(t, 37, power) for t in range(45)]
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert got[0] == 0.1 and got[37:] == [0.0] * 8
    assert got[18] == pytest.approx(0.1 * (19 / 37) ** power)


def test_staircase_is_torch_step_lr_with_tf_values() -> None:
    task = ImageClassifier(LeNet(image_size=8), lr=0.1, lr_schedule="staircase", decay_steps=10, decay_rate=0.1)
    assert isinstance(task.configure_optimizers()["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.StepLR)
    got = _lrs(task, 35)
    assert got == pytest.approx([0.1 * tf_staircase_decay(t, 10, 0.1) for t in range(35)], rel=1e-9)
    assert got[9] == 0.1 and got[10] == pytest.approx(0.01) and got[34] == pytest.approx(1e-4)


def test_constant_has_no_scheduler() -> None:
    task = ImageClassifier(LeNet(image_size=8), lr=0.1)
    config = task.configure_optimizers()
    assert "lr_scheduler" not in config and config["optimizer"].param_groups[0]["lr"] == 0.1


def test_tf_reference_formulas() -> None:
    """The references themselves, against hand values (so a wrong reference cannot hide a wrong schedule)."""
    assert tf_polynomial_decay(50, 100, 0.5) == pytest.approx(math.sqrt(0.5))
    assert tf_polynomial_decay(150, 100, 0.5) == 0.0
    assert [tf_staircase_decay(s, 10, 0.1) for s in (0, 9, 10, 25)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
