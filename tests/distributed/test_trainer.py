"""``Trainer(strategy=...)`` end to end on real Gloo ranks."""

import pytest
import torch

from tests.distributed.lightning_ranks import fit_tiny
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def test_registered_terngrad_trains_with_identical_replicas() -> None:
    results = run_ranks(fit_tiny, 2, "terngrad")
    assert results[0]["strategy"] == "GradCompStrategy" and results[0]["compressor"] == "TernGrad"
    assert torch.equal(results[0]["params"], results[1]["params"])
    # 2-bit payloads plus one shared fp32 scaler per tensor: about 16x fewer bytes than fp32
    assert results[0]["dense_bytes"] / results[0]["bytes_per_step"] > 10


def test_fp32_through_hook_matches_stock_ddp() -> None:
    stock = run_ranks(fit_tiny, 2, "ddp")
    ours = run_ranks(fit_tiny, 2, "fp32")
    torch.testing.assert_close(stock[0]["params"], ours[0]["params"], rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[0]["params"], ours[1]["params"])


def test_sigma_clipping_callback_runs_inside_the_hook() -> None:
    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.callbacks import SigmaClipping

    plain = run_ranks(fit_tiny, 2, GradCompStrategy(compressor="fp32"))
    clipped = run_ranks(fit_tiny, 2, GradCompStrategy(compressor="fp32"), 5, [SigmaClipping(0.5)])
    assert torch.equal(clipped[0]["params"], clipped[1]["params"])
    assert not torch.allclose(plain[0]["params"], clipped[0]["params"]), "clipping changed nothing"
