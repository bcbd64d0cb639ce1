"""DiLoCo on the language-model benchmark: H in {10, 50, 100} and compressed pseudo-gradients against DDP.

Every run is the language-model benchmark's worker (``benchmarks/lm.py``: ``gradcomp fit --config RECIPE
OVERRIDES`` on 4 Gloo ranks, one JSON per run, reused when it exists) with the recipes of ``recipes/diloco/``:
the same byte-level GPT, AdamW schedule, data and token count for every run (2000 steps of 4 x 8 x 64 tokens).
DDP's ranks average gradients every step; DiLoCo's 4 workers (one rank each) take 2000 inner AdamW steps and
meet every H steps. The table gives the final validation loss (every run ends on a round: all workers hold the
global weights), the bytes each rank puts between sites per token it trains on, and the ratios.

    python benchmarks/diloco.py                      # the grid (about 30 min on 2 cores)
    python benchmarks/diloco.py --saved              # the table of the stored runs
    python benchmarks/diloco.py --only ddp diloco_h50
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lm import command_line  # noqa: E402

RECIPES = ROOT / "recipes/diloco"
GRID: dict[str, tuple[str, list[str]]] = {
    "ddp": ("recipes/diloco/gpt_stdlib_ddp.yaml", []),
    "diloco_h10": ("recipes/diloco/gpt_stdlib_diloco.yaml", ["--trainer.strategy.init_args.sync_every=10"]),
    "diloco_h50": ("recipes/diloco/gpt_stdlib_diloco.yaml", []),
    "diloco_h100": ("recipes/diloco/gpt_stdlib_diloco.yaml", ["--trainer.strategy.init_args.sync_every=100"]),
    "int8_h50": ("recipes/diloco/gpt_stdlib_diloco_int8.yaml", []),
    "terngrad_h50": ("recipes/diloco/gpt_stdlib_diloco_terngrad.yaml", []),
    "sparseloco_h50": ("recipes/diloco/gpt_stdlib_diloco_sparseloco.yaml", []),
    "streaming_h50": ("recipes/diloco/gpt_stdlib_diloco_streaming.yaml", []),
}


def sync_every(run: dict[str, Any]) -> Optional[int]:
    """H of a DiLoCo run (from its overrides or its recipe), ``None`` for DDP."""
    for o in run["overrides"]:
        if o.startswith("--trainer.strategy.init_args.sync_every="):
            return int(o.split("=", 1)[1])
    text = (ROOT / run["recipe"]).read_text()
    for line in text.splitlines():
        if line.strip().startswith("sync_every:"):
            return int(line.split(":", 1)[1].split("#")[0])
    return None


def summarize(results: list[dict[str, Any]]) -> str:
    ddp = next(r for r in results if r["label"] == "ddp")
    dense = {sync_every(r): r for r in results if r["label"].startswith("diloco_h")}
    lines = ["| run | H | final val loss | vs DDP | vs fp32 DiLoCo, same H | bytes between sites per token | "
             "DDP / this | fp32 DiLoCo / this | outer rounds | command |", "| --- " * 10 + "|"]
    for r in results:
        h = sync_every(r)
        tokens = r["tokens_per_step"] / r["world_size"]  # per rank
        per_token = r["bytes_per_step"] / tokens
        ref = dense.get(h)
        vs_dense = f"{100 * (r['final_val_loss'] / ref['final_val_loss'] - 1):+.2f}%" if ref and ref is not r else ""
        bytes_dense = f"{ref['bytes_per_step'] / r['bytes_per_step']:.1f}x" if ref and ref is not r else ""
        lines.append(
            f"| {r['label']} | {h or ''} | {r['final_val_loss']:.4f} | "
            f"{100 * (r['final_val_loss'] / ddp['final_val_loss'] - 1):+.2f}% | {vs_dense} | {per_token:.2f} | "
            f"{ddp['bytes_per_step'] / r['bytes_per_step']:.0f}x | {bytes_dense} | {r.get('outer_rounds', '')} | "
            f"`{r['command']}` |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/diloco")
    parser.add_argument("--only", nargs="*", default=None, help="labels of the grid to run")
    parser.add_argument("--force", action="store_true", help="rerun runs whose JSON exists")
    parser.add_argument("--saved", action="store_true", help="run nothing: the table of the stored runs")
    args = parser.parse_args(argv)
    grid = {k: v for k, v in GRID.items() if args.only is None or k in args.only or k == "ddp"}
    results = []
    for label, (recipe, overrides) in grid.items():
        path = args.out / f"{label}.json"
        if args.saved and not path.exists():
            continue
        if args.force or not path.exists():
            print(f"[diloco] {label}: {command_line(recipe, overrides)}", flush=True)
            cmd = [sys.executable, str(ROOT / "benchmarks/lm.py"), "--worker", label, str(path), recipe, *overrides]
            subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        results.append(json.loads(path.read_text()))
    table = summarize(results)
    header = f"python benchmarks/diloco.py {' '.join(argv if argv is not None else sys.argv[1:])}\n{results[0]['machine']}"
    print(header + "\n\n" + table)
    (args.out / "summary.json").write_text(json.dumps({"command": header, "table": table, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
