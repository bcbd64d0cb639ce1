"""TernGrad Fig. 3 at reduced scale: LeNet, total batch 64 over N emulated workers, TernGrad vs fp32.

Runs ``recipes/terngrad/lenet_mnist_fig3.yaml`` (momentum SGD, LR 0.01) and ``lenet_mnist_fig3_sgd.yaml``
(vanilla SGD, LR 0.1) through the same LightningCLI parser as ``gradcomp fit``, on Fashion-MNIST (the offline
dataset here; MNIST is not available), with ``--steps`` iterations instead of 10K (the polynomial decay is
stretched to the shorter run). The fp32 baseline runs once per optimizer: with fp32 gradients the tower
average equals the batch-64 gradient for every N (LeNet has no batch norm), so N does not change it.
Prints one row per run (test accuracy on the 10K test set, with EMA parameters as the paper evaluates) and
the command line that reproduces it, and stores the rows as JSON (``--out``; ``tools/results_tables.py`` prints
the docs' table from it).

Usage: python benchmarks/repro_terngrad_lenet.py [--steps 400] [--workers 2 4 8] [--optimizers momentum sgd]
           [--out benchmarks/results/reproductions/terngrad_lenet_momentum.json]
"""

import argparse
import sys
from pathlib import Path

import torch
import yaml
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` as a package
from benchmarks._recipe_runner import FASHION, REPRODUCTIONS, ROOT, command_line, machine, provenance, run_recipe, save_results

RECIPES = {"momentum": "recipes/terngrad/lenet_mnist_fig3.yaml", "sgd": "recipes/terngrad/lenet_mnist_fig3_sgd.yaml"}


def overrides(steps: int, workers: int, compressor: str, val_batches: float) -> list[str]:
    return [
        f"--data={FASHION}", "--data.init_args.data_dir=null", "--data.init_args.val_size=0",
        f"--trainer.max_steps={steps}", f"--model.init_args.max_steps={steps}",
        f"--trainer.val_check_interval={steps}", f"--trainer.limit_val_batches={val_batches}",
        f"--trainer.strategy.init_args.num_workers={workers}",
        f"--trainer.strategy.init_args.compressor={compressor}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--optimizers", nargs="+", default=["momentum", "sgd"], choices=sorted(RECIPES))
    parser.add_argument("--val-batches", type=float, default=1.0, help="fraction of the test set evaluated")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to store (default: "
                        "benchmarks/results/reproductions/terngrad_lenet_<optimizers>.json)")
    args = parser.parse_args()
    stamp = provenance()  # the code that runs: the tree may change before the run ends
    out = args.out or REPRODUCTIONS / f"terngrad_lenet_{'_'.join(args.optimizers)}.json"
    print(f"# machine: {machine()}")
    rows = []
    for opt in args.optimizers:
        lr = yaml.safe_load((ROOT / RECIPES[opt]).read_text())["model"]["init_args"]["lr"]
        runs = [("fp32", 1, "lightning_gradcomp.compressors.Identity")]
        runs += [("terngrad", n, "lightning_gradcomp.compressors.TernGrad") for n in args.workers]
        for method, n, compressor in runs:
            ov = overrides(args.steps, n if method != "fp32" else 1, compressor, args.val_batches)
            torch.manual_seed(0)
            res = run_recipe(RECIPES[opt], ov)
            row = {"optimizer": opt, "lr": lr, "method": method, "workers": n, "steps": res["steps"],
                   "test_acc": res["val_acc"], "test_loss": res["val_loss"], "fit_seconds": res["seconds"],
                   "bytes_per_step": res.get("bytes_per_step", 0), "command": command_line(RECIPES[opt], ov)}
            rows.append(row)
            print(f"# {row['command']}", flush=True)
            print(f"{opt:9s} {method:9s} N={n:<3d} test_acc={row['test_acc']:.4f} test_loss={row['test_loss']:.4f} "
                  f"fit_s={row['fit_seconds']:.0f} bytes/worker/step={row['bytes_per_step']}", flush=True)
    print("\n| optimizer | method | N | steps | test acc (EMA) | test loss | fit s | bytes/worker/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        shown = "any" if row["method"] == "fp32" else str(row["workers"])
        print(f"| {row['optimizer']} | {row['method']} | {shown} | {row['steps']} | {100 * row['test_acc']:.2f}% | "
              f"{row['test_loss']:.4f} | {row['fit_seconds']:.0f} | {row['bytes_per_step']} |")
    save_results(out, "benchmarks/repro_terngrad_lenet.py", sys.argv[1:], rows, stamp)


if __name__ == "__main__":
    main()
