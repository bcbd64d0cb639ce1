"""The warm-up + cosine LR schedule of the language-model benchmark, as a ``LambdaLR`` factor.

The papers' schedules are torch's own (``PolynomialLR``, ``StepLR``: ``tests/unit/test_lr_schedules.py``). This one
stays ours: torch's composition, ``SequentialLR(LinearLR(start_factor=1/w, total_iters=w-1),
CosineAnnealingLR(T_max=max_steps-w, eta_min=end_factor))``, computes the cosine recursively, so it agrees with this
closed form only to rounding and the runs behind ``docs/transformers.md`` would not repeat bit for bit; and past
``max_steps`` it climbs back up where this one holds ``end_factor``.
A small picklable class: ``LambdaLR`` keeps callable objects in checkpoints.
"""

import math

from lightning_gradcomp.validation import check_int, check_number


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
                f"Fix: warm up for a small share of the run (5 %: `warmup_steps`={max_steps // 20}) or raise `max_steps`."
            )
        check_number("end_factor", end_factor, minimum=0.0, maximum=1.0)
        self.max_steps, self.warmup_steps, self.end_factor = max_steps, warmup_steps, end_factor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.max_steps - self.warmup_steps))
        return self.end_factor + (1.0 - self.end_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
