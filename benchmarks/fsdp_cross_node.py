"""A model sharded across nodes: the language-model benchmark's loss with the compressed collectives across nodes
against stock FSDP2 over all ranks, 3 seeds; and the one command for their time to a target loss on the emulated
cluster.

The runs are ``benchmarks/emulated.py``'s ``fsdp_cross_node`` grid (``CROSS_NODE_RUNS``): the language-model
benchmark's GPT (``recipes/lm/gpt_stdlib_sharded_terngrad.yaml``, 200 steps of 4 x 8 x 128 tokens) sharded over all
4 ranks, read as 2 nodes of 2:

* ``fsdp_fp32``: stock FSDP2 over all ranks (``sharded_fp32`` with ``shard_size=4``: one replica, plain FSDP2);
* ``across_int8``: ``compress_across_nodes=True, node_size=2``, the int8 reduce-scatter between nodes;
* ``across_int8_weights``: the same and ``quantize_weights=True`` (the weights' all-gather in int8 between nodes);
* ``hsdp_int8``: the HSDP engine (``shard_size=2``, int8 between the nodes), for the time grid only.

The loss (deterministic, no emulation: plain Gloo on this machine), one JSON per run and seed under
``benchmarks/results/fsdp_cross_node/seed<N>/``:

    python benchmarks/fsdp_cross_node.py                 # 3 seeds x 3 runs (about 3 min per run on 2 cores)
    python benchmarks/fsdp_cross_node.py --saved         # the table of the stored runs
    python benchmarks/fsdp_cross_node.py --quick         # smoke: 1 seed, 6 steps, a width-32 model

The time to the target loss at 1 Gbit/s and 10 Gbit/s between the 2 nodes (10 Gbit/s inside each), with
``gradcomp-perf``'s prediction beside each row (``gradcomp_lab.perfmodel.cross_node_fsdp_comm_seconds``), needs root
(network namespaces) and a quiet machine: 4 runs x 2 links, about 30 minutes on 2 cores (8 runs of 3 to 4 minutes):

    sudo python benchmarks/emulated.py --grid fsdp_cross_node
    python benchmarks/emulated.py --grid fsdp_cross_node --saved --target 2.45
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.emulated import CROSS_NODE_RUNS  # noqa: E402
from benchmarks.lm import QUICK, command_line  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "fsdp_cross_node"
SEEDS = (0, 1, 2)
#: the loss grid: stock against the compressed collectives across nodes
LOSS_RUNS = ("fsdp_fp32", "across_int8", "across_int8_weights")
REFERENCE = "fsdp_fp32"


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Final validation loss per seed, their mean, and the mean against stock FSDP2's; bytes per rank and step
    between nodes (the strategy's ledgers; stock FSDP2's are not counted by the library: ``n/a``)."""
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    reference = runs.get(REFERENCE, {})
    base = statistics.mean(r["final_val_loss"] for r in reference.values()) if reference else None
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs fsdp_fp32 | bytes/rank/step between "
             "nodes | command (seed 0) |", "| --- " * (len(seeds) + 5) + "|"]
    for label, by_seed in runs.items():
        losses = [by_seed[s]["final_val_loss"] if s in by_seed else float("nan") for s in seeds]
        mean = statistics.mean(losses)
        first = by_seed[min(by_seed)]
        nbytes = "n/a" if label == REFERENCE else f"{first['bytes_per_step']:,.0f}"
        versus = f"{mean / base - 1:+.2%}" if base else "n/a"
        lines.append(f"| {label} | " + " | ".join(f"{x:.4f}" for x in losses) + f" | {mean:.4f} | {versus} | {nbytes} | "
                     f"`{first['command']}` |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    parser.add_argument("--only", nargs="*", default=None, help="labels of the runs")
    parser.add_argument("--force", action="store_true", help="rerun runs whose JSON exists")
    parser.add_argument("--saved", action="store_true", help="run nothing: the table of the stored runs")
    parser.add_argument("--quick", action="store_true", help="smoke: one seed, 6 steps, a width-32 model, under /tmp")
    args = parser.parse_args(argv)
    out, seeds = args.out, args.seeds
    extra: list[str] = []
    if args.quick:
        out, seeds = Path("/tmp/fsdp_cross_node_quick"), seeds[:1]
        extra = [o for o in QUICK if not o.startswith("--trainer.devices")]  # 4 ranks: 2 nodes of 2
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for label in LOSS_RUNS:
        if args.only is not None and label not in args.only:
            continue
        recipe, overrides = CROSS_NODE_RUNS[label]
        for seed in seeds:
            path = out / f"seed{seed}" / f"{label}.json"
            run_overrides = [*overrides, f"--seed_everything={seed}", *extra]
            if not args.saved and (args.force or args.quick or not path.exists()):
                print(f"[fsdp_cross_node] seed {seed} {label}: {command_line(recipe, run_overrides)}", flush=True)
                cmd = [sys.executable, str(ROOT / "benchmarks/lm.py"), "--worker", label, str(path), recipe,
                       *run_overrides]
                subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if path.exists():
                runs.setdefault(label, {})[seed] = json.loads(path.read_text())
    if not runs:
        print("no stored runs")
        return
    table = summarize(runs)
    header = f"python benchmarks/fsdp_cross_node.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    machine = next(iter(next(iter(runs.values())).values()))["machine"]
    print(f"{header}\n{machine}\n\n{table}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"command": header, "table": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
