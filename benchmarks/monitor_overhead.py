"""Overhead of CompressionMonitor per training step at the default logging interval (50 steps).

Two Gloo ranks on this machine train an MLP with TernGrad; each trial runs every arm once, in a rotating
order, so the arms see the same machine state side by side:

* ``csv``: CSVLogger, no monitor (the baseline of ``csv+monitor``);
* ``csv+monitor``: CSVLogger and CompressionMonitor (scalars only);
* ``wandb``: offline WandbLogger, no monitor (the baseline of ``wandb+monitor``);
* ``wandb+monitor``: offline WandbLogger and CompressionMonitor (scalars and 4 histograms of every layer).

The time of a step is rank 0's wall time from one ``on_train_batch_start`` to the next, logging steps
included; a trial's value is the mean over its steps after warm-up, and the table shows the median over
trials. Run::

    python benchmarks/monitor_overhead.py            # defaults: 5 trials x 200 steps
    python benchmarks/monitor_overhead.py --trials 3 --steps 100 --hidden 512
"""

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

# this checkout's package, not an installed one (spawned ranks inherit sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ("csv", "csv+monitor", "wandb", "wandb+monitor")
BASELINE = {"csv+monitor": "csv", "wandb+monitor": "wandb"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    try:
        queue.put((rank, _trials(rank, world_size, port, args)))
    except BaseException:
        import traceback

        queue.put((rank, traceback.format_exc()))
        raise


def _trials(rank: int, world_size: int, port: int, args: argparse.Namespace) -> dict[str, list[float]]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off")
    torch.set_num_threads(args.threads)
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, WandbLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.callbacks import CompressionMonitor

    class Mlp(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            h = args.hidden
            self.net = nn.Sequential(nn.Linear(784, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)  # what a real training step logs, in both arms
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.marks.append(time.perf_counter())

        def on_train_end(self, *_: Any) -> None:
            self.marks.append(time.perf_counter())

    class TimedMonitor(CompressionMonitor):
        """The monitor, with the time spent in its callbacks and in the hook's HookStats calls added up."""

        def __init__(self) -> None:
            super().__init__()
            self.spent = 0.0

        def _timed(self, fn: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.spent += time.perf_counter() - start
            return call

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_fit_start(trainer, pl_module)
            if self.stats is not None:
                for name in ("start_bucket", "blocking", "observe_input", "observe_group", "observe_averaged"):
                    setattr(self.stats, name, self._timed(getattr(self.stats, name)))

        def on_train_batch_start(self, *a: Any) -> None:
            self._timed(super().on_train_batch_start)(*a)

        def on_train_batch_end(self, *a: Any) -> None:
            self._timed(super().on_train_batch_end)(*a)

    gen = torch.Generator().manual_seed(rank)
    n = args.batch_size * (args.steps + 1) * world_size  # the distributed sampler splits it over ranks
    data = TensorDataset(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    tmp = tempfile.mkdtemp(prefix="monitor_overhead_")
    results: dict[str, list[float]] = {arm: [] for arm in ARMS}
    results.update({f"{arm} (in monitor)": [] for arm in ARMS if arm.endswith("+monitor")})
    for trial in range(args.trials):
        order = ARMS[trial % len(ARMS):] + ARMS[: trial % len(ARMS)]
        for arm in order:
            timer = StepTimer()
            monitor = TimedMonitor() if arm.endswith("+monitor") else None
            callbacks: list = [timer] + ([monitor] if monitor is not None else [])
            logger = (WandbLogger(offline=True, save_dir=tmp, project="overhead") if arm.startswith("wandb")
                      else CSVLogger(tmp, name=arm))
            trainer = pl.Trainer(strategy=GradCompStrategy("terngrad"), accelerator="cpu", devices=world_size,
                                 max_steps=args.steps, logger=logger, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
            trainer.fit(Mlp(), DataLoader(data, batch_size=args.batch_size))
            if arm.startswith("wandb") and rank == 0:
                import wandb

                wandb.finish()
            steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])][args.warmup:]
            results[arm].append(sum(steps) / len(steps))
            if monitor is not None:  # whole run, warm-up included: an upper bound
                results[f"{arm} (in monitor)"].append(monitor.spent / args.steps)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps per trial (4 logging steps at the default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps of each trial left out")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (784-h-h-10)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    world_size = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank = {}
    for _ in procs:
        rank, value = queue.get(timeout=3600)
        if isinstance(value, str):
            for p in procs:
                p.kill()
            raise SystemExit(f"rank {rank} failed:\n{value}")
        by_rank[rank] = value
    for p in procs:
        p.join()
    results = by_rank[0]
    params = 784 * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden + args.hidden * 10 + 10

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.platform()}")
    print(f"setup: 2 Gloo ranks x {args.threads} thread(s), TernGrad, MLP 784-{args.hidden}-{args.hidden}-10 "
          f"({params / 1e6:.2f}M parameters), batch {args.batch_size}, log_every_n_steps=50, "
          f"{args.trials} trials x {args.steps} steps ({args.warmup} warm-up steps left out)")
    print()
    print("| arm | median step time (ms) | per-trial means (ms) | overhead vs baseline |")
    print("|---|---:|---|---:|")
    medians = {arm: statistics.median(values) for arm, values in results.items()}
    for arm in ARMS:
        base = BASELINE.get(arm)
        overhead = f"{100 * (medians[arm] / medians[base] - 1):+.2f}%" if base else "(baseline)"
        trials = ", ".join(f"{1e3 * v:.2f}" for v in results[arm])
        print(f"| {arm} | {1e3 * medians[arm]:.2f} | {trials} | {overhead} |")
    print()
    print("Time spent inside the monitor (its callbacks and the hook's HookStats calls) per step, rank 0:")
    print()
    print("| arm | median ms per step in the monitor | share of the baseline's median step time |")
    print("|---|---:|---:|")
    for arm, base in BASELINE.items():
        spent = medians[f"{arm} (in monitor)"]
        print(f"| {arm} | {1e3 * spent:.3f} | {100 * spent / medians[base]:.2f}% |")


if __name__ == "__main__":
    main()
