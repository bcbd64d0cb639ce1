"""Do the ``<name>_lm`` presets and the frozen-variance Adams carry over to transformers they were not tuned on?

Two workloads, both GPTs on the Python standard library's sources with tied input/output embeddings, 2 Gloo ranks
(each run is one of ``benchmarks/lm.py``'s runs, through its runner):

* ``lm``: the LM benchmark's 2000-step byte-level GPT (``recipes/diloco/gpt_stdlib_ddp.yaml``, vocabulary 256, AdamW
  betas 0.9/0.95), at 2 ranks of 16 sequences (the recipe's 4 ranks of 8: the same 2048 tokens per step);
* ``pieces``: the word-piece GPT (``recipes/lm/gpt_pieces_ddp.yaml``, vocabulary 2048, its embedding 56 % of the
  parameters, AdamW betas 0.9/0.999, lr 0.003).

Each is run with AdamW DDP, ``qsgd_lm``, ``terngrad_lm``, ``graddrop_lm``, ``demo_lm`` (with the SignSGD rate and
warm-up its preset was measured with), and ``onebit_adam`` / ``zero_one_adam`` with their optimizers at default
options, for 200 and 2000 steps (the recipe's warm-up, 5 % of the run, scaled; validation every eighth of the run),
seeds 0-2. One JSON per run under ``benchmarks/results/presets_generalise/<workload>/<config>_s<steps>_seed<n>.json``
(skipped when it exists, so the grid resumes; a run that stops with an error is stored as ``"failed"``). The table:
per workload, length and setting, the final validation loss and the mean validation loss over the run against DDP
(each the mean over seeds of the paired ratio minus one), and fp32 DDP's bytes over the setting's over the whole run
(dense and warm-up steps included; seed 0).

    python benchmarks/presets_generalise.py                       # the whole grid (resumes), then the table
    python benchmarks/presets_generalise.py --steps 200           # only the 200-step runs
    python benchmarks/presets_generalise.py --saved               # the table of the stored runs, running nothing
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lm import LONG, command_line, run_grid  # noqa: E402  (after the path)

OUT = ROOT / "benchmarks/results/presets_generalise"
#: workload -> (recipe, overrides): both at 2 ranks
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "lm": (LONG, ["--trainer.devices=2", "--data.init_args.batch_size=16"]),
    "pieces": ("recipes/lm/gpt_pieces_ddp.yaml", []),
}
#: DeMo's preset was measured with its SignSGD at this rate and a 15 % warm-up (strategies/presets.py)
_DEMO_LR, _DEMO_WARMUP = 0.007, 0.15
#: setting -> overrides (the optimizer's and the strategy's); every other option at its default
CONFIGS: dict[str, list[str]] = {
    "ddp": [],
    "qsgd_lm": ["--trainer.strategy=qsgd_lm"],
    "terngrad_lm": ["--trainer.strategy=terngrad_lm"],
    # terngrad_lm with its embeddings' rows by QSGD (31 levels, a norm per row) instead of fp32
    "terngrad_rows": ["--trainer.strategy=lightning_gradcomp.PresetStrategy", "--trainer.strategy.init_args.preset=terngrad_lm",
                      "--trainer.strategy.init_args.row_levels=31"],
    "graddrop_lm": ["--trainer.strategy=graddrop_lm"],
    "demo_lm": ["--trainer.strategy=demo_lm", "--model.init_args.optimizer=signsgd", f"--model.init_args.lr={_DEMO_LR}"],
    "onebit_adam": ["--trainer.strategy=onebit_adam", "--model.init_args.optimizer=onebit_adam"],
    "zero_one_adam": ["--trainer.strategy=zero_one_adam", "--model.init_args.optimizer=zero_one_adam"],
}
STEPS = (200, 2000)
SEEDS = (0, 1, 2)


def label(config: str, steps: int, seed: int) -> str:
    return f"{config}_s{steps}_seed{seed}"


def overrides(config: str, steps: int, seed: int) -> list[str]:
    """The run's overrides on its workload's recipe: length, warm-up (5 % of the run; DeMo's 15 %), validation
    every eighth of the run, seed, and the setting's."""
    warmup = round((_DEMO_WARMUP if config == "demo_lm" else 0.05) * steps)
    return [f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps // 8}",
            f"--model.init_args.warmup_steps={warmup}", f"--seed_everything={seed}", *CONFIGS[config]]


def run(workload: str, config: str, steps: int, seed: int) -> None:
    """One run, stored (or stored as failed) unless stored already."""
    recipe, base = WORKLOADS[workload]
    out = OUT / workload
    name = label(config, steps, seed)
    if (out / f"{name}.json").exists():
        return
    args = [*base, *overrides(config, steps, seed)]
    try:
        run_grid({name: (recipe, args)}, out)
    except subprocess.CalledProcessError as error:  # a run that stops (diverged) is a result too
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({"label": name, "failed": True, "returncode": error.returncode,
                                                      "command": command_line(recipe, args)}, indent=1))


