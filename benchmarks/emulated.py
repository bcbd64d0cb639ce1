"""Time to a target validation loss on the emulated cluster, over a 1 Gbit/s and a 100 Mbit/s link between two sites.

Two grids of the language-model benchmark's runs (``benchmarks/lm.py --worker``), each on 4 ranks launched by
``gradcomp_lab.emulate`` as 2 sites of 2: every rank in its own network namespace, a 10 Gbit/s link inside a
site, the WAN rate between the sites' bridges.

* ``--grid diloco``: DiLoCo with int8 pseudo-gradients against DDP, bf16 DDP and the best per-step
  compressor, on the DiLoCo benchmark's recipes (1000 steps of 4 x 8 x 64 tokens, validated every 200). DiLoCo's
  sites are the emulator's (``site_size=2``): inner DDP over the fast link, the outer round over the slow one.
* ``--grid sharded``: the language-model benchmark's GPT sharded by FSDP2 inside each site (2 replicas of 2 shards):
  dense HSDP, HSDP with bf16, int8 and TernGrad shards between the sites, and DiLoCo over the shards.
* ``--grid fsdp_cross_node``: the same GPT sharded over all 4 ranks of the 2 sites, at 1 Gbit/s and 10 Gbit/s
  between them: stock FSDP2 over all ranks (``sharded_fp32`` with ``shard_size=4``), the compressed collectives
  across nodes (``compress_across_nodes=True``: the int8 reduce-scatter, then also ``quantize_weights=True``), and
  the HSDP engine (``shard_size=2``, int8 between the sites) for comparison.
* ``--grid lm_long``: 1-bit Adam and 0/1 Adam at their measured settings on the 2000-step grid
  (``recipes/lm/gpt_small_onebit_adam_b64.yaml``, ``gpt_small_zero_one_adam_b64.yaml``), against DDP and bf16 DDP,
  validated every 100 steps.
* ``--grid lm``: the per-step compressors on the language-model benchmark's recipes (``recipes/lm``,
  200 steps of 4 x 8 x 128 tokens, validated every 25): plain DDP, bf16 DDP, PowerSGD at ranks 1 and 4, and the
  compressors and settings of ``docs/transformers.md`` that came within a few percent of DDP's loss.

Training time excludes validation; the time to the target is interpolated linearly between the validations that
bracket its first crossing. Needs root (network namespaces).

    sudo python benchmarks/emulated.py --grid diloco                    # both WAN rates (about 25 min on 2 cores)
    python benchmarks/emulated.py --grid diloco --saved --target 1.3    # the tables of the stored runs
    sudo python benchmarks/emulated.py --grid lm                        # both WAN rates
    python benchmarks/emulated.py --grid lm --saved --target 2.6
    sudo python benchmarks/emulated.py --grid sharded                   # both WAN rates
    python benchmarks/emulated.py --grid sharded --saved --target 2.45
    sudo python benchmarks/emulated.py --grid fsdp_cross_node          # 1 and 10 Gbit/s (about 30 min on 2 cores)
    python benchmarks/emulated.py --grid fsdp_cross_node --saved --target 2.45
    sudo python benchmarks/emulated.py --grid lm_long                   # both WAN rates
    python benchmarks/emulated.py --grid lm_long --saved --target 0.8

The sharded and cross-node grids' tables also give the performance model's prediction of each run's step
(``gradcomp_lab.perfmodel.predict_from_stored``): from the same run's measured step on the other WAN rate, with that
link's communication swapped for this one's, and its error against the step measured here.
"""

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lm import command_line  # noqa: E402

#: PowerSGD at another rank than its recipe's, as a command-line override of the language-model recipes
_RANK = ["--trainer.strategy=lightning_gradcomp.GradCompStrategy",
         "--trainer.strategy.init_args.compressor=lightning_gradcomp.compressors.PowerSGD",
         "--trainer.strategy.init_args.compressor.init_args.rank={}"]


_SHARDED = "recipes/lm/gpt_stdlib_sharded_terngrad.yaml"
#: the model sharded over all 4 ranks, its collectives compressed between the 2 sites (nodes of 2 ranks)
_ACROSS = ["--trainer.strategy.init_args.compressor=int8", "--trainer.strategy.init_args.shard_size=4",
           "--trainer.strategy.init_args.compress_across_nodes=true", "--trainer.strategy.init_args.node_size=2",
           "--trainer.strategy.init_args.resume_compression=reset"]
#: the cross-node grid's runs (``benchmarks/fsdp_cross_node.py`` runs the same for the loss over seeds)
CROSS_NODE_RUNS: dict[str, tuple[str, list[str]]] = {
    "fsdp_fp32": (_SHARDED, ["--trainer.strategy.init_args.compressor=fp32", "--trainer.strategy.init_args.shard_size=4"]),
    "across_int8": (_SHARDED, _ACROSS),
    "across_int8_weights": (_SHARDED, [*_ACROSS, "--trainer.strategy.init_args.quantize_weights=true"]),
    "hsdp_int8": (_SHARDED, ["--trainer.strategy.init_args.compressor=int8"]),
}
WANS = ("1gbit", "100mbit")


