"""Emulated workers (towers) in one process agree with a real multi-process run."""

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

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


class _DenseFirstStep(Callback):
    """Step 1 in fp32 on every tower (a dense warm-up), then compressed; each step's two byte answers."""

    def __init__(self) -> None:
        self.means: list[Any] = []
        self.lasts: list[Any] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        for state in trainer.strategy._states:  # type: ignore[attr-defined]
            state.router.set_dense(trainer.global_step < 1)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.means.append(trainer.strategy.bytes_per_step())  # type: ignore[attr-defined]
        self.lasts.append(trainer.strategy.last_step_bytes())  # type: ignore[attr-defined]


def test_towers_report_the_runs_mean_per_step_warm_up_included() -> None:
    towers, steps = TowerStrategy(2, "terngrad"), _DenseFirstStep()
    fit_tiny(0, 1, towers, 3, [steps], 32, 1)
    dense = towers.dense_bytes_per_step()
    assert steps.lasts[0] == dense and 0 < steps.lasts[1] == steps.lasts[2] < dense, steps.lasts
    assert all(isinstance(m, int) for m in steps.means)
    assert steps.means == [sum(steps.lasts[: i + 1]) // (i + 1) for i in range(3)]
    assert towers.bytes_per_step() == (dense + 2 * steps.lasts[1]) // 3 and towers.last_step_bytes() == steps.lasts[1]


def test_tower_slices_interleave_like_a_distributed_sampler() -> None:
    x, y = torch.arange(8), torch.arange(8) * 10
    assert _tower_slice((x, y), 1, 4)[0].tolist() == [1, 5]
    assert _tower_slice({"x": x}, 0, 2)["x"].tolist() == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="num_workers=16"):
        _tower_slice(x, 0, 16)
