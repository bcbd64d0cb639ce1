"""Invalid training-task configurations (gradcomp_lab.tasks): refused when the task is built, before the first step."""

from gradcomp_lab.models import GPT
from gradcomp_lab.tasks import CharLanguageModel
from tests.bad_configs import BadConfig


def _language_model(**options: object) -> CharLanguageModel:
    return CharLanguageModel(GPT(width=8, depth=1, num_heads=1, context=8), **options)  # type: ignore[arg-type]


BAD_CONFIGS = [
    # the cosine schedule's horizon is known at construction (the CLI links it to trainer.max_steps): refused there,
    # not in configure_optimizers on every rank after the processes started
    BadConfig("tasks-warmup-at-max-steps",
              lambda: _language_model(lr_schedule="cosine", warmup_steps=20, max_steps=20), "warmup_steps", "20"),
]
