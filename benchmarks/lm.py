"""The language-model benchmark: a byte-level GPT on the standard library's sources, AdamW, every strategy.

Each run is ``gradcomp fit --config RECIPE OVERRIDES...`` on real Gloo ranks (the recipe's ``devices``, 4), started
as its own process (Lightning launches the other ranks by re-running that command). Rank 0 writes one JSON per
run under ``--out`` (skipped when it exists, so an interrupted grid resumes; ``--force`` reruns): the validation
loss curve, the final validation loss, bytes per step (this rank's payload, median over steps; plain DDP:
4 bytes per parameter), this rank's bytes over the whole run (``total_bytes``, warm-up and dense steps included;
``fp32_total_bytes`` is plain DDP's), median seconds per step, the command and the machine. Then the table is printed and
written with all runs to ``OUT/summary.json``; ``--plot`` draws loss against bytes per step (PNG).

    python benchmarks/lm.py                       # DDP and every registered compressor at its paper default
    python benchmarks/lm.py --quick               # smoke: 2 ranks, a tiny model, 6 steps, DDP and DeMo
    python benchmarks/lm.py --long                # the same grid for 2000 steps on the narrower GPT (benchmarks/results/lm_long)
    python benchmarks/lm.py --only ddp demo       # some of the grid
    python benchmarks/lm.py --saved --plot docs/img/lm_loss_vs_bytes.png   # the table and plot of every stored run
    python benchmarks/lm.py --run diloco=recipes/lm/gpt_stdlib_ddp.yaml::--trainer.strategy=diloco
    python benchmarks/lm.py --run mine=recipes/lm/gpt_stdlib_ddp.yaml::--trainer.strategy.class_path=my.Strategy

A strategy is given by registered name or ``class_path`` through the run's overrides, so a new strategy (DiLoCo)
joins the grid with ``--run`` and no change here; it reports its own bytes with a ``bytes_per_step()`` method.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = "recipes/lm/gpt_stdlib_ddp.yaml"
DEMO = "recipes/lm/gpt_stdlib_demo.yaml"
#: ``--long``: 2000 steps of the DiLoCo benchmark's narrower GPT (width 64, context 64), where the 200-step grid
#: cannot resolve 2 % (DDP moves 10 % between seeds there); its DDP row is the same run as docs/diloco.md's
LONG = "recipes/diloco/gpt_stdlib_ddp.yaml"
#: DeMo with its SignSGD on the long recipe, at a quarter of the AdamW rate as in recipes/lm/gpt_stdlib_demo.yaml
LONG_DEMO = ["--trainer.strategy=demo", "--model.init_args.optimizer=signsgd", "--model.init_args.lr=0.001"]
#: the smoke run: 2 ranks, a 1-block width-32 model, 6 steps, 64 KB of corpus
QUICK = ["--trainer.devices=2", "--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
         "--model.init_args.max_steps=6", "--model.init_args.warmup_steps=1", "--model.init_args.model.init_args.width=32",
         "--model.init_args.model.init_args.depth=1", "--data.init_args.max_bytes=65536"]  # fmt: skip


def default_grid(long: bool = False) -> dict[str, tuple[str, list[str]]]:
    """label -> (recipe, overrides): plain DDP and every registered compressor at its paper default (``long``:
    on the 2000-step recipe)."""
    from lightning_gradcomp import registry

    base = LONG if long else BASE
    grid: dict[str, tuple[str, list[str]]] = {"ddp": (base, [])}
    for name in registry.compressor_names():
        if name == "demo":
            grid[name] = (LONG, LONG_DEMO) if long else (DEMO, [])
        else:
            grid[name] = (base, [f"--trainer.strategy={name}"])
    return grid


def command_line(recipe: str, overrides: list[str]) -> str:
    return " ".join(["gradcomp fit --config", recipe, *overrides])


# -- one run (every rank executes this; Lightning's launcher re-runs the same command for ranks 1..N-1) -------
def run_one(label: str, recipe: str, overrides: list[str], out: Path) -> None:
    import torch
    from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
    from lightning.pytorch.cli import LightningCLI

    import lightning_gradcomp  # noqa: F401  (registers the strategy names)

    class Recorder(Callback):
        """Validation loss after every validation, this rank's bytes and seconds per training step."""

        def __init__(self) -> None:
            self.curve: list[tuple[int, float]] = []
            self.bytes: list[int] = []
            self.seconds: list[float] = []
            self.train_seconds: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
            self.seconds.append(time.perf_counter() - self._start)
            self.bytes.append(bytes_per_step(trainer.strategy, module))

        def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
            if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
                self.curve.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))
                self.train_seconds.append(sum(self.seconds))  # training time so far, validation excluded

    recorder = Recorder()
    args = ["--config", str(ROOT / recipe), *overrides, "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]
    cli = LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                       args=args, run=False, save_config_callback=None)
    cli.trainer.callbacks.append(recorder)  # type: ignore[attr-defined]  # set by Lightning's callback connector
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall = time.perf_counter() - start
    if not recorder.curve or recorder.curve[-1][0] != cli.trainer.global_step:
        # every rank: validation runs collectives (a run whose last step is not a validation step)
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        recorder.curve.append((cli.trainer.global_step, float(cli.trainer.callback_metrics["val_loss"])))
        recorder.train_seconds.append(sum(recorder.seconds))
    if cli.trainer.global_rank != 0:
        return
    params = sum(p.numel() for p in cli.model.parameters() if p.requires_grad)
    data = cli.datamodule
    result = {
        "label": label, "command": command_line(recipe, overrides), "recipe": recipe, "overrides": overrides,
        "strategy": type(cli.trainer.strategy).__name__,
        "compressor": getattr(getattr(cli.trainer.strategy, "compressor", None), "describe", lambda: None)(),
        "world_size": cli.trainer.world_size, "steps": cli.trainer.global_step, "parameters": params,
        "tokens_per_step": cli.trainer.world_size * data.batch_size * data.seq_len,
        "val_curve": recorder.curve, "val_train_seconds": recorder.train_seconds, "final_val_loss": recorder.curve[-1][1],
        "bytes_per_step": compressed_step_bytes(cli.trainer.strategy, recorder.bytes),
        "fp32_bytes_per_step": 4 * params,
        # the whole run, warm-up and dense steps included: what a method with phases (1-bit Adam) costs in all
        "total_bytes": total_bytes(recorder.bytes), "fp32_total_bytes": 4 * params * len(recorder.bytes),
        "outer_rounds": int(getattr(cli.trainer.strategy, "stats", {}).get("rounds", 0)),
        "median_step_seconds": statistics.median(recorder.seconds), "fit_seconds": wall,
        "machine": machine(), "python": sys.version.split()[0], "torch": torch.__version__,
        **provenance(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def bytes_per_step(strategy: Any, module: Any) -> int:
    """This rank's payload bytes of the last step: the strategy's own count (``last_step_bytes``), else fp32 DDP's
    (4 per parameter)."""
    if callable(getattr(strategy, "last_step_bytes", None)):
        return int(strategy.last_step_bytes())
    state = getattr(strategy, "comm_state", None)
    if state is not None and state.ledger.records:
        return int(state.last_step_bytes())
    return 4 * sum(p.numel() for p in module.parameters() if p.requires_grad)


def compressed_step_bytes(strategy: Any, per_step: list[int]) -> float:
    """What a compressed step sends, as the stored runs record it: the run's mean where sites exchange every few
    steps (DiLoCo, WeightGrad: one step says little), else the last step's (after any dense warm-up, which
    :func:`total_bytes` counts); the median step without a count of the strategy's own."""
    from lightning_gradcomp.outer.strategy import DiLoCoStrategy
    from lightning_gradcomp.weightgrad.strategy import WeightGradStrategy

    if isinstance(strategy, (DiLoCoStrategy, WeightGradStrategy)):
        return strategy.bytes_per_step()
    if callable(getattr(strategy, "last_step_bytes", None)):
        return per_step[-1]
    return statistics.median(per_step)


def total_bytes(per_step: list[int]) -> int:
    """This rank's payload bytes over the whole run: the sum of its steps' counts (warm-up and dense steps included)."""
    return sum(per_step)


def provenance() -> dict[str, str]:
    """The commit of the code that ran (``+dirty`` with uncommitted changes) and the date: the stamp the docs'
    generated tables carry (``tools/results_tables.py``)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = "+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {"commit": commit + dirty, "date": time.strftime("%Y-%m-%d", time.gmtime())}


def machine() -> str:
    return f"{os.uname().nodename}, {os.cpu_count()} CPUs (shared), Python {sys.version.split()[0]}"


# -- the grid -----------------------------------------------------------------------------------------------
def parse_run(spec: str) -> tuple[str, tuple[str, list[str]]]:
    """``label=recipe::override::override`` -> (label, (recipe, overrides))."""
    label, _, rest = spec.partition("=")
    if not label or not rest:
        raise ValueError(f"Expected `--run` to be LABEL=RECIPE[::OVERRIDE...], but got {spec!r}. "
                         "Fix: e.g. --run mine=recipes/lm/gpt_stdlib_ddp.yaml::--trainer.strategy=fp16")
    recipe, *overrides = rest.split("::")
    return label, (recipe, overrides)


def summarize(results: list[dict[str, Any]], reference: str = "ddp") -> str:
    """The table: final validation loss, relative to ``reference``'s, bytes per step and the ratio to fp32 DDP."""
    ref = next((r for r in results if r["label"] == reference), None)
    versus = "vs DDP" if reference == "ddp" else f"vs {reference}"
    lines = [f"| run | final val loss | {versus} | bytes/step | fp32 DDP / bytes | s/step (median) | command |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rel = f"{100 * (r['final_val_loss'] / ref['final_val_loss'] - 1):+.1f}%" if ref else "n/a"
        ratio = r["fp32_bytes_per_step"] / max(1.0, r["bytes_per_step"])
        lines.append(f"| {r['label']} | {r['final_val_loss']:.4f} | {rel} | {r['bytes_per_step']:.0f} | {ratio:.1f}x | "
                     f"{r['median_step_seconds']:.3f} | `{r['command']}` |")
    return "\n".join(lines)


#: where a point's label may go, in points from it, tried in this order: right, below and above it, then to its left
_LABEL_OFFSETS = ((5, 3, "left"), (5, -11, "left"), (5, 13, "left"), (-5, 3, "right"), (-5, -11, "right"),
                  (5, -21, "left"), (5, 23, "left"))


def _place_labels(ax: Any, labelled: list[tuple[tuple[float, float], str]]) -> None:
    """Annotate each point with its label at the first of :data:`_LABEL_OFFSETS` whose box overlaps no marker and no
    label placed before it (the last offset when all do): labels of nearby points stay readable. Needs the final
    layout."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    # the markers count as placed: a label must not cover another run's point either
    placed: list[Any] = [Bbox.from_extents(px - 4, py - 4, px + 4, py + 4)
                         for px, py in (ax.transData.transform(xy) for xy, _ in labelled)]
    for (x, y), text in labelled:
        for n, (dx, dy, ha) in enumerate(_LABEL_OFFSETS):
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8)
            box = label.get_window_extent(renderer).expanded(1.04, 1.2)
            if n == len(_LABEL_OFFSETS) - 1 or not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            label.remove()


def plot(results: list[dict[str, Any]], path: Path, reference: str = "ddp") -> Path:
    """Final validation loss against bytes per step (log scale), one point per run, and the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5))
    colors = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # tab20 is a ListedColormap
    # runs that land on the same point (ddp = fp32, dgc = topk) get one label, not overprinted ones
    points: dict[tuple[float, float], tuple[tuple[float, float], list[str]]] = {}
    for r in results:
        key = (float(f"{r['bytes_per_step']:.3g}"), round(r["final_val_loss"], 2))
        points.setdefault(key, ((r["bytes_per_step"], r["final_val_loss"]), []))[1].append(r["label"])
    for i, r in enumerate(results):
        color, style = colors[(2 * i) % 20 + (i >= 10)], "-" if i < 10 else "--"
        left.scatter(r["bytes_per_step"], r["final_val_loss"], s=30, color=color)
        steps, losses = zip(*r["val_curve"])
        right.plot(steps, losses, style, marker="o", markersize=3, label=r["label"], color=color,
                   lw=2.5 if r["label"] == reference else 1)
    ref = next((r for r in results if r["label"] == reference), None)
    if ref:
        left.axhline(ref["final_val_loss"] * 1.02, color="grey", ls="--", lw=0.8,
                     label=f"{'DDP' if reference == 'ddp' else reference} + 2%")
        left.legend(fontsize=8)
    left.set_xscale("log")
    # ticks at 1, 2 and 5 of each decade, as "20k": matplotlib's minor labels overprint each other
    left.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1e3:g}k" if x >= 1e3 else f"{x:g}"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("bytes sent per rank per step")
    left.set_ylabel("final validation loss (nats/byte)")
    left.set_title("loss against bytes")
    right.set_xlabel("step")
    right.set_ylabel("validation loss (nats/byte)")
    right.set_title("validation loss curves")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the curves stay visible
    fig.tight_layout()
    _place_labels(left, [(xy, " = ".join(labels)) for _, (xy, labels) in sorted(points.items())])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_grid(grid: dict[str, tuple[str, list[str]]], out_dir: Path, extra: Sequence[str] = (), rerun: bool = False,
             run: bool = True) -> list[dict[str, Any]]:
    """Each run of ``grid`` (label -> (recipe, overrides), ``extra`` added to every run) as its own process, unless
    its JSON is in ``out_dir`` already (``rerun``: always; ``run=False``: never): the stored runs, in grid order."""
    results = []
    for label, (recipe, overrides) in grid.items():
        overrides = [*overrides, *extra]
        path = out_dir / f"{label}.json"
        if run and (rerun or not path.exists()):
            print(f"[lm] {label}: {command_line(recipe, overrides)}", flush=True)
            # every rank runs the same worker command; separate "--worker" items keep overrides verbatim
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", label, str(path), recipe, *overrides]
            subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        results.append(json.loads(path.read_text()))
    return results


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the per-run JSON files (default benchmarks/results/lm; --quick: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, tiny model, 6 steps, DDP and DeMo")
    parser.add_argument("--long", action="store_true",
                        help="the 2000-step grid on the narrower GPT (default --out benchmarks/results/lm_long)")
    parser.add_argument("--only", nargs="*", default=None, help="labels of the default grid to run")
    parser.add_argument("--run", action="append", default=[], help="LABEL=RECIPE[::OVERRIDE...] (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="override added to every run (repeatable)")
    parser.add_argument("--force", action="store_true", help="rerun runs whose JSON exists")
    parser.add_argument("--saved", action="store_true",
                        help="run nothing: the table of every run JSON in --out (those of --only, if given)")
    parser.add_argument("--reference", default="ddp", help="label of the run the table's relative column compares with")
    parser.add_argument("--plot", type=Path, default=None, help="write the loss-against-bytes PNG here")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # --worker LABEL OUT RECIPE OVERRIDES... (overrides verbatim, past argparse)
        label, out, recipe, *overrides = argv[1:]
        run_one(label, recipe, overrides, Path(out))
        return
    args = parser.parse_args(argv)
    grid = default_grid(args.long)
    default_out = ROOT / ("benchmarks/results/lm_long" if args.long else "benchmarks/results/lm")
    if args.saved:  # every stored run, the default grid's first, then the others by label
        stored = sorted(p.stem for p in (args.out or default_out).glob("*.json") if p.stem != "summary")
        stored = [k for k in stored if args.only is None or k in args.only]
        grid = {k: v for k, v in grid.items() if k in stored}
        grid.update((k, ("", [])) for k in stored if k not in grid)
    elif args.quick:
        grid = {k: grid[k] for k in ("ddp", "demo")}
    elif args.only is not None or args.run:
        grid = {k: grid[k] for k in (args.only or [])}
    grid.update(parse_run(spec) for spec in args.run)
    extra = list(args.set) + (QUICK if args.quick else [])
    out_dir = args.out or (Path(tempfile.gettempdir()) / "lm_quick" if args.quick else default_out)
    results = run_grid(grid, out_dir, extra, rerun=not args.saved and (args.force or args.quick), run=not args.saved)
    table = summarize(results, args.reference)
    header = f"python benchmarks/lm.py {' '.join(argv)}\n{results[0]['machine']}"
    print(header + "\n\n" + table)
    (out_dir / "summary.json").write_text(json.dumps({"command": header, "table": table, "runs": results}, indent=1))
    if args.plot:
        print(f"plot: {plot(results, args.plot, args.reference)}")


if __name__ == "__main__":
    main()
