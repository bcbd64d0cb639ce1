"""The hook's per-step time at two commits, side by side: ``benchmarks/hook_overhead.py`` run alternately from a
checkout of each (``git worktree``), ``--rounds`` times, so machine noise falls on both alike.

    python benchmarks/hook_overhead_commits.py --before <rev> [--after <rev>] [--rounds 3] [-- hook_overhead args]

Reported per variant and world size: each commit's median over the rounds of its step time's ratio to plain DDP
(measured in the same run), and of the step time itself, and after / before. ``--after`` defaults to this checkout
(its working tree, uncommitted changes included). Both run this checkout's ``hook_overhead.py``, each importing its
own commit's library.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(into), rev], check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the older commit")
    parser.add_argument("--after", default="", help="the newer commit (default: this checkout as it is)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: arguments for hook_overhead.py")
    args = parser.parse_args()
    rest = [a for a in args.rest if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _checkout(args.before, Path(tmp) / "before")}
        trees["after"] = _checkout(args.after, Path(tmp) / "after") if args.after else ROOT
        for tree in trees.values():  # the same measurement at both commits: this checkout's script, each one's library
            if tree != ROOT:
                shutil.copy(ROOT / "benchmarks" / "hook_overhead.py", tree / "benchmarks" / "hook_overhead.py")
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        try:
            for round_ in range(args.rounds):
                for label in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                    out = Path(tmp) / f"{label}{round_}.json"
                    env = {**os.environ, "PYTHONPATH": str(trees[label])}
                    subprocess.run([sys.executable, str(trees[label] / "benchmarks" / "hook_overhead.py"), *rest,
                                    "--json", str(out)], check=True, env=env, cwd=trees[label],
                                   stdout=subprocess.DEVNULL)
                    runs[label].append(json.loads(out.read_text()))
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    after_rev = args.after or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True).stdout.strip() + " (working tree)"
    print(f"command: `python {' '.join(sys.argv)}`\n\nmachine: {platform.platform()}, {os.cpu_count()} cores\n\n"
          f"before: {args.before}; after: {after_rev}; {args.rounds} rounds, alternating; per round, "
          f"`hook_overhead.py {' '.join(rest)}` (its ratio: step time / plain DDP's in the same run). Medians over "
          f"rounds.\n")
    first = runs["before"][0]["seconds"]
    print("| variant | N | ms/step before | ms/step after | ratio to DDP before | ratio to DDP after | after / before |")
    print("|---|---|---|---|---|---|---|")
    for variant, by_world in first.items():
        for world in by_world:
            ms = {k: statistics.median(r["seconds"][variant][world] for r in runs[k]) for k in runs}
            ratio = {k: statistics.median(r["seconds"][variant][world] / r["seconds"]["ddp"][world] for r in runs[k])
                     for k in runs}
            print(f"| {variant} | {world} | {1e3 * ms['before']:.1f} | {1e3 * ms['after']:.1f} | "
                  f"{ratio['before']:.2f} | {ratio['after']:.2f} | {ratio['after'] / ratio['before']:.2f} |")


if __name__ == "__main__":
    main()
