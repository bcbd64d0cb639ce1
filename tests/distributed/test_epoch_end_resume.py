"""A checkpoint written at the end of an epoch resumes bit-identically, with ``max_steps`` (where Lightning alone
resumes it inside the finished epoch and shifts every later epoch's batches) and with ``max_epochs``.

Data come from the loader (shuffled per epoch by the distributed sampler): with data drawn from the step instead,
a shifted epoch would go unnoticed. Two compressors: one stateless, one with per-rank generators.
"""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.reliability_ranks import epoch_end_resume
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

NAMES = ["fp32", "terngrad"]


@pytest.mark.parametrize("limits", [{"max_steps": 8}, {"max_epochs": 2}], ids=["max_steps", "max_epochs"])
def test_end_of_epoch_checkpoint_resumes_bit_identically(tmp_path: Path, limits: dict[str, Any]) -> None:
    results = run_ranks(epoch_end_resume, 2, NAMES, str(tmp_path), limits, timeout=400)
    for rank, by_name in enumerate(results):
        for name in NAMES:
            run = by_name[name]
            assert "error" not in run, f"rank {rank}, {name}:\n{run.get('error')}"
            assert run["global_step"] == 8
            assert run["resumed_seen"] == run["full_seen"][4:], f"rank {rank}, {name}: the resumed run saw other batches"
            assert torch.equal(run["full"], run["resumed"]), f"rank {rank}, {name}: resume differs"
