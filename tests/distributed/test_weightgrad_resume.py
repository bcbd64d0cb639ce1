"""WeightGrad's per-rank state (accumulated updates, staleness counter, G_thresh, per-site weights) is
training state: a run resumed mid-cycle ends bit-identical to the uninterrupted one."""

from pathlib import Path

import pytest
import torch

from tests.distributed.reliability_ranks import weightgrad_resume
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def test_weightgrad_resume_mid_cycle_is_bit_identical(tmp_path: Path) -> None:
    results = run_ranks(weightgrad_resume, 4, str(tmp_path), 6, 3, timeout=400)
    for rank, r in enumerate(results):
        assert torch.equal(r["full"], r["resumed"]), f"rank {rank}: resume differs from the uninterrupted run"
        assert r["rounds"] > 0
    # the control: without the saved accumulators and site weights, the resumed run ends elsewhere
    assert any(not torch.equal(r["full"], r["reset"]) for r in results)
