"""Gradient Dropping (Aji & Heafield, Fig. 2/4) and AdaComp (Chen et al., Table 2 MNIST-CNN) at reduced scale.

Each run is a paper recipe (``recipes/graddrop/mlp_mnist_*.yaml``, ``recipes/adacomp/mnistcnn_mnist_*.yaml``)
through the same LightningCLI parser as ``gradcomp fit``, with these overrides (printed per run):

* Fashion-MNIST instead of MNIST (the offline dataset here), ``--steps`` iterations instead of 20/100 epochs;
* the workers emulated in one process with :class:`~lightning_gradcomp.strategies.towers.TowerStrategy` (the recipe's own
  compressor block, its workers and their total batch), because 4 or 8 processes do not fit on 2 shared cores;
* graddrop: the MLP narrowed from 3x4096 to ``--hidden`` units per layer.

Printed per run: test accuracy (10K test set), and the measured compression: fp32 bytes over the bytes one
worker put on the wire, summed over all steps, overall and per layer type (conv / fc, AdaComp's ``layer_kind``).
The rows are stored as JSON (``--out``; ``tools/results_tables.py`` prints the docs' tables from them).

Usage: python benchmarks/repro_sparse.py graddrop [--steps 200] [--hidden 512] [--only RUN ...] [--out FILE]
       python benchmarks/repro_sparse.py adacomp [--steps 300] [--out FILE]
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` as a package
from benchmarks._recipe_runner import FASHION, REPRODUCTIONS, ROOT, command_line, machine, provenance, run_recipe, save_results
from lightning.pytorch import Callback

from lightning_gradcomp.compressors.adacomp import layer_kind


class WireBytes(Callback):
    """Sums, per layer type, the fp32 bytes and the bytes one emulated worker sent, after every step."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.dense: dict[str, int] = defaultdict(int)
        self._shapes: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if not self._shapes:
            self._shapes = {n: p.shape for n, p in pl_module.named_parameters()}
        for name, record in trainer.strategy.records.items():
            kind = layer_kind(name, self._shapes[name])
            self.sent[kind] += record.nbytes
            self.dense[kind] += 4 * record.numel


def tower_strategy(recipe: str, workers: int) -> str:
    """The recipe's compressor (or fp32 for a DDP baseline) inside a TowerStrategy of ``workers``, as JSON."""
    strategy = yaml.safe_load((ROOT / recipe).read_text())["trainer"]["strategy"]
    compressor = strategy["init_args"]["compressor"] if isinstance(strategy, dict) else {
        "class_path": "lightning_gradcomp.compressors.Identity"}
    return json.dumps({"class_path": "lightning_gradcomp.TowerStrategy",
                       "init_args": {"num_workers": workers, "compressor": compressor}}, separators=(",", ":"))


GRADDROP = ["baseline", "drop90_global", "drop99_global", "drop999_global", "drop90_layer", "drop99_layer",
            "drop999_layer"]
#: also runnable with --only: Fig. 4's layer norm and the 1-bit variants of Sec. 5.4
GRADDROP_MORE = ["drop99_global_layernorm", "drop99_1bit_threshold", "drop99_1bit_column_mean",
                 "drop99_1bit_global_mean"]


def graddrop_runs(steps: int, hidden: int) -> list[tuple[str, str, list[str]]]:
    runs = []
    for name in GRADDROP + GRADDROP_MORE:
        # per-layer runs at 90% and 99.9% reuse the 99% per-layer recipe with the drop ratio changed
        base = "drop99_layer" if name.endswith("_layer") else name
        recipe = f"recipes/graddrop/mlp_mnist_{base}.yaml"
        strategy = tower_strategy(recipe, 4)
        if name != base:
            strategy = strategy.replace('"drop_ratio":0.99', f'"drop_ratio":0.{name[4:-6]}'.replace("0.999", "0.999"))
        ov = [f"--data={FASHION}", "--data.init_args.data_dir=null", "--data.init_args.val_size=0",
              "--data.init_args.batch_size=160", f"--model.init_args.model.init_args.hidden_dim={hidden}",
              f"--trainer.strategy={strategy}", "--trainer.devices=1", f"--trainer.max_steps={steps}",
              "--trainer.max_epochs=-1"]
        runs.append((name, recipe, ov))
    return runs


def adacomp_runs(steps: int) -> list[tuple[str, str, list[str]]]:
    runs = []
    for name in ("baseline", "adacomp"):
        recipe = f"recipes/adacomp/mnistcnn_mnist_{name}.yaml"
        ov = [f"--data={FASHION}", "--data.init_args.data_dir=null", "--data.init_args.val_size=0",
              "--data.init_args.batch_size=100", f"--trainer.strategy={tower_strategy(recipe, 8)}",
              "--trainer.devices=1", f"--trainer.max_steps={steps}", "--trainer.max_epochs=-1"]
        runs.append((name, recipe, ov))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paper", choices=["graddrop", "adacomp"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--only", nargs="*", default=None, help="run names to run (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to store (default: "
                        "benchmarks/results/reproductions/<paper>_<steps>[_<only>...].json)")
    args = parser.parse_args()
    stamp = provenance()  # the code that runs: the tree may change before the run ends
    steps = args.steps or (200 if args.paper == "graddrop" else 300)
    out = args.out or REPRODUCTIONS / f"{'_'.join([args.paper, str(steps), *(args.only or [])])}.json"
    print(f"# machine: {machine()}")
    runs = graddrop_runs(steps, args.hidden) if args.paper == "graddrop" else adacomp_runs(steps)
    rows = []
    for name, recipe, ov in runs:
        if name not in (args.only or GRADDROP + ["baseline", "adacomp"]):
            continue
        meter = WireBytes()
        res = run_recipe(recipe, ov, callbacks=[meter])
        strategy = json.loads(next(o for o in ov if o.startswith("--trainer.strategy=")).partition("=")[2])
        row = {"run": name, "workers": strategy["init_args"]["num_workers"],
               "compressor": strategy["init_args"]["compressor"], "steps": res["steps"], "test_acc": res["val_acc"],
               "test_loss": res["val_loss"],
               "compression": sum(meter.dense.values()) / max(1, sum(meter.sent.values())),
               "compression_per_kind": {k: meter.dense[k] / max(1, meter.sent[k]) for k in sorted(meter.dense)},
               "fit_seconds": res["seconds"], "command": command_line(recipe, ov)}
        rows.append(row)
        print(f"# {row['command']}", flush=True)
        print(f"{name:16s} test_acc={row['test_acc']:.4f} test_loss={row['test_loss']:.4f} "
              f"compression={row['compression']:.1f}x "
              + " ".join(f"{k}={v:.1f}x" for k, v in row["compression_per_kind"].items())
              + f" fit_s={row['fit_seconds']:.0f}", flush=True)
    print("\n| run | steps | test acc | test loss | compression (all) | per layer type | fit s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        per = ", ".join(f"{k} {v:.1f}x" for k, v in row["compression_per_kind"].items())
        print(f"| {row['run']} | {row['steps']} | {100 * row['test_acc']:.2f}% | {row['test_loss']:.4f} | "
              f"{row['compression']:.1f}x | {per} | {row['fit_seconds']:.0f} |")
    save_results(out, "benchmarks/repro_sparse.py", sys.argv[1:], rows, stamp)


if __name__ == "__main__":
    main()
