"""One way to read bytes on every strategy of the library (``ByteReport``), what the callbacks take a strategy as
(``HookHost``), and DeMo's optimizer check."""

import warnings
from types import SimpleNamespace
from typing import Any, Callable, cast

import lightning.pytorch as pl
import pytest
import torch

from lightning_gradcomp import (
    DiLoCoStrategy,
    GradCompFabricStrategy,
    GradCompStrategy,
    ShardedDiLoCoStrategy,
    TowerStrategy,
    WeightGradStrategy,
)
from lightning_gradcomp.callbacks import CompressionMonitor, CompressionSchedule, SigmaClipping
from lightning_gradcomp.compressors import DeMo
from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.exchange.host import HookHost
from lightning_gradcomp.exchange.ledger import ByteReport, GroupRecord, Ledger, RunBytes
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.optimizers import SignSGD

STRATEGIES: dict[str, Callable[[], Any]] = {
    "gradcomp": lambda: GradCompStrategy("terngrad"),
    "diloco": lambda: DiLoCoStrategy(sync_every=2),
    "streaming_diloco": lambda: DiLoCoStrategy(sync_every=6, fragments=3, sync_delay=1, mixing=0.5),
    "sharded_diloco": lambda: ShardedDiLoCoStrategy(sync_every=2),
    "weightgrad": lambda: WeightGradStrategy(),
    "towers": lambda: TowerStrategy(2),
    "fabric": lambda: GradCompFabricStrategy("terngrad"),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_reports_its_bytes_through_the_same_two_methods(name: str) -> None:
    strategy = STRATEGIES[name]()
    assert isinstance(strategy, ByteReport)
    # nothing exchanged before the first step: 0, not an error (the progress bar reads it from step 1 on)
    assert strategy.bytes_per_step() == 0 and strategy.dense_bytes_per_step() == 0
    assert strategy.last_step_bytes() == 0 and isinstance(strategy.bytes_per_step(), int)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_callbacks_take_every_strategy_that_runs_the_hook_and_only_those(name: str) -> None:
    """The callbacks check ``HookHost`` (a protocol: they import no strategy); ``TowerStrategy`` attaches no
    transform and has no hook state, so a callback refuses it at setup rather than failing inside training."""
    strategy = STRATEGIES[name]()
    assert isinstance(strategy, HookHost) is (name != "towers")
    if name != "towers":
        return
    trainer = cast(pl.Trainer, SimpleNamespace(strategy=strategy))
    for callback in (SigmaClipping(), CompressionSchedule(dense_steps=1), CompressionMonitor()):
        with pytest.raises(ValueError, match="to be a GradCompStrategy for .*, but got TowerStrategy"):
            callback.setup(trainer, cast(pl.LightningModule, None), "fit")


def test_the_ledger_averages_its_exchanges_over_the_run_and_keeps_the_latest_apart() -> None:
    """A step is an exchange that begins at bucket 0; the latest is read live from the records until the next
    begins (1-bit Adam records its exchange after the hook ran)."""
    ledger = Ledger()
    layout = Segments(["a", "b"], [torch.Size([4]), torch.Size([2])])
    assert ledger.bytes_per_step() == ledger.last_step_bytes() == 0
    for nbytes in [(16, 8), (1, 2), (1, 3)]:
        ledger.bucket_called(is_last=True, first=True)
        ledger.record_group(GroupRecord(layout, nbytes, Aggregation.GATHER, {}))
        ledger.record_shared(0, 4)
        assert ledger.last_step_bytes() == sum(nbytes) + 4
    assert ledger.bytes_per_step() == (28 + 7 + 8) // 3 == 14
    ledger.bucket_called(is_last=True)  # a later bucket of the same exchange: no new step
    assert ledger.bytes_per_step() == 14


def test_a_round_after_the_last_step_counts_in_that_step() -> None:
    run = RunBytes()
    run.add(10)
    run.end_step()
    run.end_step()  # a step without a round
    run.add(7)  # DiLoCo's final round, after the last inner step
    run.fold_into_last()
    assert (run.total, run.steps, run.last, run.mean()) == (17, 2, 7, 8)
    assert RunBytes(17, 2).mean() == 8 and RunBytes().mean() == 0


def test_a_variable_size_steps_bytes_stay_on_the_device_until_a_report_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook closes a step at the next step's first bucket: a variable-size group's sizes (a device tensor) are
    kept, not read, so counting never syncs the host; a report sums them; a run that never reads folds them on the
    device instead of holding one tensor per step."""
    monkeypatch.setattr(RunBytes, "FOLD_AFTER", 4)
    run = RunBytes()
    reads = []
    for step in range(10):
        sizes = torch.tensor([step, 1])
        run.add(sizes)
        run.add(3)
        run.end_step()
        reads.append(len(run._pending))
    assert max(reads) <= 5 and reads[-1] < 5, f"kept parts not folded: {reads}"
    assert (run.total, run.steps, run.last) == (sum(range(10)) + 10 * 4, 10, 9 + 4)
    assert run.mean() == (45 + 40) // 10


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4, 4))]


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: torch.optim.AdamW(_params(), lr=1e-3), "AdamW (param group 0: moments of its own"),
        (lambda: torch.optim.Adam(_params(), lr=1e-3), "Adam (param group 0: moments of its own"),
        (lambda: torch.optim.SGD(_params(), lr=0.1, momentum=0.9), "SGD with momentum=0.9"),
    ],
    ids=["adamw", "adam", "sgd-momentum"],
)
def test_demo_warns_about_an_optimizer_with_momentum_of_its_own(build: Callable[[], Any], named: str) -> None:
    with pytest.warns(UserWarning, match="Expected DeMo's optimizer to be SignSGD") as caught:
        DeMo().check_optimizers([build()])
    mine = [str(w.message) for w in caught if "DeMo" in str(w.message)]
    assert len(mine) == 1 and named in mine[0] and "Fix:" in mine[0], mine


def test_demo_accepts_signsgd_and_plain_sgd_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeMo().check_optimizers([SignSGD(_params(), lr=1e-3), torch.optim.SGD(_params(), lr=0.1)])
