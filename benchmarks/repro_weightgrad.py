"""WeightGrad (Akter & Adnan, Table 2) at reduced scale: 2 sites of 2 workers vs plain DDP and flat TernGrad.

Runs ``gradcomp fit`` (a subprocess per run, 4 real Gloo processes on this machine) on the Table 2 recipes
``recipes/weightgrad/cifarnet_cifar10_4workers_{baseline,terngrad,weightgrad}.yaml`` with these overrides:
Fashion-MNIST instead of CIFAR-10 (the offline dataset here), LeNet (Caffe VALID, 431K parameters) instead of
CifarNet (CifarNet takes 24x24 RGB crops), ``--steps`` instead of 50k, and a CSV logger whose last ``val_acc``
(the 10K test set, EMA parameters) is printed, with the WAN/LAN MiB rank 0 sent
(``benchmarks/_wan_meter.py``; a flat strategy's traffic all counts as WAN). Total batch 128 = 4 x 32, 2 sites of 2 as in the recipe.
The rows are stored as JSON (``--out``; ``tools/results_tables.py`` prints the docs' table from them).

Usage: python benchmarks/repro_weightgrad.py [--steps 300] [--runs baseline terngrad weightgrad] [--extra=OVERRIDE ...]
           [--out benchmarks/results/reproductions/weightgrad_300.json]
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` as a package
from benchmarks._recipe_runner import FASHION, REPRODUCTIONS, ROOT, provenance, save_results
LENET = json.dumps({"class_path": "gradcomp_lab.models.LeNet",
                    "init_args": {"num_classes": 10, "in_channels": 1, "image_size": 28, "padding": "valid", "init": "caffe", "conv_relu": False}},
                   separators=(",", ":"))


def overrides(steps: int, log_dir: str) -> list[str]:
    return [
        f"--data={FASHION}", "--data.init_args.data_dir=null", "--data.init_args.val_size=0",
        "--data.init_args.batch_size=32", "--data.init_args.num_workers=0",
        f"--model.init_args.model={LENET}", f"--model.init_args.max_steps={steps}",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", "--trainer.accelerator=cpu",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={log_dir}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.callbacks+=_wan_meter.WanBytes",  # benchmarks/_wan_meter.py (PYTHONPATH=benchmarks)
    ]


def last_metric(log_dir: str, key: str) -> float:
    rows = []
    for path in Path(log_dir).rglob("metrics.csv"):
        with open(path) as handle:
            rows += [r for r in csv.DictReader(handle) if r.get(key)]
    return float(rows[-1][key]) if rows else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="+", default=["baseline", "terngrad", "weightgrad"])
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run, e.g. "
                        "--extra=--trainer.strategy.init_args.staleness_bound=1")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to store (default: "
                        "benchmarks/results/reproductions/weightgrad_<steps>.json)")
    args = parser.parse_args()
    stamp = provenance()  # the code that runs: the tree may change before the run ends
    out = args.out or REPRODUCTIONS / f"weightgrad_{args.steps}.json"
    print(f"# machine: {os.uname().nodename}, {os.cpu_count()} CPUs; 4 Gloo processes per run")
    rows = []
    for name in args.runs:
        recipe = f"recipes/weightgrad/cifarnet_cifar10_4workers_{name}.yaml"
        with tempfile.TemporaryDirectory() as log_dir:
            ov = overrides(args.steps, log_dir) + list(args.extra)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=f"{ROOT}:{ROOT / 'benchmarks'}")
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "gradcomp_lab.cli", "fit", "--config", recipe, *ov],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                print(proc.stderr[-3000:])
                raise SystemExit(f"{name} failed")
            acc, loss = last_metric(log_dir, "val_acc"), last_metric(log_dir, "val_loss")
            wan, lan = last_metric(log_dir, "wan_mb"), last_metric(log_dir, "lan_mb")
        shown = [o if "save_dir" not in o else "--trainer.logger.init_args.save_dir=LOGS" for o in ov]
        row = {"run": name, "steps": args.steps, "extra": list(args.extra), "test_acc": acc, "test_loss": loss,
               "rank0_wan_mib": wan, "rank0_lan_mib": lan, "wall_seconds": seconds,
               "command": f"gradcomp fit --config {recipe} {' '.join(shown)}"}
        print(f"# {row['command']}", flush=True)
        print(f"{name:10s} test_acc={acc:.4f} test_loss={loss:.4f} rank0_wan_MiB={wan:.1f} rank0_lan_MiB={lan:.1f} "
              f"wall_s={seconds:.0f}", flush=True)
        rows.append(row)
    print("\n| run | steps | test acc (EMA) | test loss | rank 0 WAN MiB | rank 0 LAN MiB | wall s (4 processes) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['run']} | {row['steps']} | {100 * row['test_acc']:.2f}% | {row['test_loss']:.4f} | "
              f"{row['rank0_wan_mib']:.1f} | {row['rank0_lan_mib']:.1f} | {row['wall_seconds']:.0f} |")
    save_results(out, "benchmarks/repro_weightgrad.py", sys.argv[1:], rows, stamp)


if __name__ == "__main__":
    main()
