"""Ratios of step times over repeated runs of ``benchmarks/step_time.py``, with their spread.

One run's ratio (a strategy's median step over a baseline's, measured side by side in that run) moves with the
host's load; repeating the run and reporting the median of the per-run ratios, with their range, is what a
target like "TernGrad <= 1/3 of fp32 DDP" can be judged on.

    python benchmarks/ratio_summary.py benchmarks/results/step_time_target_*.json --strategy terngrad --over ddp ddp_bf16
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional


def ratios(path: Path, strategy: str, baselines: list[str]) -> dict[tuple[int, str, str], dict[str, float]]:
    """Per (N, link, model): the strategy's median step over each baseline's, in one step_time.py JSON."""
    out: dict[tuple[int, str, str], dict[str, float]] = {}
    for run in json.loads(path.read_text())["runs"]:
        medians: dict[tuple[str, str], float] = {(r["model"], r["strategy"]): r["median_s"] for r in run["results"]}
        for model in sorted({m for m, _ in medians}):
            if (model, strategy) not in medians:
                continue
            row = {"step_s": medians[model, strategy]}
            for base in baselines:
                if (model, base) in medians:
                    row[base] = medians[model, strategy] / medians[model, base]
            out[run["nproc"], run["link"], model] = row
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files written by step_time.py --json")
    parser.add_argument("--strategy", default="terngrad")
    parser.add_argument("--over", nargs="+", default=["ddp", "ddp_bf16"], help="baselines of the ratios")
    args = parser.parse_args(argv)
    per_run = [(path, ratios(path, args.strategy, args.over)) for path in args.runs]
    print("command: python benchmarks/ratio_summary.py " + " ".join(sys.argv[1:] if argv is None else argv))
    header = " | ".join(f"{args.strategy} / {b}" for b in args.over)
    print(f"| run | N | link | model | {args.strategy} median step (ms) | {header} |")
    print("|---" * (5 + len(args.over)) + "|")
    pooled: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    for path, rows in per_run:
        for key, row in sorted(rows.items()):
            pooled.setdefault(key, []).append(row)
            cells = " | ".join(f"{row[b]:.3f}" if b in row else "-" for b in args.over)
            print(f"| {path.stem} | {key[0]} | {key[1]} | {key[2]} | {row['step_s'] * 1e3:.0f} | {cells} |")
    for key, runs in sorted(pooled.items()):
        parts = []
        for b in args.over:
            values = [r[b] for r in runs if b in r]
            if values:
                parts.append(f"{args.strategy} / {b}: median {statistics.median(values):.3f} "
                             f"(min {min(values):.3f}, max {max(values):.3f})")
        print(f"N = {key[0]}, {key[1]}, {key[2]}, {len(runs)} runs: " + "; ".join(parts))


if __name__ == "__main__":
    main()
