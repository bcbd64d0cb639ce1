"""Emulated workers (towers) in one process agree with a real multi-process run."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import Compressor, GradientDropping, PowerSGD, TernGrad
from lightning_gradcomp.strategies.towers import TowerStrategy, _tower_slice
from tests.distributed.lightning_ranks import fit_tiny
from tests.harness import run_ranks


COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "terngrad_allgather": lambda: TernGrad(collective="allgather"),
    "terngrad_allreduce_int8": lambda: TernGrad(collective="allreduce_int8"),
    # multi-round: each round a blocking sum among the worker threads
    "powersgd": lambda: PowerSGD(rank=2),
}


@pytest.mark.parametrize("compressor", list(COMPRESSORS))
def test_two_towers_match_two_real_ranks(compressor: str) -> None:
    """Same samples per worker, same seeds, same decoding: the same parameters after 5 steps."""
    real = run_ranks(fit_tiny, 2, GradCompStrategy(COMPRESSORS[compressor]()), 5, None, 16, None, True)
    towers = TowerStrategy(2, COMPRESSORS[compressor]())
    emulated = fit_tiny(0, 1, towers, 5, None, 32, 1)
    torch.testing.assert_close(emulated["params"], real[0]["params"], rtol=1e-5, atol=1e-6)
    assert towers.bytes_per_step() == real[0]["bytes_per_step"]


def test_towers_with_error_feedback_and_fp32_layers_match_two_real_ranks() -> None:
    """Gradient Dropping (residuals on every worker) with the biases sent in fp32 (two groups per bucket, each
    through the hook's group step): the same parameters and bytes as two real ranks."""
    options: dict[str, Any] = {"exclude": ["*.bias"]}
    real = run_ranks(fit_tiny, 2, GradCompStrategy(GradientDropping(drop_ratio=0.9), **options), 5, None, 16, None,
                     True)
    towers = TowerStrategy(2, GradientDropping(drop_ratio=0.9), **options)
    emulated = fit_tiny(0, 1, towers, 5, None, 32, 1)
    torch.testing.assert_close(emulated["params"], real[0]["params"], rtol=1e-5, atol=1e-6)
    assert towers.bytes_per_step() == real[0]["bytes_per_step"]
    assert {name for name, r in towers.records.items() if r.numel and r.nbytes == 4 * r.numel} >= {"net.0.bias"}
    # the residuals are each worker's own: the towers kept them, and they differ (each tower saw other samples)
    residuals = [state.memory.residuals["net.0.weight"] for state in towers._states]
    assert residuals[0].abs().sum() > 0 and not torch.equal(residuals[0], residuals[1])


def test_many_towers_run_and_count_bytes() -> None:
    towers = TowerStrategy(8, "terngrad")
    out = fit_tiny(0, 1, towers, 3, None, 64, 1)
    assert torch.isfinite(out["params"]).all()
    # 8 workers: the int8 all-reduce form (1 byte per element) plus 4-byte shared scalers
    n_params = sum(r.numel for r in towers.records.values())
    assert towers.bytes_per_step() == n_params + 4 * len(towers.records)


def test_tower_slices_interleave_like_a_distributed_sampler() -> None:
    x, y = torch.arange(8), torch.arange(8) * 10
    assert _tower_slice((x, y), 1, 4)[0].tolist() == [1, 5]
    assert _tower_slice({"x": x}, 0, 2)["x"].tolist() == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="num_workers=16"):
        _tower_slice(x, 0, 16)