@dataclass(frozen=True)
class Grid:
    """Runs (label -> recipe and overrides), the overrides every run gets, where the results go, the run the others'
    time to the target is compared with, and whether the tables show the performance model's prediction."""

    runs: dict[str, tuple[str, list[str]]]
    common: list[str]
    out: Path
    baseline: str = "ddp"
    predicted: bool = False
    wans: tuple[str, ...] = WANS


GRIDS = {
    # 1000 steps (the benchmark's schedule over half the run), validated every 200: a multiple of H = 50, so
    # DiLoCo's sites are identical when validated
    "diloco": Grid({
        "ddp": ("recipes/diloco/gpt_stdlib_ddp.yaml", []),
        "bf16": ("recipes/diloco/gpt_stdlib_ddp.yaml", ["--trainer.strategy=bf16"]),
        "powersgd_r4": ("recipes/diloco/gpt_stdlib_powersgd_r4.yaml", []),
        "diloco_int8_h50": ("recipes/diloco/gpt_stdlib_diloco_int8.yaml", ["--trainer.strategy.init_args.site_size=2"]),
    }, ["--trainer.max_steps=1000", "--trainer.val_check_interval=200"], ROOT / "benchmarks/results/diloco_emulated"),
    "lm": Grid({
        "ddp": ("recipes/lm/gpt_stdlib_ddp.yaml", []),
        "bf16": ("recipes/lm/gpt_stdlib_bf16.yaml", []),
        "powersgd_r1": ("recipes/lm/gpt_stdlib_powersgd.yaml", []),
        "powersgd_r4": ("recipes/lm/gpt_stdlib_ddp.yaml", [o.format(4) for o in _RANK]),
        "powersgd_r16": ("recipes/lm/gpt_stdlib_powersgd_r16.yaml", []),
        "terngrad": ("recipes/lm/gpt_stdlib_terngrad.yaml", []),
        "qsgd": ("recipes/lm/gpt_stdlib_qsgd.yaml", []),
        "demo_k64": ("recipes/lm/gpt_stdlib_demo_k64.yaml", []),
    }, ["--trainer.val_check_interval=25"], ROOT / "benchmarks/results/lm_emulated"),
    # the 2000-step grid (docs/transformers.md), where 1-bit Adam and 0/1 Adam were measured: their recipes, against
    # AdamW DDP and bf16 DDP; the 200-step benchmark is too short for a method that freezes Adam's variance
    "lm_long": Grid({
        "ddp": ("recipes/diloco/gpt_stdlib_ddp.yaml", []),
        "bf16": ("recipes/diloco/gpt_stdlib_ddp.yaml", ["--trainer.strategy=bf16"]),
        "onebit_adam": ("recipes/lm/gpt_small_onebit_adam_b64.yaml", []),
        "zero_one_adam": ("recipes/lm/gpt_small_zero_one_adam_b64.yaml", []),
    }, ["--trainer.val_check_interval=100"], ROOT / "benchmarks/results/lm_long_emulated"),
    # 2 replicas (sites) of 2 FSDP2 shards: dense HSDP (fp32 through the hook, the bytes of FSDP2's own all-reduce),
    # compressed HSDP, and DiLoCo over the shards with int8 pseudo-gradients every 50 steps
    "sharded": Grid({
        "hsdp_fp32": (_SHARDED, ["--trainer.strategy.init_args.compressor=fp32"]),
        "hsdp_bf16": (_SHARDED, ["--trainer.strategy.init_args.compressor=bf16"]),
        "hsdp_int8": (_SHARDED, ["--trainer.strategy.init_args.compressor=int8"]),
        "hsdp_terngrad": (_SHARDED, []),
        "sharded_diloco_int8_h50": (_SHARDED, [
            "--trainer.strategy=lightning_gradcomp.ShardedDiLoCoStrategy", "--trainer.strategy.init_args.shard_size=2",
            "--trainer.strategy.init_args.compressor=int8", "--trainer.strategy.init_args.sync_every=50",
            "--trainer.strategy.init_args.outer_lr=0.7", "--trainer.strategy.init_args.outer_momentum=0.9",
            "--trainer.strategy.init_args.outer_nesterov=true"]),
    }, ["--trainer.val_check_interval=25"], ROOT / "benchmarks/results/sharded_emulated", "hsdp_fp32", True),
    # the model sharded across the 2 sites (nodes): stock FSDP2 over all ranks against the compressed collectives
    # across nodes and against HSDP (the model in each node's shards)
    "fsdp_cross_node": Grid(CROSS_NODE_RUNS, ["--trainer.val_check_interval=25"],
                            ROOT / "benchmarks/results/fsdp_cross_node_emulated", "fsdp_fp32", True, ("1gbit", "10gbit")),
}
LAN = "10gbit"


