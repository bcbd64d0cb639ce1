"""Rank bodies for what a run says before and after its first step: the setup line, the first step's measured bytes,
setup warnings, and each strategy's ``bytes_per_step`` as the progress bar and the monitor show it."""

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from torch import nn

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.optimizers import SignSGD
from lightning_gradcomp.outer import DiLoCoStrategy
from lightning_gradcomp.weightgrad import WeightGradStrategy
from tests.distributed.diloco_ranks import MemoryLogger
from tests.distributed.fabric_ranks import make_model
from tests.distributed.lightning_ranks import TinyClassifier, random_loader


class _Lines(logging.Handler):
    """Every ``gradcomp: ...`` line the library logs on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("gradcomp: "):
            self.lines.append(message)


def _hook_bytes(strategy: Any) -> int:
    """What the hook's ledger counted in the latest step (the setup line speaks of the hook)."""
    return strategy.comm_state.last_step_bytes()


class _FirstStepBytes(Callback):
    """The hook's bytes right after the first optimizer step."""

    def __init__(self) -> None:
        self.first: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = _hook_bytes(trainer.strategy)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "signsgd":
        return SignSGD(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.1)


class _Classifier(TinyClassifier):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.optimizer_name, self.parameters())


def first_steps(rank: int, world_size: int, api: str, strategy: Any, optimizer: str = "sgd",
                steps: int = 2) -> dict[str, Any]:
    """A short run under the Trainer or Fabric; what it logged and warned, and its bytes after step 1 and at the end."""
    lines = _Lines()
    logger = logging.getLogger("lightning_gradcomp")
    logger.addHandler(lines)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if api == "trainer":
                recorder = _FirstStepBytes()
                trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps,
                                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, callbacks=[recorder])
                trainer.fit(_Classifier(optimizer), random_loader())
                first, last = recorder.first, _hook_bytes(trainer.strategy)
            else:
                fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
                fabric.launch()
                model = make_model()
                model, opt = fabric.setup(model, _optimizer(optimizer, model.parameters()))
                batches = iter(random_loader(shard=(rank, world_size)))
                first = None
                for _ in range(steps):
                    x, y = next(batches)
                    opt.zero_grad()
                    fabric.backward(nn.functional.cross_entropy(model(x), y))
                    opt.step()
                    first = _hook_bytes(fabric.strategy) if first is None else first
                last = _hook_bytes(fabric.strategy)
    finally:
        logger.removeHandler(lines)
    return {"lines": lines.lines, "warnings": [str(w.message) for w in caught], "first": first, "last": last}


class _StepBytes(Callback):
    """The strategy's two answers after every step (``ByteReport``): the run's mean and the latest step's bytes."""

    def __init__(self) -> None:
        self.means: list[Any] = []
        self.lasts: list[Any] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.means.append(trainer.strategy.bytes_per_step())  # type: ignore[attr-defined]
        self.lasts.append(trainer.strategy.last_step_bytes())  # type: ignore[attr-defined]


def _monitored_fit(world_size: int, strategy: Any, steps: int, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """A run under the Trainer with the monitor logging every step: the strategy's bytes after every step, the
    progress bar's ``comp_ratio``, the monitor's dicts and the lines the library logged on this rank."""
    lines = _Lines()
    logger = logging.getLogger("lightning_gradcomp")
    logger.addHandler(lines)
    steps_seen, memory = _StepBytes(), MemoryLogger()
    try:
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=memory,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[*callbacks, CompressionMonitor(logging_interval=1), steps_seen])
        trainer.fit(TinyClassifier(), random_loader())
    finally:
        logger.removeHandler(lines)
    strategy = trainer.strategy
    totals = [m for _, m in memory.logged if "gradcomp/bytes/total" in m]
    state = strategy.comm_state
    assert state is not None
    return {
        "means": steps_seen.means,
        "lasts": steps_seen.lasts,
        "bytes": strategy.bytes_per_step(),
        "last": strategy.last_step_bytes(),
        "dense": strategy.dense_bytes_per_step(),
        "hook_bytes": state.last_step_bytes(),
        "comp_ratio": float(trainer.progress_bar_metrics.get("comp_ratio", float("nan"))),
        "logged": totals,
        "logged_bytes": totals[-1]["gradcomp/bytes/total"] if totals else None,
        "logged_ratio": totals[-1].get("gradcomp/compression_ratio/total") if totals else None,
        "lines": lines.lines,
    }


class _WeightGradLines(logging.Handler):
    """WeightGrad's own ``weightgrad: ...`` lines (rank 0's statement about the sites)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("weightgrad: ") and " in site " not in message:
            self.lines.append(message)


def shown_bytes(rank: int, world_size: int) -> dict[str, Any]:
    """Each strategy's ``bytes_per_step`` / ``last_step_bytes`` after every step, with the progress bar's
    ``comp_ratio``, the monitor's totals and the setup lines: DiLoCo and WeightGrad with every rank its own site
    (rounds every 2 steps), WeightGrad with one site of every rank (nothing crosses between sites), and a preset
    with a dense warm-up (Gradient Dropping's, 2 dense steps then 2 compressed)."""
    from lightning_gradcomp.callbacks import CompressionSchedule

    sites = [
        _monitored_fit(world_size, strategy, 4)
        for strategy in (
            DiLoCoStrategy(sync_every=2, compressor="int8"),
            WeightGradStrategy(site_size=1, allow_single_rank_sites=True, staleness_bound=2, compressor="fp32"),
        )
    ]
    weightgrad_lines = _WeightGradLines()
    logging.getLogger("lightning_gradcomp").addHandler(weightgrad_lines)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Expected WeightGrad to run at least 2 sites")
            one_site = _monitored_fit(world_size, WeightGradStrategy(site_size=world_size, staleness_bound=100), 3)
    finally:
        logging.getLogger("lightning_gradcomp").removeHandler(weightgrad_lines)
    one_site["weightgrad_lines"] = weightgrad_lines.lines
    warm_up = _monitored_fit(world_size, "graddrop_lm", 4, [CompressionSchedule(dense_steps=2)])
    return {"sites": sites, "one_site": one_site, "warm_up": warm_up}


def setup_lines_of(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """:func:`first_steps` under Fabric for each compressor name in turn (one spawned world)."""
    return {name: first_steps(rank, world_size, "fabric", name, "sgd", 1) for name in names}
