"""Quickstart: plain DDP vs TernGrad on scikit-learn's digits, 2 CPU processes each.

    python examples/quickstart.py

prints, for each run, the validation accuracy, the bytes each rank sent per step and the compression
ratio. Each run is its own `python examples/quickstart.py --strategy NAME` process; Lightning launches the
second rank by re-running that command. The fused CPU kernels are compiled (once per machine, then cached) before
any run is timed, so the table's wall times compare training, not a one-time compile.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradcomp_lab.tasks import ImageClassifier

STRATEGIES = ("ddp", "terngrad")


def build_task() -> "ImageClassifier":
    """The model and task every run trains (the setup line that docs/monitoring.md shows is this model's)."""
    from gradcomp_lab.models import MLP
    from gradcomp_lab.tasks import ImageClassifier

    return ImageClassifier(MLP(64, 256, 2, 10), num_classes=10, optimizer="momentum", lr=0.05, momentum=0.9)


def train(strategy: str, out: Path, epochs: int) -> None:
    import lightning.pytorch as pl

    import lightning_gradcomp  # noqa: F401  (registers "terngrad")
    from gradcomp_lab.cli import close_process_group
    from gradcomp_lab.data import DigitsDataModule

    pl.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=32)
    task = build_task()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, data)
    accuracy = trainer.validate(task, data, verbose=False)[0]["val_acc"]
    state = getattr(trainer.strategy, "comm_state", None)
    dense = sum(4 * p.numel() for p in task.parameters() if p.requires_grad)  # DDP's fp32 all-reduce message
    sent = state.bytes_per_step() if state is not None else dense
    if trainer.global_rank == 0:
        out.write_text(json.dumps({"accuracy": accuracy, "bytes_per_step": sent, "ratio": dense / sent}))
    close_process_group()  # as `gradcomp fit` does: left to interpreter shutdown, Gloo's threads may abort the process


def compile_kernels() -> None:
    """Compile (or load the cached) CPU kernels now, outside the timed runs; the library announces a compile."""
    from lightning_gradcomp.kernels import _build

    if _build.is_compiled():
        return
    _build.cpu_extension()  # logs what it does: "compiling the fused CPU kernels once (about 30 s ...)"
    if _build.unavailable_reason is None:
        print(f"kernels ready ({_build.load_seconds:.0f} s); later runs load them from the cache", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, help="run one strategy (used by the driver)")
    parser.add_argument("--out", type=Path, help="where the run writes its result (used by the driver)")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    if args.strategy:
        train(args.strategy, args.out, args.epochs)
        return
    compile_kernels()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in STRATEGIES:
            out = Path(tmp) / f"{name}.json"
            start = time.perf_counter()
            cmd = [sys.executable, __file__, "--strategy", name, "--out", str(out), "--epochs", str(args.epochs)]
            print(f"training with strategy={name!r} on 2 CPU processes ...", flush=True)
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"the {name} run failed:\n{run.stderr[-5000:]}")
            for line in run.stderr.splitlines():  # the strategy's setup line: what it compresses, and how much
                if line.startswith("gradcomp: "):
                    print(f"  {line}", flush=True)
            rows.append((name, json.loads(out.read_text()), time.perf_counter() - start))
    print(f"\n{'strategy':<10} {'val accuracy':>12} {'bytes/rank/step':>16} {'compression':>12} {'wall s':>7}")
    for name, r, wall in rows:
        print(f"{name:<10} {r['accuracy']:>12.4f} {r['bytes_per_step']:>16,} {r['ratio']:>11.1f}x {wall:>7.1f}")


if __name__ == "__main__":
    main()
