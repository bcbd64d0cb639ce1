"""Learning-rate schedules of the papers' TF code, as multipliers of the base LR for ``LambdaLR``.

Each is a small picklable class (LambdaLR stores its lambdas in checkpoints only if they are objects), called
with the number of optimizer steps taken so far.
"""

import math

from lightning_gradcomp.validation import check_int, check_number


class Constant:
    """The base learning rate throughout (TernGrad's choice for Adam)."""

    def __call__(self, step: int) -> float:
        return 1.0


class PolynomialDecay:
    """``tf.train.polynomial_decay`` from the base LR to ``end_factor * base`` over ``max_steps``.

    ``factor(t) = (1 - end_factor) * (1 - min(t, max_steps) / max_steps) ** power + end_factor``; TernGrad and
    WeightGrad use ``power=0.5`` down to 0.

    Args:
        max_steps: steps over which the LR decays; it then stays at the end value.
        power: exponent of the decay.
        end_factor: final LR as a fraction of the base LR.
    """

    def __init__(self, max_steps: int, power: float = 0.5, end_factor: float = 0.0) -> None:
        check_int("max_steps", max_steps, minimum=1, fix="set `max_steps` (or the Trainer's) for polynomial decay")
        check_number("power", power, minimum=0.0, min_open=True)
        check_number("end_factor", end_factor, minimum=0.0, maximum=1.0)
        self.max_steps, self.power, self.end_factor = max_steps, power, end_factor

    def __call__(self, step: int) -> float:
        remaining = 1.0 - min(step, self.max_steps) / self.max_steps
        return (1.0 - self.end_factor) * remaining**self.power + self.end_factor


class StaircaseExponentialDecay:
    """``tf.train.exponential_decay(..., staircase=True)``: ``rate ** floor(step / decay_steps)``.

    Args:
        decay_steps: steps between decays (TernGrad: ``num_epochs_per_decay`` epochs' worth).
        rate: multiplier per decay (0.1 in the papers).
    """

    def __init__(self, decay_steps: int, rate: float = 0.1) -> None:
        check_int("decay_steps", decay_steps, minimum=1, fix="set `decay_steps` or `decay_epochs` for staircase decay")
        check_number("rate", rate, minimum=0.0, maximum=1.0, min_open=True)
        self.decay_steps, self.rate = decay_steps, rate

    def __call__(self, step: int) -> float:
        return self.rate ** (step // self.decay_steps)


class WarmupCosine:
    """Linear warm-up from ``1 / warmup_steps`` to 1 over ``warmup_steps``, then cosine decay to ``end_factor``
    at ``max_steps`` (GPT-2/nanoGPT's schedule), constant afterwards.

    Args:
        max_steps: step at which the decay ends.
        warmup_steps: steps of linear warm-up (0: none).
        end_factor: final LR as a fraction of the base LR.
    """

    def __init__(self, max_steps: int, warmup_steps: int = 0, end_factor: float = 0.1) -> None:
        check_int("max_steps", max_steps, minimum=1, fix="set `max_steps` (or the Trainer's) for cosine decay")
        check_int("warmup_steps", warmup_steps, minimum=0)
        if warmup_steps >= max_steps:
            raise ValueError(
                f"Expected `warmup_steps` to be below `max_steps` ({max_steps}), but got {warmup_steps}. "
                "Fix: warm up for a small share of the run (e.g. 5-10%)."
            )
        check_number("end_factor", end_factor, minimum=0.0, maximum=1.0)
        self.max_steps, self.warmup_steps, self.end_factor = max_steps, warmup_steps, end_factor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.max_steps - self.warmup_steps))
        return self.end_factor + (1.0 - self.end_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