def load(workload: str) -> dict[str, dict[str, Any]]:
    """label -> stored run of ``workload``."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((OUT / workload).glob("*.json"))}


def mean_loss(run: dict[str, Any]) -> float:
    """The mean of the run's validation losses (every eighth of the run)."""
    return statistics.mean(loss for _, loss in run["val_curve"])


def compare(runs: dict[str, dict[str, Any]], config: str, steps: int) -> Optional[dict[str, Any]]:
    """The setting's row against DDP at the same length over the seeds both have stored: ``None`` when none."""
    pairs = [(runs[label(config, steps, s)], runs[label("ddp", steps, s)]) for s in SEEDS
             if label(config, steps, s) in runs and label("ddp", steps, s) in runs]
    if not pairs:
        return None
    failed = sum(1 for r, _ in pairs if r.get("failed"))
    ok = [(r, d) for r, d in pairs if not r.get("failed")]
    row: dict[str, Any] = {"config": config, "steps": steps, "seeds": len(pairs), "failed": failed}
    if ok:
        row["final_gap"] = 100 * statistics.mean(r["final_val_loss"] / d["final_val_loss"] - 1 for r, d in ok)
        row["mean_gap"] = 100 * statistics.mean(mean_loss(r) / mean_loss(d) - 1 for r, d in ok)
        row["final_val_loss"] = statistics.mean(r["final_val_loss"] for r, _ in ok)
        first = ok[0][0]
        row["bytes_ratio"] = first["fp32_total_bytes"] / first["total_bytes"]
    return row


def rows(workload: str, runs: Optional[dict[str, dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """Every stored setting's row of ``workload``, by length then setting."""
    runs = load(workload) if runs is None else runs
    found = [compare(runs, c, s) for s in STEPS for c in CONFIGS]
    return [r for r in found if r is not None]


def table(runs: dict[str, dict[str, dict[str, Any]]], configs: Optional[list[str]] = None) -> str:
    """The markdown table of stored runs (workload -> label -> run), the settings ``configs`` (default all) and DDP."""
    lines = ["| workload | steps | setting | seeds | final val loss | final vs DDP | mean over the run vs DDP | "
             "fp32 DDP / bytes over the run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload, stored in runs.items():
        for r in rows(workload, stored):
            if configs is not None and r["config"] not in configs:
                continue
            seeds = f"{r['seeds']}" + (f" ({r['failed']} stopped)" if r["failed"] else "")
            head = f"| {workload} | {r['steps']} | {r['config']} | {seeds}"
            if "final_gap" not in r:
                lines.append(f"{head} | stopped | | | |")
                continue
            lines.append(f"{head} | {r['final_val_loss']:.4f} | {r['final_gap']:+.1f} % | {r['mean_gap']:+.1f} % | "
                         f"{r['bytes_ratio']:.1f}x |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", nargs="*", type=int, default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS), choices=list(SEEDS))
    parser.add_argument("--saved", action="store_true", help="run nothing: the table of the stored runs")
    args = parser.parse_args(argv)
    if not args.saved:
        # short runs first, then one seed of every setting at a time: a grid cut short still compares everything
        for steps in sorted(args.steps):
            for seed in args.seeds:
                for workload in args.workloads:
                    for config in args.configs:
                        run(workload, config, steps, seed)
    print(f"python benchmarks/presets_generalise.py {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    for workload in args.workloads:
        print(f"{workload}: {' '.join([WORKLOADS[workload][0], *WORKLOADS[workload][1]])}")
    print("\n" + table({w: load(w) for w in args.workloads}, args.configs))


if __name__ == "__main__":
    main()
