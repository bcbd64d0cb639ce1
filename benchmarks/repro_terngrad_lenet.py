"""TernGrad Fig. 3 at reduced scale: LeNet, total batch 64 over N emulated workers, TernGrad vs fp32.

Runs ``recipes/terngrad/lenet_mnist_fig3.yaml`` (momentum SGD, LR 0.01) and ``lenet_mnist_fig3_sgd.yaml``
(vanilla SGD, LR 0.1) through the same LightningCLI parser as ``gradcomp fit``, on Fashion-MNIST (the offline
dataset here; MNIST is not available), with ``--steps`` iterations instead of 10K (the polynomial decay is
stretched to the shorter run). The fp32 baseline runs once per optimizer: with fp32 gradients the tower
average equals the batch-64 gradient for every N (LeNet has no batch norm), so N does not change it.
Prints one row per run (test accuracy on the 10K test set, with EMA parameters as the paper evaluates) and
the command line that reproduces it.

Usage: python benchmarks/repro_terngrad_lenet.py [--steps 400] [--workers 2 4 8] [--optimizers momentum sgd]
"""

import argparse

import torch
from _recipe_runner import FASHION, command_line, machine, run_recipe

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
    args = parser.parse_args()
    print(f"# machine: {machine()}")
    rows = []
    for opt in args.optimizers:
        runs = [("fp32", 1, "lightning_gradcomp.compressors.Identity")]
        runs += [("terngrad", n, "lightning_gradcomp.compressors.TernGrad") for n in args.workers]
        for method, n, compressor in runs:
            ov = overrides(args.steps, n if method != "fp32" else 1, compressor, args.val_batches)
            torch.manual_seed(0)
            res = run_recipe(RECIPES[opt], ov)
            row = (opt, method, n, res["val_acc"], res["val_loss"], res["seconds"], res.get("bytes_per_step", 0))
            rows.append(row)
            print(f"# {command_line(RECIPES[opt], ov)}", flush=True)
            print(f"{opt:9s} {method:9s} N={n:<3d} test_acc={row[3]:.4f} test_loss={row[4]:.4f} "
                  f"fit_s={row[5]:.0f} bytes/worker/step={row[6]}", flush=True)
    print("\n| optimizer | method | N | steps | test acc (EMA) | test loss | fit s | bytes/worker/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for opt, method, n, acc, loss, sec, nbytes in rows:
        shown = "any" if method == "fp32" else str(n)
        print(f"| {opt} | {method} | {shown} | {args.steps} | {100 * acc:.2f}% | {loss:.4f} | {sec:.0f} | {nbytes} |")


if __name__ == "__main__":
    main()