def time_to(run: dict[str, Any], target: float) -> Optional[float]:
    """Training seconds until the validation loss first reaches ``target`` (linear between validations)."""
    points = [(0.0, float("inf"))] + [(t, loss) for t, (_, loss) in zip(run["val_train_seconds"], run["val_curve"])]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            if l0 == float("inf"):
                return t1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def predictions(out: Path, wan: str, runs: list[dict[str, Any]], wans: tuple[str, ...] = WANS
                ) -> dict[str, tuple[str, float]]:
    """The performance model's step for each of ``runs`` (measured on ``wan``), by label: predicted from the same
    run stored under ``out`` for the other WAN rate (:func:`gradcomp_lab.perfmodel.predict_from_stored`), with
    that rate; a run not stored for another rate has none."""
    from gradcomp_lab.perfmodel import predict_from_stored

    found = {}
    for other in (w for w in wans if w != wan):
        for r in runs:
            path = out / other / f"{r['label']}.json"
            if r["label"] not in found and path.exists():
                found[r["label"]] = (other, predict_from_stored(json.loads(path.read_text()), other, r, wan, LAN))
    return found


def summarize(results: dict[str, list[dict[str, Any]]], target: float, baseline: str = "ddp",
              predicted: Optional[dict[str, dict[str, tuple[str, float]]]] = None) -> str:
    """The tables of ``results`` (WAN rate -> runs); ``baseline``: the label whose time to the target the others'
    is compared with; ``predicted``: WAN rate -> label -> (the rate it was predicted from, the predicted step),
    shown beside the measured step."""
    lines = []
    for wan, runs in results.items():
        base_time = next((time_to(r, target) for r in runs if r["label"] == baseline), None)
        model = None if predicted is None else predicted.get(wan, {})
        extra = "" if model is None else " predicted s/step (from) | error |"
        lines += [f"\nWAN {wan} (LAN {LAN}), target validation loss {target}:\n",
                  f"| run | final val loss | s/step (median) |{extra} bytes/rank/step | time to target (s) | "
                  f"{'DDP' if baseline == 'ddp' else baseline} time / this | command |",
                  "| --- " * (7 + (0 if model is None else 2)) + "|"]
        for r in runs:
            t = time_to(r, target)
            speedup = f"{base_time / t:.2f}x" if t and base_time else "n/a"
            cells = ""
            if model is not None:
                source, step = model.get(r["label"], ("", float("nan")))
                cells = (f" {step:.3f} ({source}) | {step / r['median_step_seconds'] - 1:+.1%} |" if source
                         else " n/a | n/a |")
            lines.append(f"| {r['label']} | {r['final_val_loss']:.4f} | {r['median_step_seconds']:.3f} |{cells} "
                         f"{r['bytes_per_step']:.0f} | {'not reached' if t is None else f'{t:.0f}'} | {speedup} | "
                         f"`{r['command']}` |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="diloco", help="which runs (see the docstring)")
    parser.add_argument("--out", type=Path, default=None, help="where the JSONs go (default: the grid's own folder)")
    parser.add_argument("--only", nargs="*", default=None, help="labels of the grid")
    parser.add_argument("--wan", nargs="*", default=None, help="WAN rates (default: the grid's)")
    parser.add_argument("--target", type=float, default=1.0, help="validation loss to reach (nats per byte)")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--set", action="append", default=[],
                        help="override added to every run (repeatable; e.g. a smoke's --trainer.max_steps=6)")
    parser.add_argument("--saved", action="store_true", help="run nothing: the tables of the stored runs")
    args = parser.parse_args(argv)
    grid = GRIDS[args.grid]
    out = grid.out if args.out is None else args.out
    results: dict[str, list[dict[str, Any]]] = {}
    for wan in grid.wans if args.wan is None else args.wan:
        for label, (recipe, overrides) in grid.runs.items():
            if args.only is not None and label not in args.only:
                continue
            path = out / wan / f"{label}.json"
            overrides = [*overrides, *grid.common, *args.set]
            if not args.saved and (args.force or not path.exists()):
                print(f"[emulated {wan}] {label}: {command_line(recipe, overrides)}", flush=True)
                cmd = [sys.executable, "-m", "gradcomp_lab.emulate", "--nproc", "4", "--sites", "2",
                       "--bandwidth", LAN, "--wan-bandwidth", wan, "--timeout", "1800", "--",
                       sys.executable, str(ROOT / "benchmarks/lm.py"), "--worker", label, str(path), recipe, *overrides]
                subprocess.run(cmd, check=True, cwd=ROOT)
            if path.exists():
                results.setdefault(wan, []).append(json.loads(path.read_text()))
    if not results:
        raise SystemExit(f"Expected stored runs under {out} for --saved, but got none. Fix: run "
                         f"`sudo python benchmarks/emulated.py --grid {args.grid}` first (the emulated links need root).")
    predicted = ({wan: predictions(out, wan, runs, grid.wans) for wan, runs in results.items()} if grid.predicted
                 else None)
    table = summarize(results, args.target, grid.baseline, predicted)
    header = f"python benchmarks/emulated.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    machine = next(iter(results.values()))[0]["machine"]
    print(f"{header}\n{machine}\n{table}")
    (out / "summary.json").write_text(json.dumps({"command": header, "table": table, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
