"""The results tables of README and ``docs/``, generated from the stored runs under ``benchmarks/results/``.

A page holds each table between markers; everything between them is this script's output, so a page cannot
drift from its data::

    <!-- results:NAME -->
    (generated: a provenance line, then the table)
    <!-- /results:NAME -->

Each table is printed by the benchmark's own printer (``benchmarks/lm.py``'s ``summarize``, ``step_time.py``'s
``print_table``, ...) from the stored JSON, and stamped with the machine, the dates and commits that stored the
runs, and the command that prints the same table from the same files.

    python tools/results_tables.py                 # print every table
    python tools/results_tables.py --only lm-long-best
    python tools/results_tables.py --write         # rewrite the blocks in README.md and docs/*.md
    python tools/results_tables.py --check         # exit 1 (with a diff) where a page differs from its data

Where a stored run does not record its commit and date (the JSON of the benchmarks before they did), they come
from ``benchmarks/results/provenance.json``: for each file, the commit that added it to the repository and that
commit's date. ``--write`` adds entries for files it lacks, from git; printing and ``--check`` read only the
stored files, so they give the same answer on a checkout without git history.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = RESULTS / "provenance.json"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


@dataclass
class Table:
    """One generated table: which stored files it reads, how it is rendered, which command prints it."""

    name: str
    files: Callable[[], list[Path]]
    render: Callable[[list[dict[str, Any]]], str]
    command: str
    #: the command that produced the stored file, where the file does not record it
    produced: str = ""
    #: the machine, where the file does not record it
    machine: str = ""
    #: for a table computed when printed (no stored run): what it is computed from
    computed: str = ""


def _load(paths: list[Path]) -> list[dict[str, Any]]:
    return [_load_one(p) for p in paths]


def _load_one(path: Path) -> dict[str, Any]:
    """A run's JSON, or a stored Markdown table (``# command: ...``, ``# machine: ...`` and ``# ...`` notes above it;
    a benchmark's log is read the same way, its whole text kept for a renderer that parses it)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    text = path.read_text()
    lines = text.splitlines()
    notes = [line[2:] for line in lines if line.startswith("# ")]
    command = next((n[len("command: "):].strip("`") for n in notes if n.startswith("command: ")), "")
    # a log names its machine on a line of its own, a stored table on a note line
    machine = next((line.removeprefix("# ")[len("machine: "):] for line in lines
                    if line.removeprefix("# ").startswith("machine: ")), "not recorded in the file")
    return {"command": command, "notes": [n for n in notes if not n.startswith(("command: ", "machine: "))],
            "table": "\n\n".join(_tables(lines)), "machine": machine, "text": text}


def _tables(lines: list[str]) -> list[str]:
    """The Markdown tables among ``lines``: each run of consecutive ``|`` lines."""
    runs: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("|"):
            runs[-1].append(line)
        elif runs[-1]:
            runs.append([])
    return ["\n".join(run) for run in runs if run]


def _stored_table(runs: list[dict[str, Any]]) -> str:
    """Tables stored as Markdown by their benchmark, with the run's own notes (rates probed, load) where the run
    printed them: above a table, between two, or after it."""
    blocks: list[list[str]] = []
    for run in runs:
        kind = ""
        for line in run["text"].splitlines():
            if line.startswith("|"):
                if kind != "table":
                    blocks.append([])
                blocks[-1].append(line)
                kind = "table"
            elif line.startswith("# ") and not line[2:].startswith(("command: ", "machine: ")):
                if kind != "notes":
                    blocks.append([])
                blocks[-1].append(line[2:] if line.endswith((".", ":")) else f"{line[2:]}.")
                kind = "notes"
    return "\n\n".join("\n".join(block) for block in blocks)


def _lm(folder: str, labels: list[str]) -> Callable[[], list[Path]]:
    return lambda: [RESULTS / folder / f"{label}.json" for label in labels]


def _lm_table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.lm import summarize

    return summarize(runs)


def _step_time_table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.step_time import print_table

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for report in runs:
            print_table(report["runs"])
    return out.getvalue().rstrip("\n")


def _ratio_table(runs: list[dict[str, Any]]) -> str:
    """TernGrad's step over DDP's and bf16 DDP's in each repeated run of the target configuration."""
    from benchmarks import ratio_summary

    lines = ["| runs | TernGrad median step (ms), per run | TernGrad / fp32 DDP: median (min-max) | "
             "TernGrad / bf16 DDP: median (min-max) |", "| --- | --- | --- | --- |"]
    groups: dict[str, list[dict[tuple[int, str, str], dict[str, float]]]] = {}
    for report in runs:
        kind = "`--malloc-reuse`" if "--malloc-reuse" in report["command"] else "glibc default allocator"
        path = Path(report["_path"])
        groups.setdefault(kind, []).append(ratio_summary.ratios(path, "terngrad", ["ddp", "ddp_bf16"]))
    for kind, per_run in groups.items():
        rows = [row for r in per_run for row in r.values()]
        steps = ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in rows)
        cells = [f"**{statistics.median(v):.3f}** ({min(v):.3f}-{max(v):.3f})"
                 for v in ([r[b] for r in rows] for b in ("ddp", "ddp_bf16"))]
        lines.append(f"| {len(rows)} runs, {kind} | {steps} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _perf_validation_table(runs: list[dict[str, Any]]) -> str:
    """The performance model's error range over repeated runs, per allocator and strategy, at 1 Gbit/s."""
    columns = [("serial, in situ", "error"), ("timeline, in situ", "overlapped_error"),
               ("serial, profiled alone", "profiled_error"), ("timeline, profiled alone", "profiled_overlapped_error")]
    lines = ["| allocator | strategy | runs | " + " | ".join(c for c, _ in columns) + " |", "|---" * 7 + "|"]
    for run in runs:
        allocator = "`--malloc-reuse`" if "reuse" in Path(run["_path"]).stem else "glibc default"
        rows = [r for r in run["rows"] if r["link"] == "1gbit"]
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            mine = [r for r in rows if r["strategy"] == strategy]
            cells = [f"{100 * min(r[key] for r in mine):+.0f} to {100 * max(r[key] for r in mine):+.0f}%"
                     for _, key in columns]
            lines.append(f"| {allocator} | {strategy} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: (cluster, model, GPUs) rows of the Fig. 5 table shown in the page; the file holds every row
FIG5_ROWS = [("a", "alexnet", "4"), ("a", "alexnet", "8"), ("a", "alexnet", "64"), ("a", "alexnet", "128"),
             ("a", "googlenet", "8"), ("a", "vgg_a", "8"), ("b", "alexnet", "8"), ("b", "vgg_a", "64"),
             ("b", "vgg_a", "512")]


def _fig5_table(runs: list[dict[str, Any]]) -> str:
    """Selected rows of ``gradcomp-perf fig5``'s stored table (a projection of the performance model)."""
    lines = runs[0]["table"].splitlines()
    keep = [line for line in lines[2:] if tuple(c.strip() for c in line.strip("|").split("|")[:3]) in FIG5_ROWS]
    return "\n".join(lines[:2] + keep)


def _op_counts_table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.op_counts import markdown

    return "\n\n".join(markdown(run["counts"]) for run in runs)


def _diloco_table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.diloco import summarize

    return summarize(runs)


def _gpu_kernels_table(runs: list[dict[str, Any]]) -> str:
    """The kernel rows at the largest size with the torch ops timed: the torch ops and the device's kernels (Triton on CUDA) in GB/s of fp32
    gradient, and the kernels' share of the device's copy bandwidth."""
    run = runs[0]
    largest = max(row["size"] for row in run["rows"] if row.get("torch"))  # the torch ops are timed up to a size
    lines = [f"Copy bandwidth of the device (`copy_` of 256 MB): {run['memory_copy_gbps']:.0f} GB/s. "
             f"Rows at {largest // 2**20}M elements.", "",
             "| kernel | torch ops GB/s | kernels GB/s | kernels / copy bandwidth |", "|---|---|---|---|"]
    for row in run["rows"]:
        if row["size"] != largest:
            continue
        torch_ops = f"{row['torch']['gbps']:.1f}" if row.get("torch") else "-"  # no reference for some rows
        fused = row["fused"]
        lines.append(f"| {row['kernel']} | {torch_ops} | {fused['gbps']:.1f} | {fused['ratio_memory']:.2f} |")
    return "\n".join(lines)


def _table_rows(table: str) -> list[list[str]]:
    """The body rows of a Markdown table, as stripped cells (header and rule left out)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def _selected_rows(keep: Callable[[list[str]], bool]) -> Callable[[list[dict[str, Any]]], str]:
    """A stored table with its notes, keeping the header and the rows ``keep`` accepts (the file holds every row)."""
    def render(runs: list[dict[str, Any]]) -> str:
        lines = runs[0]["table"].splitlines()
        rows = [line for line, cells in zip(lines[2:], _table_rows(runs[0]["table"])) if keep(cells)]
        kept = set(lines[:2] + rows)
        text = "\n".join(line for line in runs[0]["text"].splitlines() if not line.startswith("|") or line in kept)
        return _stored_table([{**runs[0], "text": text}])

    return render


def _link_probe_table(runs: list[dict[str, Any]]) -> str:
    """What ``step_time.py``'s probe measured on each cluster before its steps (all-reduce of 8 MiB)."""
    lines = ["| N | link | measured all-reduce bandwidth | measured per-step latency |", "|---|---|---|---|"]
    for run in runs[0]["runs"]:
        probe = run["link_probe"]
        mbit = probe["bandwidth_bit_s"] / 1e6
        link = "inf (veth, no limit)" if run["link"] == "inf" else run["link"]
        rate = f"{mbit:.0f}" if mbit >= 100 else f"{mbit:.1f}"  # three digits at least
        lines.append(f"| {run['nproc']} | {link} | {rate} Mbit/s | {probe['latency_s'] * 1e3:.2f} ms |")
    return "\n".join(lines)


#: ``hook_breakdown.py``'s strategy names as the page shows them
BREAKDOWN_NAMES = {"ddp": "ddp", "terngrad": "terngrad", "terngrad:ignore": "terngrad, guard off"}
BREAKDOWN_COLUMNS = ["forward", "backward", "update", "step", "cpu", "sys", "compress", "collective_wait", "decompress"]


def _hook_breakdown_table(runs: list[dict[str, Any]]) -> str:
    """Rank 0's lines of ``hook_breakdown.py`` (ms per step, medians of its timed steps) as a table."""
    import ast

    lines = ["| strategy | forward | backward (with the hook) | update | step | cpu | sys | compress | collective_wait "
             "| decompress |", "|---" * 10 + "|"]
    for line in runs[0]["text"].splitlines():
        found = re.match(r"\[rank 0\] (\S+) rank 0: ms per step (\{.*\})$", line)
        if found:
            times = ast.literal_eval(found.group(2))
            cells = [str(times.get(key, "-")) for key in BREAKDOWN_COLUMNS]
            lines.append(f"| {BREAKDOWN_NAMES.get(found.group(1), found.group(1))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hook_alone_table(runs: list[dict[str, Any]]) -> str:
    """``hook_breakdown.py --alone`` with the default allocator and with allocator reuse, side by side."""
    first, second = (dict((cells[0], cells[1:]) for cells in _table_rows(run["table"])) for run in runs)
    notes = [f"{'Default allocator' if i == 0 else 'Allocator reuse'}: {run['text'].splitlines()[0]}."
             for i, run in enumerate(runs)]
    lines = ["| piece | ms | of which system | ms, allocator reuse | of which system, allocator reuse |",
             "|---|---|---|---|---|"]
    lines += [f"| {piece} | {ms} | {system} | {second[piece][0]} | {second[piece][1]} |"
              for piece, (ms, system) in first.items()]
    return "\n".join([*notes, "", *lines])


#: ``sparse_compressors.py``'s configurations as the page names them
SPARSE_CONFIGS = {"graddrop": "Gradient Dropping, paper (0.1% random sample, coo32)",
                  "graddrop-strided": "Gradient Dropping, strided sample (Marian)",
                  "graddrop-2bit": "Gradient Dropping, 2-bit quantized, delta16",
                  "adacomp": "AdaComp, binary, paper wire", "adacomp-ternary": "AdaComp, ternary",
                  "adacomp-step0": "AdaComp, first step (dW = G, ~10% sent)"}


def _sparse_compressors_table(runs: list[dict[str, Any]]) -> str:
    """The whole-model rows of ``sparse_compressors.py``: compress + decompress_sum of 4 payloads, torch and fused."""
    run = runs[0]
    load = ", ".join(f"{x:.1f}" for x in run["load_after"])
    lines = [f"Medians of {run['repeats']} repeats; load average (1, 5, 15 min) after the run: {load}.", "",
             f"| whole MLP (36.8M elements), compress + decompress_sum ×{run['world']} | torch ms | fused ms | "
             "speed-up (median) | fused / clone |", "| --- | --- | --- | --- | --- |"]
    for row in run["rows"]:
        if row["tensor"] == "MLP 36.8M":
            lines.append(f"| {SPARSE_CONFIGS.get(row['config'], row['config'])} | {row['torch_ms']:.1f} | "
                         f"{row['fused_ms']:.1f} | {row['speedup']:.1f}x | {row['fused_per_clone']:.2f} |")
    return "\n".join(lines)


#: the CPU kernels judged against a target, and the hook's decode of 4 payloads, as the page names them
KERNEL_ROWS = {"terngrad compress": "TernGrad compress (statistic + ternarize + pack, as the hook calls it)",
               "terngrad decode": "TernGrad decode (into a new tensor)",
               "terngrad decode into out": "TernGrad decode into a reused buffer",
               "terngrad mean x4 into out": "TernGrad decode, sum and average of 4 payloads into the bucket "
                                            "(what the hook runs)",
               "graddrop select": "Gradient Dropping select (\\|x\\| > t, compaction)",
               "adacomp select": "AdaComp select (bin max + selection, one pass)"}


def _kernel_repeats(log: str) -> dict[str, list[tuple[float, float]]]:
    """Per kernel, (fused/mem, fused/clone) of each run in a log of ``kernels.py --sizes 1M`` runs."""
    found: dict[str, list[tuple[float, float]]] = {}
    for line in log.splitlines():
        left = re.sub(r"(ok|MISS) \d+%/\w+", "", line.split("|")[0]).split()
        if "1M" in left[1:] and left[0] != "command:":
            size = left.index("1M")
            found.setdefault(" ".join(left[:size]), []).append((float(left[size + 5]), float(left[-2])))
    return found


def _kernels_table(runs: list[dict[str, Any]]) -> str:
    """The kernels against their targets: median ratio per size, and at 1M the range over the repeated runs."""
    run, log = runs
    repeats = _kernel_repeats(log["text"])
    sizes = sorted({row["size"] for row in run["rows"]})
    lines = [f"Memory-copy bandwidth of this run: {run['memory_copy_gbps']:.2f} GB/s; load average "
             f"{run['load_after']:.1f} after the run.", "",
             "| kernel | target | against | " + " | ".join(
                 f"{s // 2**20}M (repeats)" if s == 2**20 else f"{s // 2**20}M" for s in sizes) + " |",
             "| --- | --- | --- |" + " --- |" * len(sizes)]
    for kernel, label in KERNEL_ROWS.items():
        mine = {row["size"]: row for row in run["rows"] if row["kernel"] == kernel}
        against = next(iter(mine.values()))["target_against"] or "mem"
        target = next(iter(mine.values()))["target"]
        cells = []
        for size in sizes:
            fused = mine[size]["fused"]
            ratio = fused["ratio_memory"] if against == "mem" else fused["ratio_clone"]
            cell = f"{ratio:.2f}"
            if size == 2**20 and repeats.get(kernel) and target is not None:
                again = [mem if against == "mem" else clone for mem, clone in repeats[kernel]]
                cell += f" ({min(again):.2f}-{max(again):.2f})"
            cells.append(cell)
        shown = f"≥ {target:.2f}" if target is not None else ""
        lines.append(f"| {label} | {shown} | {against} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rate_text(bits_per_second: float) -> str:
    return f"{bits_per_second / 1e9:g} Gbit/s" if bits_per_second >= 1e9 else f"{bits_per_second / 1e6:g} Mbit/s"


def _emulator_allreduce_table(runs: list[dict[str, Any]]) -> str:
    """One all-reduce through the emulated-cluster launcher per cluster (the slowest rank's time, from the stored
    log of each command) against the cost model's ring all-reduce at the configured rates, alpha = 100 us."""
    from lightning_gradcomp.exchange.costmodel import Link, Network, parse_rate, ring_allreduce_seconds

    lines = [*(f"{note}." for note in runs[0]["notes"]), "",
             "| cluster | measured (slowest rank) | predicted | error |", "|---|---|---|---|"]
    for section in runs[0]["text"].split("\n== ")[1:]:
        command, _, output = section.partition("\n")
        option = dict(re.findall(r"--([\w-]+) (\S+)", command))
        numel = int(re.search(r"NUMEL=(\d+)", command).group(1))  # type: ignore[union-attr]
        nproc, sites = int(option["nproc"]), int(option.get("sites", 1))
        seconds = max(float(x) for x in re.findall(r"RESULT rank=\d+ value=\S+ seconds=(\S+)", output))
        lan = Link(parse_rate(option["bandwidth"]), 100e-6)
        wan = Link(parse_rate(option["wan-bandwidth"]), 100e-6) if sites > 1 else None
        predicted = ring_allreduce_seconds(4 * numel, nproc, Network(lan, sites, wan))
        inside = _rate_text(lan.bandwidth)
        cluster = (f"{nproc} ranks, {inside}" if wan is None else
                   f"{nproc} ranks, {sites} sites ({inside} inside, {_rate_text(wan.bandwidth)} between)")
        ring = " (flat ring at the WAN's pace)" if sites > 1 else ""
        lines.append(f"| {cluster} | {seconds:.3f} s | {predicted:.3f} s{ring} | {100 * (seconds / predicted - 1):+.0f}% |")
    return "\n".join(lines)


def _weightgrad_variants_table(runs: list[dict[str, Any]]) -> str:
    """WeightGrad's row of each stored ``weightgrad_wan.py --strategies weightgrad --wg ...`` run, one per variant."""
    lines = ["| command (`python benchmarks/weightgrad_wan.py --nproc 4 --sites 2 --strategies weightgrad --wg ...`) | "
             "time to target (s) | epochs | WAN rounds | final acc | rank-0 WAN bytes/step | rank-0 LAN bytes/step |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        # the shell quotes an option holding a Python string literal (the stored command lost them)
        options = " ".join(f'"{o}"' if "'" in o else o for o in run["command"].partition("--wg ")[2].split())
        _, time_s, _, epochs, _, rounds, acc, wan, lan = _table_rows(run["table"])[0]
        lines.append(f"| `{options}` | {time_s} | {epochs} | {rounds} | {acc} | {wan} | {lan} |")
    return "\n".join(lines)


def _diloco_reference_table(reference: str) -> Callable[[list[dict[str, Any]]], str]:
    def render(runs: list[dict[str, Any]]) -> str:
        from benchmarks.lm import summarize

        return summarize(runs, reference)

    return render


def _outer_step(run: dict[str, Any]) -> dict[str, Any]:
    """The run's outer optimizer settings: its recipe's, then its command's overrides."""
    import yaml

    recipe = yaml.safe_load((ROOT / run["recipe"]).read_text())
    settings = {k: v for k, v in recipe["trainer"]["strategy"]["init_args"].items() if k.startswith("outer_")}
    for override in run["overrides"]:
        found = re.match(r"--trainer\.strategy\.init_args\.(outer_\w+)=(.*)$", override)
        if found:
            settings[found.group(1)] = yaml.safe_load(found.group(2))
    return settings


def _dense(run: dict[str, Any]) -> bool:
    """Whether the run sends fp32 pseudo-gradients (DiLoCo's own recipe) or is DDP."""
    return run["recipe"] in ("recipes/diloco/gpt_stdlib_diloco.yaml", "recipes/diloco/gpt_stdlib_ddp.yaml")


def _outer_label(run: dict[str, Any]) -> str:
    if run["outer_rounds"] == 0:
        return "(DDP)"
    outer = _outer_step(run)
    if outer.get("outer_nesterov"):
        return f"Nesterov {outer['outer_lr']} / {outer['outer_momentum']}"
    if _dense(run) and outer.get("outer_lr") == 1.0 and not outer.get("outer_momentum"):
        return "averaging"
    momentum = outer.get("outer_momentum")
    return f"SGD lr {outer.get('outer_lr')}, {f'momentum {momentum}' if momentum else 'no momentum'}"


def _sites_bytes(run: dict[str, Any]) -> str:
    return f"{run['bytes_per_step']:,.0f} ({run['fp32_bytes_per_step'] / run['bytes_per_step']:.0f}x)"


def _versus(run: dict[str, Any], other: dict[str, Any] | None) -> str:
    if other is None or other is run:
        return ""
    return f"{100 * (run['final_val_loss'] / other['final_val_loss'] - 1):+.1f}% (`{other['label']}`)"


def _diloco_gap_table(runs: list[dict[str, Any]]) -> str:
    """DiLoCo at H = 1 to 50 with averaging or Nesterov, and SparseLoCo with more rounds: each run against DDP at the
    same batch, compressed runs also against the better fp32 DiLoCo at the same H."""
    ddp = {r["tokens_per_step"]: r for r in runs if r["outer_rounds"] == 0}
    lines = ["| run | H | outer step | final val loss | vs DDP at the same batch | vs the better fp32 DiLoCo at the "
             "same H | bytes between sites per step (fp32 DDP / bytes) | command |", "|---" * 8 + "|"]
    for run in runs:
        h = run["steps"] // run["outer_rounds"] if run["outer_rounds"] else "-"
        dense = [r for r in runs if _dense(r) and r["outer_rounds"] == run["outer_rounds"] and r["outer_rounds"]
                 and r["tokens_per_step"] == run["tokens_per_step"]]
        best = None if _dense(run) or not dense else min(dense, key=lambda r: r["final_val_loss"])
        lines.append(f"| {run['label']} | {h} | {_outer_label(run)} | {run['final_val_loss']:.4f} | "
                     f"{_versus(run, ddp.get(run['tokens_per_step']))} | {_versus(run, best)} | {_sites_bytes(run)} | "
                     f"`{run['command']}` |")
    return "\n".join(lines)


def _warm_start(run: dict[str, Any]) -> int:
    """The DDP steps of the checkpoint the run started from."""
    weights = next(o for o in run["overrides"] if "init_weights=" in o)
    return int(re.search(r"(?:step=|ddp_)(\d+)", weights).group(1))  # type: ignore[union-attr]


def _diloco_warm_table(runs: list[dict[str, Any]]) -> str:
    """DDP and DiLoCo from the same dense checkpoint: each run against DDP from that start, compressed
    pseudo-gradients also against fp32 DiLoCo at the same H from that start."""
    lines = ["| start | run | final val loss | vs DDP from the same start | vs fp32 DiLoCo from the same start | "
             "bytes between sites per step (fp32 DDP / bytes) | outer rounds |", "|---" * 7 + "|"]
    for run in runs:
        start = _warm_start(run)
        ddp = next(r for r in runs if r["outer_rounds"] == 0 and _warm_start(r) == start)
        fp32 = None if _dense(run) else next(
            (r for r in runs if _dense(r) and _warm_start(r) == start and r["outer_rounds"] == run["outer_rounds"]
             and r["overrides"] == [o for o in r["overrides"] if "init_weights=" in o or "sync_every" in o]), None)
        lines.append(f"| DDP, {start} steps | {run['label']} | {run['final_val_loss']:.4f} | {_versus(run, ddp)} | "
                     f"{_versus(run, fp32)} | {_sites_bytes(run)} | {run['outer_rounds']} |")
    return "\n".join(lines)


def _emulated_runs(grid: str, wan: str) -> Callable[[], list[Path]]:
    """The stored runs of one WAN rate, in ``benchmarks/emulated.py --saved``'s order (its grid's)."""
    def files() -> list[Path]:
        from benchmarks.emulated import GRIDS

        spec = GRIDS[grid]
        return [p for p in (spec.out / wan / f"{label}.json" for label in spec.runs) if p.exists()]

    return files


def _emulated(wan: str, target: float, grid: str = "") -> Callable[[list[dict[str, Any]]], str]:
    """``benchmarks/emulated.py --saved``'s table of one WAN rate; with ``grid``, that grid's baseline run and, where
    the grid shows it, the performance model's prediction from the same runs stored for the other rate."""
    def render(runs: list[dict[str, Any]]) -> str:
        from benchmarks.emulated import GRIDS, predictions, summarize

        spec = GRIDS[grid] if grid else None
        baseline = "ddp" if spec is None else spec.baseline
        predicted = ({wan: predictions(spec.out, wan, runs, spec.wans)} if spec is not None and spec.predicted
                     else None)
        table = summarize({wan: runs}, target, baseline, predicted)
        return table.strip("\n").split("\n", 2)[2]  # the table, without its heading line

    return render


#: per-shard statistics against per-tensor ones: each compressor under DDP and sharded (2 replicas of 2 FSDP2
#: shards) on the language-model benchmark's 200-step recipe, as ``benchmarks/lm.py --run`` specs
_SHARDED_RECIPE = "recipes/lm/gpt_stdlib_sharded_terngrad.yaml"
_POWERSGD_R4 = ("--trainer.strategy.init_args.compressor=lightning_gradcomp.compressors.PowerSGD"
                "::--trainer.strategy.init_args.compressor.init_args.rank=4")
SHARDED_STATS_RUNS = [
    "--run ddp=recipes/lm/gpt_stdlib_ddp.yaml",
    "--run terngrad_ddp=recipes/lm/gpt_stdlib_terngrad.yaml",
    f"--run terngrad_sharded={_SHARDED_RECIPE}",
    "--run powersgd_r4_ddp=recipes/lm/gpt_stdlib_ddp.yaml::--trainer.strategy=lightning_gradcomp.GradCompStrategy::"
    + _POWERSGD_R4,
    f"--run powersgd_r4_sharded={_SHARDED_RECIPE}::{_POWERSGD_R4}",
    "--run demo_ddp=recipes/lm/gpt_stdlib_ddp.yaml::--trainer.strategy=demo",
    f"--run demo_sharded={_SHARDED_RECIPE}::--trainer.strategy.init_args.compressor=demo",
]


def _sharded_stats_labels() -> list[str]:
    return [spec.split("=", 1)[0].removeprefix("--run ") for spec in SHARDED_STATS_RUNS]


def _sharded_stats_table(runs: list[dict[str, Any]]) -> str:
    """Each compressor under DDP (per-tensor statistics over 4 ranks' gradients) and sharded (per-shard statistics
    over 2 replicas' shards): final validation loss, the sharded run's against DDP's, bytes per rank per step."""
    by = {r["label"]: r for r in runs}
    ddp = by["ddp"]["final_val_loss"]
    lines = ["| compressor | DDP: final val loss (vs fp32 DDP) | sharded: final val loss (vs fp32 DDP) | "
             "sharded vs DDP | DDP bytes/rank/step | sharded bytes/rank/step |", "| --- " * 6 + "|"]
    for name in dict.fromkeys(label.rsplit("_", 1)[0] for label in by if label != "ddp"):
        a, b = by[f"{name}_ddp"], by[f"{name}_sharded"]
        la, lb = a["final_val_loss"], b["final_val_loss"]
        lines.append(f"| {name} | {la:.4f} ({la / ddp - 1:+.1%}) | {lb:.4f} ({lb / ddp - 1:+.1%}) | {lb / la - 1:+.1%} | "
                     f"{a['bytes_per_step']:,.0f} | {b['bytes_per_step']:,.0f} |")
    return "\n".join(lines)


def _cross_node_loss_files() -> list[Path]:
    """The stored runs of ``benchmarks/fsdp_cross_node.py``, by run then seed."""
    from benchmarks.fsdp_cross_node import LOSS_RUNS, OUT, SEEDS

    return [p for label in LOSS_RUNS for p in (OUT / f"seed{s}" / f"{label}.json" for s in SEEDS) if p.exists()]


def _cross_node_loss_table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.fsdp_cross_node import summarize

    by: dict[str, dict[int, dict[str, Any]]] = {}
    for run in runs:
        seed = next(int(o.partition("=")[2]) for o in run["overrides"] if o.startswith("--seed_everything="))
        by.setdefault(run["label"], {})[seed] = run
    return summarize(by)


def _sharded_memory_labels() -> list[str]:
    from benchmarks.sharded_memory import RUNS

    return list(RUNS)


def _sharded_memory_table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.sharded_memory import summarize

    return summarize(runs)


#: the 2000-step grid's compressors whose paper default is within 2 % of DDP: (compressor, setting, named recipe or
#: "", default label, [(run, DDP run at the same seed and warm-up), ...] with seed 0 first)
AT_DEFAULT: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    ("bf16", "the default", "", "bf16", [("bf16", "ddp")]),
    ("fp16", "the default", "", "fp16", [("fp16", "ddp")]),
    ("int8", "the default", "", "int8", [("int8", "ddp"), ("int8_seed1", "ddp_seed1")]),
]


def _best() -> list[tuple[str, str, str, str, list[tuple[str, str]]]]:
    """The best setting per compressor, as :data:`AT_DEFAULT`'s rows: the others from the presets' table
    (``lightning_gradcomp/strategies/presets.py``: the preset, or the best setting found where none is within 2 %)."""
    from lightning_gradcomp.strategies.presets import PAPER_DEFAULTS, PRESETS

    rows = list(AT_DEFAULT)
    for name, entry in PAPER_DEFAULTS.items():
        preset = PRESETS[entry.preset] if entry.preset else None
        measured = preset.measured if preset else entry.best
        assert measured is not None
        setting = f"`{preset.name}`: {measured.setting}" if preset else measured.setting
        if measured.measured_with:
            setting += f"; {measured.measured_with}"
        rows.append((name, setting, preset.recipe if preset else "", name, list(measured.runs)))
    return rows


def _best_labels() -> list[str]:
    labels = ["ddp"]
    for _, _, _, default, pairs in _best():
        labels += [default, *(label for pair in pairs for label in pair)]
    return list(dict.fromkeys(labels))


def _best_table(runs: list[dict[str, Any]]) -> str:
    """Quality against bytes at each compressor's best setting found: loss against DDP at the same seed."""
    by_label = {r["label"]: r for r in runs}
    lines = ["| compressor | best setting found | loss vs DDP, per seed | mean | fp32 DDP / bytes | "
             "paper default: vs DDP, fp32 DDP / bytes |", "| --- | --- | --- | --- | --- | --- |"]
    for name, setting, recipe, default, pairs in _best():
        ratios = _best_gaps(name, by_label.__getitem__)
        best = by_label[pairs[0][0]]
        paper = by_label[default]
        where = f"{setting} (`{recipe}`)" if recipe else setting
        lines.append(
            f"| {name} | {where} | {' / '.join(f'{100 * r:+.1f}%' for r in ratios)} | "
            f"{100 * statistics.mean(ratios):+.1f}% | {best['fp32_bytes_per_step'] / best['bytes_per_step']:.1f}x | "
            f"{100 * (paper['final_val_loss'] / by_label['ddp']['final_val_loss'] - 1):+.1f}%, "
            f"{paper['fp32_bytes_per_step'] / paper['bytes_per_step']:.1f}x |")
    return "\n".join(lines)


def _preset_labels() -> list[str]:
    from lightning_gradcomp.strategies.presets import PAPER_DEFAULTS, PRESETS

    labels = []
    for entry in PAPER_DEFAULTS.values():
        for measured in (entry.measured, PRESETS[entry.preset].measured if entry.preset else entry.best):
            labels += [label for pair in measured.runs for label in pair]  # type: ignore[union-attr]
    return list(dict.fromkeys(labels))


def _preset_table(runs: list[dict[str, Any]]) -> str:
    """What the paper-default warning says (``lightning_gradcomp/strategies/presets.py``): each paper default's gap to AdamW
    DDP, and the preset that closes it or the best setting found, recomputed from the stored runs."""
    from lightning_gradcomp.strategies.presets import PAPER_DEFAULTS, PRESETS, measure

    by_label = {r["label"]: r for r in runs}
    lines = ["| `strategy=` | paper default vs DDP, fp32 DDP / bytes | preset | its setting | loss vs DDP, per seed | "
             "mean | fp32 DDP / bytes over the run | stored runs (`benchmarks/results/lm_long/`) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in PAPER_DEFAULTS.items():
        paper_gap, paper_ratio = measure(by_label, entry.measured.runs)
        preset = PRESETS[entry.preset] if entry.preset else None
        measured = preset.measured if preset else entry.best
        assert measured is not None
        dense = preset.dense_steps if preset else (100 if "dense100" in measured.runs[0][0] else 0)
        gap, ratio = measure(by_label, measured.runs, dense)
        seeds = [by_label[run]["final_val_loss"] / by_label[ddp]["final_val_loss"] - 1 for run, ddp in measured.runs]
        setting = preset.describe() if preset else measured.setting
        if measured.measured_with:
            setting += f"; {measured.measured_with}"
        lines.append(
            f"| `{name}` | {paper_gap:+.1f}%, {paper_ratio:.1f}x | "
            f"{f'`{preset.name}`' if preset else 'none within 2 %; the best found:'} | {setting} | "
            f"{' / '.join(f'{100 * g:+.1f}%' for g in seeds)} | {gap:+.1f}% | {ratio:.1f}x | "
            f"{', '.join(run for run, _ in measured.runs)} |")
    return "\n".join(lines)


#: 1-bit Adam and 0/1 Adam on the 2000-step grid: (method, setting, [(run, DDP run at the same seed), ...]), seed 0
#: first; the runs are ``python benchmarks/lm.py --long --run LABEL=...`` (each JSON holds its command)
FROZEN_ADAM: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("1-bit Adam", "`freeze_step: 300`, `scale_block=64`",
     [("onebit_adam_f300_b64", "ddp"), ("onebit_adam_f300_b64_seed1", "ddp_seed1"),
      ("onebit_adam_f300_b64_seed2", "ddp_seed2")]),
    ("0/1 Adam", "`var_freeze_step: 300`, one scale per tensor piece", [("zero_one_adam_v300", "ddp")]),
    ("0/1 Adam", "`var_freeze_step: 300`, `scale_block=64`", [("zero_one_adam_v300_b64", "ddp")]),
    ("0/1 Adam", "`var_freeze_step: 300, var_update_scaler: 128`, `scale_block=64`",
     [("zero_one_adam_v300_s128_b64", "ddp")]),
    ("0/1 Adam", "`var_freeze_step: 300, var_update_scaler: 300` (dense until the freeze), `scale_block=64`",
     [("zero_one_adam_v300_s300_b64", "ddp")]),
    ("0/1 Adam", "`var_freeze_step: 300, var_update_scaler: 128`, `scale_block=64`, weight decay 0.01",
     [("zero_one_adam_v300_s128_b64_wd001", "ddp"), ("zero_one_adam_v300_s128_b64_wd001_seed1", "ddp_seed1"),
      ("zero_one_adam_v300_s128_b64_wd001_seed2", "ddp_seed2")]),
]


def _frozen_adam_labels() -> list[str]:
    return list(dict.fromkeys(label for _, _, pairs in FROZEN_ADAM for pair in pairs for label in pair))


def _frozen_adam_table(runs: list[dict[str, Any]]) -> str:
    """1-bit Adam and 0/1 Adam against AdamW DDP: loss per seed and its mean, bytes over the whole run (the dense
    warm-up included) and on a compressed step."""
    from lightning_gradcomp.strategies.presets import measure

    by_label = {r["label"]: r for r in runs}
    lines = ["| method | setting | loss vs DDP, per seed | mean | fp32 DDP / bytes over the run | "
             "fp32 DDP / bytes, a compressed step | stored runs (`benchmarks/results/lm_long/`) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for method, setting, pairs in FROZEN_ADAM:
        gap, ratio = measure(by_label, pairs)
        seeds = [by_label[run]["final_val_loss"] / by_label[ddp]["final_val_loss"] - 1 for run, ddp in pairs]
        first = by_label[pairs[0][0]]
        lines.append(f"| {method} | {setting} | {' / '.join(f'{100 * g:+.1f}%' for g in seeds)} | {gap:+.1f}% | "
                     f"{ratio:.1f}x | {first['fp32_bytes_per_step'] / first['bytes_per_step']:.1f}x | "
                     f"{', '.join(run for run, _ in pairs)} |")
    return "\n".join(lines)


def _generalise_files(configs: tuple[str, ...] = ()) -> Callable[[], list[Path]]:
    """The stored runs of ``benchmarks/presets_generalise.py`` (of ``configs`` and DDP, or all), workload by workload."""
    def files() -> list[Path]:
        from benchmarks.presets_generalise import OUT, WORKLOADS

        return [p for w in WORKLOADS for p in sorted((OUT / w).glob("*.json"))
                if not configs or re.sub(r"_s\d+_seed\d+$", "", p.stem) in ("ddp", *configs)]
    return files


def _generalise_table(configs: tuple[str, ...] = ()) -> Callable[[list[dict[str, Any]]], str]:
    """``benchmarks/presets_generalise.py``'s table of the stored runs (those of ``configs``, or all)."""
    def render(runs: list[dict[str, Any]]) -> str:
        from benchmarks.presets_generalise import WORKLOADS, table

        by_workload: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in WORKLOADS}
        for run in runs:
            path = Path(run["_path"])
            by_workload[path.parent.name][path.stem] = run
        return table(by_workload, ["ddp", *configs] if configs else None)
    return render


#: the frozen-variance Adams of ``benchmarks/presets_generalise.py``
FROZEN_ADAMS = ("onebit_adam", "zero_one_adam")

LM_DEFAULTS = ["ddp", "adacomp", "bf16", "demo", "dgc", "fp16", "fp32", "graddrop", "onebit", "powersgd", "qsgd",
               "terngrad", "topk"]
TARGET_RUNS = [f"step_time_target_default_{i}.json" for i in range(1, 9)] + \
    [f"step_time_target_reuse_{i}.json" for i in range(1, 5)]

#: the one GPU the stored GPU runs used (their files name it in their notes)
GPU = "one NVIDIA H200 (16 host cores), torch 2.11.0+cu130, Triton 3.6.0"
GPU_H100 = "one NVIDIA H100 80GB HBM3 (16 host cores), torch 2.11.0+cu130, Triton 3.6.0"

TABLES = [
    Table("lm-long-best", _lm("lm_long", _best_labels()), _best_table,
          "python tools/results_tables.py --only lm-long-best"),
    Table("lm-long-presets", lambda: [RESULTS / "lm_long" / f"{label}.json" for label in _preset_labels()],
          _preset_table, "python tools/results_tables.py --only lm-long-presets"),
    Table("presets-generalise", _generalise_files(), _generalise_table(),
          "python benchmarks/presets_generalise.py --saved"),
    Table("onebit-adam-generalise", _generalise_files(FROZEN_ADAMS), _generalise_table(FROZEN_ADAMS),
          "python benchmarks/presets_generalise.py --saved --configs ddp " + " ".join(FROZEN_ADAMS)),
    Table("onebit-adam-long", lambda: [RESULTS / "lm_long" / f"{label}.json" for label in _frozen_adam_labels()],
          _frozen_adam_table, "python tools/results_tables.py --only onebit-adam-long"),
    Table("lm-long-defaults", _lm("lm_long", [*LM_DEFAULTS[:8], "int8", *LM_DEFAULTS[8:]]), _lm_table,
          "python benchmarks/lm.py --long --saved --only ddp adacomp bf16 demo dgc fp16 fp32 graddrop int8 onebit "
          "powersgd qsgd terngrad topk"),
    Table("lm-defaults", _lm("lm", LM_DEFAULTS), _lm_table,
          "python benchmarks/lm.py --saved --only " + " ".join(LM_DEFAULTS)),
    Table("lm-emulated-1gbit", _emulated_runs("lm", "1gbit"), _emulated("1gbit", 2.45),
          "python benchmarks/emulated.py --grid lm --saved --target 2.45 --wan 1gbit"),
    Table("lm-emulated-100mbit", _emulated_runs("lm", "100mbit"),
          _emulated("100mbit", 2.45), "python benchmarks/emulated.py --grid lm --saved --target 2.45 --wan 100mbit"),
    Table("lm-long-emulated-1gbit", _emulated_runs("lm_long", "1gbit"), _emulated("1gbit", 0.8),
          "python benchmarks/emulated.py --grid lm_long --saved --target 0.8 --wan 1gbit"),
    Table("lm-long-emulated-100mbit", _emulated_runs("lm_long", "100mbit"), _emulated("100mbit", 0.8),
          "python benchmarks/emulated.py --grid lm_long --saved --target 0.8 --wan 100mbit"),
    Table("step-time-grid", lambda: [RESULTS / "step_time_matrix.json"], _step_time_table,
          "python tools/results_tables.py --only step-time-grid"),
    Table("step-time-target", lambda: [RESULTS / name for name in TARGET_RUNS], _ratio_table,
          "python tools/results_tables.py --only step-time-target"),
    Table("perf-validation", lambda: [RESULTS / "perf_validate_target_default.json",
                                      RESULTS / "perf_validate_target_reuse.json"], _perf_validation_table,
          "python tools/results_tables.py --only perf-validation"),
    Table("fig5", lambda: [RESULTS / "fig5_table.md"], _fig5_table, "python tools/results_tables.py --only fig5",
          produced="gradcomp-perf fig5 --out docs/img", machine="none: a projection of the performance model"),
    Table("op-counts", lambda: [RESULTS / "op_counts/after.json"], _op_counts_table,
          "python tools/results_tables.py --only op-counts"),
    Table("hierarchy-1gbit", lambda: [RESULTS / "hierarchy/repeats_1gbit.md"], _stored_table,
          "python tools/results_tables.py --only hierarchy-1gbit",
          machine="the 2-core VM of docs/benchmarks.md (not recorded in the file)"),
    Table("hierarchy-100mbit", lambda: [RESULTS / "hierarchy/repeats_100mbit.md"], _stored_table,
          "python tools/results_tables.py --only hierarchy-100mbit",
          machine="the 2-core VM of docs/benchmarks.md (not recorded in the file)"),
    Table("gpu-hook-small", lambda: [RESULTS / "gpu_h100/hook_small.md", RESULTS / "gpu_h100/fsdp2_small.md"],
          _stored_table, "python tools/results_tables.py --only gpu-hook-small"),
    Table("gpu-hook-mid", lambda: [RESULTS / "gpu_h100/hook_mid.md", RESULTS / "gpu_h100/fsdp2_mid.md"],
          _stored_table, "python tools/results_tables.py --only gpu-hook-mid"),
    Table("gpu-hook-mid-h200", lambda: [RESULTS / "gpu_h200/hook_mid_660dbba.md"], _stored_table,
          "python tools/results_tables.py --only gpu-hook-mid-h200"),
    Table("gpu-hook-mid-segmented", lambda: [RESULTS / "gpu_h200/hook_mid.md"], _stored_table,
          "python tools/results_tables.py --only gpu-hook-mid-segmented", machine=GPU),
    Table("gpu-hook-mid-scatter", lambda: [RESULTS / "gpu_h200/hook_mid_before.md",
                                           RESULTS / "gpu_h200/fsdp2_mid_before.md"], _stored_table,
          "python tools/results_tables.py --only gpu-hook-mid-scatter", machine=GPU),
    Table("gpu-kernels", lambda: [RESULTS / "gpu_h100/kernels.json"], _gpu_kernels_table,
          "python tools/results_tables.py --only gpu-kernels", machine=GPU_H100),
    Table("diloco", lambda: [RESULTS / "diloco" / f"{label}.json" for label in _diloco_grid()], _diloco_table,
          "python benchmarks/diloco.py --saved"),
    Table("diloco-sweep", lambda: _saved_order(RESULTS / "diloco_sweep"), _lm_table,
          "python benchmarks/lm.py --saved --out benchmarks/results/diloco_sweep"),
    Table("diloco-emulated-1gbit", _emulated_runs("diloco", "1gbit"),
          _emulated("1gbit", 1.3), "python benchmarks/emulated.py --grid diloco --saved --target 1.3 --wan 1gbit"),
    Table("diloco-emulated-100mbit", _emulated_runs("diloco", "100mbit"),
          _emulated("100mbit", 1.3), "python benchmarks/emulated.py --grid diloco --saved --target 1.3 --wan 100mbit"),
    Table("sharded-stats", lambda: [RESULTS / "sharded_stats" / f"{label}.json" for label in _sharded_stats_labels()],
          _sharded_stats_table, "python tools/results_tables.py --only sharded-stats",
          produced=f"python benchmarks/lm.py --out benchmarks/results/sharded_stats {' '.join(SHARDED_STATS_RUNS)}"),
    Table("sharded-memory", lambda: [p for p in (RESULTS / "sharded_memory" / f"{label}.json"
                                                 for label in _sharded_memory_labels()) if p.exists()],
          _sharded_memory_table, "python benchmarks/sharded_memory.py --saved"),
    Table("fsdp-cross-node-loss", _cross_node_loss_files, _cross_node_loss_table,
          "python benchmarks/fsdp_cross_node.py --saved"),
    Table("fsdp-cross-node-emulated-1gbit", _emulated_runs("fsdp_cross_node", "1gbit"),
          _emulated("1gbit", 2.45, "fsdp_cross_node"),
          "python benchmarks/emulated.py --grid fsdp_cross_node --saved --target 2.45 --wan 1gbit"),
    Table("fsdp-cross-node-emulated-10gbit", _emulated_runs("fsdp_cross_node", "10gbit"),
          _emulated("10gbit", 2.45, "fsdp_cross_node"),
          "python benchmarks/emulated.py --grid fsdp_cross_node --saved --target 2.45 --wan 10gbit"),
    Table("sharded-emulated-1gbit", _emulated_runs("sharded", "1gbit"), _emulated("1gbit", 2.45, "sharded"),
          "python benchmarks/emulated.py --grid sharded --saved --target 2.45 --wan 1gbit"),
    Table("sharded-emulated-100mbit", _emulated_runs("sharded", "100mbit"), _emulated("100mbit", 2.45, "sharded"),
          "python benchmarks/emulated.py --grid sharded --saved --target 2.45 --wan 100mbit"),
]


#: the 2-core VM of ``docs/benchmarks.md``, for the stored logs that do not name their machine
VM = "the 2-core VM of docs/benchmarks.md (not recorded in the file)"
#: the stored ``weightgrad_wan.py --strategies weightgrad --wg ...`` runs, one file per variant
WEIGHTGRAD_VARIANTS = ["staleness1", "staleness1_eq13", "element"]
DILOCO_GAP = [("diloco", "ddp"), ("diloco_sweep", "ddp_b32"), ("diloco_sparse", "diloco_h1_avg"),
              ("diloco_sparse", "diloco_h1_avg_b32"), ("diloco_sparse", "diloco_h5_avg"), ("diloco_sparse", "diloco_h5"),
              ("diloco_sparse", "diloco_h10_avg"), ("diloco", "diloco_h10"), ("diloco", "diloco_h50"),
              ("diloco_sparse", "sparseloco_h5"), ("diloco_sparse", "sparseloco_h10"),
              ("diloco_sparse", "sparseloco_h10_3pct_dense1d")]
DILOCO_VALUES = ["diloco_h50", "sparseloco_h50", "sparseloco_dense1d", "chunk_dct_k64", "chunk_dct_c16_k4",
                 "chunk_dct_k64_nesterov"]
DILOCO_WARM = ["ddp_warm", "h50_warm", "h50_warm_lr2e-3", "h10_warm", "int8_h50_warm", "terngrad_h50_warm",
               "terngrad_b64_h50_warm", "ddp_warm2000", "h50_warm2000"]

TABLES += [
    Table("link-probe", lambda: [RESULTS / "step_time.json"], _link_probe_table,
          "python tools/results_tables.py --only link-probe"),
    Table("hook-breakdown", lambda: [RESULTS / "hook_breakdown_shared.log"], _hook_breakdown_table,
          "python tools/results_tables.py --only hook-breakdown",
          produced="python -m gradcomp_lab.emulate --nproc 4 --bandwidth 1gbit -- python benchmarks/hook_breakdown.py "
                   "--batch 8 --strategies ddp terngrad terngrad:ignore", machine=VM),
    Table("hook-alone", lambda: [RESULTS / "hook_alone_default.log", RESULTS / "hook_alone_malloc_reuse.log"],
          _hook_alone_table, "python tools/results_tables.py --only hook-alone",
          produced="python benchmarks/hook_breakdown.py --alone --batch 8 --world 4 (the second with "
                   "MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ at 2**30, as step_time.py --malloc-reuse)",
          machine=VM),
    Table("hook-overhead", lambda: [RESULTS / "hook_overhead/cpu_n1_n2.md"], _stored_table,
          "python tools/results_tables.py --only hook-overhead"),
    Table("scatter-ops", lambda: [RESULTS / "micro/scatter_ops.md"], _stored_table,
          "python tools/results_tables.py --only scatter-ops"),
    Table("powersgd-products", lambda: [RESULTS / "micro/powersgd_products.md"],
          _selected_rows(lambda cells: cells[1] in ("2 x 1024 x 1024", "")),
          "python tools/results_tables.py --only powersgd-products"),
    Table("sparse-compressors", lambda: [RESULTS / "sparse_compressors.json"], _sparse_compressors_table,
          "python tools/results_tables.py --only sparse-compressors"),
    Table("kernels-cpu", lambda: [RESULTS / "kernels.json", RESULTS / "kernels_1m_repeats.log"], _kernels_table,
          "python tools/results_tables.py --only kernels-cpu"),
    Table("onebit-momentum", lambda: [RESULTS / "micro/onebit_momentum.md"], _stored_table,
          "python tools/results_tables.py --only onebit-momentum", machine=VM),
    Table("reliability-overhead", lambda: [RESULTS / "micro/reliability_overhead.md"], _stored_table,
          "python tools/results_tables.py --only reliability-overhead"),
    Table("emulator-allreduce", lambda: [RESULTS / "emulator_allreduce.log"], _emulator_allreduce_table,
          "python tools/results_tables.py --only emulator-allreduce", machine=VM),
    Table("baselines", lambda: [RESULTS / "baselines/digits_5_epochs.md"], _stored_table,
          "python tools/results_tables.py --only baselines"),
    Table("weightgrad-loopback", lambda: [RESULTS / "weightgrad/loopback.md"], _stored_table,
          "python tools/results_tables.py --only weightgrad-loopback"),
    Table("weightgrad-variants", lambda: [RESULTS / f"weightgrad/loopback_{name}.md" for name in WEIGHTGRAD_VARIANTS],
          _weightgrad_variants_table, "python tools/results_tables.py --only weightgrad-variants"),
    Table("weightgrad-emulated", lambda: [RESULTS / "weightgrad/emulated.md"], _stored_table,
          "python tools/results_tables.py --only weightgrad-emulated"),
    Table("monitor-overhead", lambda: [RESULTS / "monitor/overhead.md"], _stored_table,
          "python tools/results_tables.py --only monitor-overhead"),
    Table("diloco-values", lambda: [RESULTS / "diloco_sparse" / f"{label}.json" for label in DILOCO_VALUES],
          _diloco_reference_table("diloco_h50"), "python tools/results_tables.py --only diloco-values"),
    Table("diloco-gap", lambda: [RESULTS / folder / f"{label}.json" for folder, label in DILOCO_GAP],
          _diloco_gap_table, "python tools/results_tables.py --only diloco-gap"),
    Table("diloco-warm", lambda: [RESULTS / "diloco_warm" / f"{label}.json" for label in DILOCO_WARM],
          _diloco_warm_table, "python tools/results_tables.py --only diloco-warm"),
]


#: the reproduction runners' stored results (``benchmarks/repro_*.py --out``)
REPRO = RESULTS / "reproductions"
#: TernGrad Fig. 3's optimizers as the page names them
REPRO_OPTIMIZERS = {"momentum": "momentum", "sgd": "vanilla SGD"}


def _points(run: dict[str, Any], reference: dict[str, Any] | None) -> str:
    """Test accuracy against a reference run's, in points (empty for the reference itself)."""
    if reference is None or reference is run:
        return ""
    return f"{100 * (run['test_acc'] - reference['test_acc']):+.2f}"


def _repro_terngrad_table(runs: list[dict[str, Any]]) -> str:
    """``repro_terngrad_lenet.py``'s rows, each TernGrad row against the fp32 row of its optimizer."""
    lines = ["| optimizer (base LR) | method | N | steps | test acc (EMA) | vs fp32 | test loss | bytes / worker / step "
             "| fit s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in (row for run in runs for row in run["rows"]):
        fp32 = next(r for run in runs for r in run["rows"] if r["optimizer"] == row["optimizer"] and r["method"] == "fp32")
        method, workers = ("fp32", "any") if row["method"] == "fp32" else ("TernGrad", str(row["workers"]))
        lines.append(f"| {REPRO_OPTIMIZERS.get(row['optimizer'], row['optimizer'])} ({row['lr']}) | {method} | "
                     f"{workers} | {row['steps']} | {100 * row['test_acc']:.2f}% | {_points(row, fp32)} | "
                     f"{row['test_loss']:.4f} | {row['bytes_per_step']:,.0f} | {row['fit_seconds']:.0f} |")
    return "\n".join(lines)


#: Aji & Heafield's results beside each Gradient Dropping run (MNIST, 20 epochs; Fig. 2 and 4, Sec. 5.4)
GRADDROP_PAPER = {"baseline": "99.28% final (MNIST, 20 epochs)", "drop90_global": "learns (Fig. 2)",
                  "drop99_global": "99.42% final; 50x (coordinate-value encoding)", "drop999_global": "learns (Fig. 2)",
                  "drop99_layer": "no visible difference from global (Fig. 4)",
                  "drop99_global_layernorm": "no visible difference on MNIST (Fig. 4)",
                  "drop99_1bit_threshold": "all 1-bit variants work on MNIST"}
#: what each Fig. 4 / Sec. 5.4 variant changes, as the page names it
GRADDROP_VARIANTS = {"drop99_global_layernorm": "MLP with layer norm", "drop99_1bit_threshold": "survivors to +-threshold",
                     "drop99_1bit_column_mean": "per-column sign means", "drop99_1bit_global_mean": "one mean per sign"}


def _baseline(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for run in runs for r in run["rows"] if r["run"] == "baseline")


def _repro_graddrop_table(runs: list[dict[str, Any]]) -> str:
    """``repro_sparse.py graddrop``'s rows: threshold scope and drop ratio from each run's compressor."""
    baseline = _baseline(runs)
    lines = ["| run | threshold | drop ratio | steps | test acc | vs baseline | compression | paper |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in runs[0]["rows"]:
        options = row["compressor"].get("init_args", {})
        scope = {"global": "global", "layer": "per layer"}.get(options.get("scope", ""), "")
        ratio = f"{100 * options.get('drop_ratio', 0):g}%"
        lines.append(f"| {row['run']} | {scope} | {ratio} | {row['steps']} | {100 * row['test_acc']:.2f}% | "
                     f"{_points(row, baseline)} | {row['compression']:.1f}x | {GRADDROP_PAPER.get(row['run'], '')} |")
    return "\n".join(lines)


def _repro_graddrop_longer_table(runs: list[dict[str, Any]]) -> str:
    """The longer Gradient Dropping runs, each against the baseline of the same length."""
    baseline = _baseline(runs)
    lines = ["| run | steps | test acc | vs baseline | compression |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {row['run']} | {row['steps']} | {100 * row['test_acc']:.2f}% | {_points(row, baseline)} | "
              f"{row['compression']:.1f}x |" for row in runs[0]["rows"]]
    return "\n".join(lines)


def _repro_graddrop_variants_table(runs: list[dict[str, Any]]) -> str:
    """Fig. 4's layer norm and Sec. 5.4's 1-bit variants (the second file) against the baseline of the first."""
    baseline = _baseline(runs[:1])
    lines = [f"| run | steps | test acc | vs baseline ({100 * baseline['test_acc']:.2f}%) | compression | paper |",
             "|---|---:|---:|---:|---:|---|"]
    for row in runs[1]["rows"]:
        what = f" ({GRADDROP_VARIANTS[row['run']]})" if row["run"] in GRADDROP_VARIANTS else ""
        lines.append(f"| {row['run']}{what} | {row['steps']} | {100 * row['test_acc']:.2f}% | "
                     f"{_points(row, baseline)} | {row['compression']:.1f}x | {GRADDROP_PAPER.get(row['run'], '')} |")
    return "\n".join(lines)


def _repro_adacomp_table(runs: list[dict[str, Any]]) -> str:
    """``repro_sparse.py adacomp``'s rows: compression overall and per layer type, then the paper's row."""
    rows = runs[0]["rows"]
    options: dict[str, Any] = next((r["compressor"].get("init_args", {}) for r in rows if r["run"] == "adacomp"), {})
    lines = [f"| run | learners | steps | test acc | compression, all | conv layers (L_T = "
             f"{options.get('bin_size_conv', 50)}) | FC layers (L_T = {options.get('bin_size_fc', 500)}) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        kinds = row["compression_per_kind"]
        name = "baseline (fp32)" if row["run"] == "baseline" else "AdaComp" if row["run"] == "adacomp" else row["run"]
        lines.append(f"| {name} | {row['workers']} | {row['steps']} | {100 * row['test_acc']:.2f}% | "
                     f"{row['compression']:.1f}x | {kinds.get('conv', 1):.1f}x | {kinds.get('fc', 1):.1f}x |")
    lines.append("| paper (MNIST, 100 epochs) | 8 | | 0.85% error vs 0.88% baseline | | 40x | 200x |")
    return "\n".join(lines)


#: WeightGrad's Table 2 (CifarNet, 4 workers, 50k steps) beside each run
WEIGHTGRAD_PAPER = {"baseline": "84.56%", "terngrad": "82.41% (-2.15)", "weightgrad": "84.56% (-0.00)"}


def _repro_weightgrad_table(runs: list[dict[str, Any]]) -> str:
    """``repro_weightgrad.py``'s rows (the recipe's staleness bound, then any run with it overridden)."""
    import yaml

    rows = [row for run in runs for row in run["rows"]]
    baseline = next(r for r in rows if r["run"] == "baseline" and not r["extra"])
    recipe = yaml.safe_load((ROOT / "recipes/weightgrad/cifarnet_cifar10_4workers_weightgrad.yaml").read_text())
    lines = ["| run | steps | test acc (EMA) | vs baseline | rank 0 WAN MiB | rank 0 LAN MiB | "
             "paper (CifarNet, 4 workers, 50k steps) |", "|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        bound = next((o.partition("=")[2] for o in row["extra"] if "staleness_bound=" in o), None)
        names = {"baseline": "baseline (DDP, fp32)", "terngrad": "TernGrad (flat, 4 workers)",
                 "weightgrad": f"WeightGrad (2 sites x 2, T = {recipe['trainer']['strategy']['init_args']['staleness_bound']})"}
        name = f"WeightGrad, T = {bound}{' (a WAN round every step)' if bound == '1' else ''}" if bound else names[row["run"]]
        paper = "" if row["extra"] else WEIGHTGRAD_PAPER.get(row["run"], "")
        lines.append(f"| {name} | {row['steps']} | {100 * row['test_acc']:.2f}% | {_points(row, baseline)} | "
                     f"{row['rank0_wan_mib']:.1f} | {row['rank0_lan_mib']:.1f} | {paper} |")
    return "\n".join(lines)


#: the reproductions' tables, registered (added to TABLES) once their runs are stored under
#: benchmarks/results/reproductions/ (benchmarks/repro_*.py; each table's files() names them)
REPRO_TABLES = [
    Table("repro-terngrad-lenet", lambda: [REPRO / "terngrad_lenet_momentum.json", REPRO / "terngrad_lenet_sgd.json"],
          _repro_terngrad_table, "python tools/results_tables.py --only repro-terngrad-lenet"),
    Table("repro-graddrop", lambda: [REPRO / "graddrop_200.json"], _repro_graddrop_table,
          "python tools/results_tables.py --only repro-graddrop"),
    Table("repro-graddrop-longer", lambda: [REPRO / "graddrop_600.json"], _repro_graddrop_longer_table,
          "python tools/results_tables.py --only repro-graddrop-longer"),
    Table("repro-graddrop-variants", lambda: [REPRO / "graddrop_200.json", REPRO / "graddrop_200_variants.json"],
          _repro_graddrop_variants_table, "python tools/results_tables.py --only repro-graddrop-variants"),
    Table("repro-adacomp", lambda: [REPRO / "adacomp_300.json"], _repro_adacomp_table,
          "python tools/results_tables.py --only repro-adacomp"),
    Table("repro-weightgrad", lambda: [REPRO / "weightgrad_200.json", REPRO / "weightgrad_200_t1.json"],
          _repro_weightgrad_table, "python tools/results_tables.py --only repro-weightgrad"),
]


def _model_parameters_table(runs: list[dict[str, Any]]) -> str:
    from gradcomp_lab.models.__main__ import table

    return table()


TABLES += [
    Table("graddrop-global-threshold", lambda: [RESULTS / "micro/graddrop_global_threshold.md"], _stored_table,
          "python tools/results_tables.py --only graddrop-global-threshold"),
    Table("sparse-fashion-mnist", lambda: [RESULTS / "micro/sparse_fashion_mnist.md"], _stored_table,
          "python tools/results_tables.py --only sparse-fashion-mnist"),
    Table("model-parameters", lambda: [], _model_parameters_table,
          "python tools/results_tables.py --only model-parameters",
          computed="each model built on the meta device by `python -m gradcomp_lab.models`, which prints the same "
                   "table"),
]


#: the performance model's stored projections (``benchmarks/projections.py``)
PROJECTIONS = RESULTS / "projections" / "choosing.json"
#: (link in the page, emulated WAN of the stored runs, the projection's link)
CHOOSING_LINKS = [("100 Mbit/s", "100mbit"), ("1 Gbit/s", "1gbit"), ("10 Gbit/s and up", "10gbit")]


def _best_pairs(name: str) -> list[tuple[str, str]]:
    """The (run, DDP run) pairs of a compressor's best setting (the ``lm-long-best`` table's), seed 0 first."""
    return next(pairs for compressor, _, _, _, pairs in _best() if compressor == name)


def _best_gaps(name: str, long: Callable[[str], dict[str, Any]]) -> list[float]:
    """A compressor's loss against DDP at its best setting, per seed (seed 0 first): the numbers behind every page
    that states it (the README's headline, ``lm-long-best``, docs/choosing.md), so that each states the same mean."""
    return [_loss(long(run), long(ddp)) for run, ddp in _best_pairs(name)]


def _choosing_transformer_files() -> list[Path]:
    long = ["ddp", "bf16", "int8", "terngrad",
            *(r for pair in _best_pairs("int8") + _best_pairs("terngrad") + _best_pairs("demo") for r in pair)]
    emulated = [RESULTS / "lm_emulated" / wan / f"{label}.json" for _, wan in CHOOSING_LINKS[:2]
                for label in ("ddp", "bf16", "terngrad", "demo_k64")]
    diloco = [RESULTS / "diloco_emulated" / wan / f"{label}.json" for _, wan in CHOOSING_LINKS[:2]
              for label in ("ddp", "diloco_int8_h50")]
    return ([RESULTS / "lm_long" / f"{label}.json" for label in dict.fromkeys(long)] + emulated + diloco
            + [RESULTS / "diloco" / "ddp.json", RESULTS / "diloco" / "int8_h50.json", PROJECTIONS])


def _by_path(runs: list[dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """A run by its path under ``benchmarks/results/`` (without ``.json``)."""
    found = {Path(run["_path"]).relative_to(RESULTS).with_suffix("").as_posix(): run for run in runs}
    return lambda key: found[key]


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def _times(x: float) -> str:
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x"


def _loss(run: dict[str, Any], ddp: dict[str, Any]) -> float:
    return run["final_val_loss"] / ddp["final_val_loss"] - 1


def _bytes(run: dict[str, Any]) -> float:
    return run["fp32_bytes_per_step"] / run["bytes_per_step"]


def _step(run: dict[str, Any], ddp: dict[str, Any]) -> str:
    return f"{run['median_step_seconds'] / ddp['median_step_seconds']:.2f}"


def _projected(projection: dict[str, Any], method: str, link: str) -> float:
    return next(r["speedup"] for r in projection["rows"] if r["method"] == method and r["link"] == link)


def _choosing_transformer_table(runs: list[dict[str, Any]]) -> str:
    """docs/choosing.md's transformer rows: loss and bytes of the 2000-step grid, step time of the emulated runs
    (100 Mbit/s, 1 Gbit/s) and of the 2000-step runs over loopback, the stored projection."""
    run = _by_path(runs)
    long = lambda label: run(f"lm_long/{label}")  # noqa: E731
    ddp = long("ddp")
    proj = run("projections/choosing")["transformer"]
    tern = [(long(r), long(d)) for r, d in _best_pairs("terngrad")]
    tern_loss = [_loss(r, d) for r, d in tern]
    demo = [(long(r), long(d)) for r, d in _best_pairs("demo")]
    demo_loss = [_loss(r, d) for r, d in demo]
    diloco_int8, diloco_ddp = run("diloco/int8_h50"), run("diloco/ddp")
    tern_cell = f"{100 * min(tern_loss):+.1f} to {_pct(max(tern_loss))}"
    int8 = long("int8")
    int8_loss = _best_gaps("int8", long)
    int8_cell = f"0; {_pct(statistics.mean(int8_loss))} (g)"
    projected = "speed-up (projected) (p)" if proj.get("kernels") else "speed-up (projected)"
    lines = [f"| link | goal | use | loss vs DDP | bytes | step / DDP's (here) | {projected} |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for link, wan in CHOOSING_LINKS:
        if wan == "10gbit":
            lines.append(f"| {link} | DDP's loss | `\"ddp\"` here; `\"int8\"` on GPUs | {int8_cell} | "
                         f"1x; {_times(_bytes(int8))} | 1; {_step(int8, ddp)} (f) | "
                         f"1x; {_times(_projected(proj, 'int8', wan))} |")
            continue
        emulated = {label: run(f"lm_emulated/{wan}/{label}") for label in ("ddp", "bf16", "terngrad", "demo_k64")}
        e_ddp = emulated["ddp"]
        if wan == "100mbit":
            bf16 = long("bf16")
            lines.append(f"| {link} | DDP's loss | `strategy=\"bf16\"` | {_pct(_loss(bf16, ddp))} | {_times(_bytes(bf16))} | "
                         f"{_step(emulated['bf16'], e_ddp)} | {_times(_projected(proj, 'bf16', wan))} |")
        else:
            lines.append(f"| {link} | DDP's loss | `\"ddp\"` here; `\"int8\"` on GPUs | {int8_cell} | "
                         f"1x; {_times(_bytes(int8))} | 1; not run | 1x; {_times(_projected(proj, 'int8', wan))} |")
        lines.append(f"| {link} | DDP's loss, fewer bytes | TernGrad per-64 (a) | {tern_cell} | {_times(_bytes(tern[0][0]))} "
                     f"| {_step(emulated['terngrad'], e_ddp)} (b) | "
                     f"{_times(_projected(proj, 'hierarchical terngrad', wan))} (h) |")
        lines.append(f"| {link} | most bytes, within 2 % | DeMo (c) | {_pct(statistics.mean(demo_loss))} | "
                     f"{_times(_bytes(demo[0][0]))} | {_step(emulated['demo_k64'], e_ddp)} (d) | "
                     f"{_times(_projected(proj, 'hierarchical demo', wan))} (h) |")
        if wan == "100mbit":
            sites = {label: run(f"diloco_emulated/{wan}/{label}") for label in ("ddp", "diloco_int8_h50")}
            lines.append(f"| {link} | most bytes | DiLoCo, int8, H = 50 (e) | {_pct(_loss(diloco_int8, diloco_ddp))} | "
                         f"{_times(_bytes(diloco_int8))} | {_step(sites['diloco_int8_h50'], sites['ddp'])} | "
                         f"{_times(_projected(proj, 'diloco H=50 int8', wan))} |")
    terngrad = long("terngrad")
    at_1gbit = lambda label: run(f"diloco_emulated/1gbit/{label}")  # noqa: E731
    notes = [
        f"- (a) TernGrad with a scaler per 64 elements, clipping at 1 sigma, the embeddings in fp32: "
        f"`strategy=\"terngrad_lm\"` (`recipes/lm/gpt_small_terngrad_b64.yaml`). Loss {', '.join(_pct(x) for x in tern_loss)} at "
        f"{len(tern_loss)} seeds.",
        f"- (b) Measured with TernGrad's registered settings ({_times(_bytes(terngrad))} fewer bytes, "
        f"{_pct(_loss(terngrad, ddp))} loss). With setting (a), over loopback, the step is "
        f"{_step(tern[0][0], ddp)}x DDP's: on these CPUs the encoding costs more than the link saves.",
        f"- (c) DeMo with 16x16 chunks, the top 8 of each, one-byte indices, SignSGD at lr 0.007, 300 warm-up steps: "
        f"`strategy=\"demo_lm\"` with that optimizer (`recipes/lm/gpt_small_demo_c16_k8.yaml`). {_pct(statistics.mean(demo_loss))} is the mean of "
        f"{len(demo_loss)} seeds ({_pct(min(demo_loss))} to {_pct(max(demo_loss))}); it replaces AdamW with its own "
        f"`SignSGD`.",
        f"- (d) Measured with DeMo at top-64 of 64x64 chunks. Setting (c) over loopback: {_step(demo[0][0], ddp)}x "
        f"DDP's step.",
        f"- (e) `recipes/diloco/gpt_stdlib_diloco_int8.yaml` (INTELLECT-1's int8 pseudo-gradients). Measured as 2 sites "
        f"of 2 ranks; at 1 Gbit/s its step is {_step(at_1gbit('diloco_int8_h50'), at_1gbit('ddp'))} of DDP's.",
        f"- (f) Over loopback, every compressor's step is slower than DDP's on these CPUs (bf16 "
        f"{_step(long('bf16'), ddp)}, int8 {_step(int8, ddp)}).",
        f"- (g) int8's mean over {len(int8_loss)} seeds ({', '.join(_pct(x) for x in int8_loss)}).",
        f"- (h) The hierarchical exchange: dense inside each node, compressed between nodes "
        f"(`GradCompStrategy(compressor, hierarchy=\"node\")`). Its loss has not been measured on the language model. "
        f"Sent flat across all {proj['world_size']} GPUs instead, TernGrad is projected at "
        f"{_times(_projected(proj, 'terngrad', '100mbit'))} and DeMo at {_times(_projected(proj, 'demo', '100mbit'))} "
        f"at 100 Mbit/s.",
    ]
    kernels = proj.get("kernels")
    if kernels:  # which device's kernels the projected column's encoding and decoding come from
        names = {"terngrad": "TernGrad", "graddrop": "Gradient Dropping", "adacomp": "AdaComp", "topk": "top-k",
                 "dgc": "DGC", "int8": "int8", "qsgd": "QSGD", "powersgd": "PowerSGD", "onebit": "1-bit SGD",
                 "demo": "DeMo"}
        notes.append(
            f"- (p) The projection's encoding and decoding: {', '.join(names.get(c, c) for c in kernels['measured'])} "
            f"at the group compress and decode throughput measured on one {kernels['device']} "
            f"(`{kernels['file']}`, groups of {kernels['size'] / 2**20:g}M elements: "
            f"`gradcomp-perf transformer --kernels`); {', '.join(names.get(c, c) for c in kernels['assumed'])} "
            f"assumed memory-bound at the {proj['device'].upper()}'s published bandwidth (no kernel rows measured for them).")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def _choosing_cnn_files() -> list[Path]:
    return [REPRO / "terngrad_lenet_momentum.json", REPRO / "terngrad_lenet_sgd.json", REPRO / "adacomp_300.json",
            RESULTS / "step_time_matrix.json", *(RESULTS / name for name in TARGET_RUNS if "default" in name),
            PROJECTIONS]


def _choosing_cnn_table(runs: list[dict[str, Any]]) -> str:
    """docs/choosing.md's CNN rows: accuracy and bytes of the reproductions (LeNet, 4 TernGrad workers; AdaComp's
    MNIST-CNN), step time of the quick step-time grid (LeNet, 4 ranks), the stored AlexNet projection."""
    from benchmarks import ratio_summary

    run = _by_path(runs)
    repro = {opt: run(f"reproductions/terngrad_lenet_{opt}")["rows"] for opt in ("momentum", "sgd")}
    fp32 = {opt: next(r for r in rows if r["method"] == "fp32") for opt, rows in repro.items()}
    tern = {opt: next(r for r in rows if r["method"] == "terngrad" and r["workers"] == 4) for opt, rows in repro.items()}
    ada_rows = run("reproductions/adacomp_300")["rows"]
    ada, ada_base = (next(r for r in ada_rows if r["run"] == name) for name in ("adacomp", "baseline"))
    tern_acc = f"{_points(tern['momentum'], fp32['momentum'])} points (a)"
    tern_bytes = _times(fp32["momentum"]["bytes_per_step"] / tern["momentum"]["bytes_per_step"])
    # each strategy's median step over DDP's, per (ranks, link, model), in the quick step-time grid
    grid = {strategy: ratio_summary.ratios(Path(run("step_time_matrix")["_path"]), strategy, ["ddp"])
            for strategy in ("terngrad", "adacomp", "bf16")}
    step = {(strategy, wan): grid[strategy][4, wan, "lenet"]["ddp"] for strategy in grid for _, wan in CHOOSING_LINKS}
    proj = run("projections/choosing")["cnn"]
    speedup = {(r["compressor"], r["hierarchical"], r["link"]): r["speedup"] for r in proj["rows"]}
    lines = ["| link | goal | use | accuracy vs DDP | bytes | step / DDP's (here) | speed-up (projected) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for link, wan in CHOOSING_LINKS:
        if wan == "10gbit":
            lines.append(f"| {link} | DDP's accuracy | `\"ddp\"` here; TernGrad (h) on GPUs | 0; "
                         f"{_points(tern['momentum'], fp32['momentum'])} points | 1x; {tern_bytes} | 1; "
                         f"{step['terngrad', wan]:.2f} | 1x; {_times(speedup['terngrad', True, wan])} (h) |")
            continue
        lines.append(f"| {link} | DDP's accuracy | `strategy=\"terngrad\"` | {tern_acc} | {tern_bytes} | "
                     f"{step['terngrad', wan]:.2f} (b) | {_times(speedup['terngrad', True, wan])} (h); "
                     f"{_times(speedup['terngrad', False, wan])} flat |")
        lines.append(f"| {link} | most bytes | `strategy=\"adacomp\"` | {_points(ada, ada_base)} points (c) | "
                     f"{ada['compression']:.1f}x | {step['adacomp', wan]:.2f} | "
                     f"{_times(speedup['adacomp', True, wan])} (h); {_times(speedup['adacomp', False, wan])} flat |")
    targets = [row["ddp"] for r in runs if "step_time_target_default" in r["_path"]
               for row in ratio_summary.ratios(Path(r["_path"]), "terngrad", ["ddp"]).values()]
    mlp = grid["terngrad"][4, "100mbit", "mlp"]["ddp"]
    notes = [
        f"- (a) LeNet on Fashion-MNIST, {tern['momentum']['workers']} workers, {tern['momentum']['steps']} steps, "
        f"momentum SGD; with plain SGD "
        f"{_points(tern['sgd'], fp32['sgd'])} points.",
        f"- (b) LeNet (1.2M parameters). On a 36.8M-parameter MLP TernGrad's step is {mlp:.2f} of DDP's at 100 Mbit/s "
        f"and {statistics.median(targets):.2f} at 1 Gbit/s (the median of {len(targets)} runs).",
        f"- (c) The MNIST-CNN on Fashion-MNIST, {ada['workers']} learners, {ada['steps']} steps.",
        f"- (h) The hierarchical exchange (`GradCompStrategy(compressor, hierarchy=\"node\")`): dense inside each node, "
        f"compressed between the {proj['world_size'] // proj['gpus_per_node']} nodes. Sent flat across "
        f"{proj['world_size']} GPUs, TernGrad's planner uses an int8 all-reduce (4x fewer bytes than fp32, not 16x), "
        f"and AdaComp's all-gather brings every GPU the other {proj['world_size'] - 1} payloads.",
        "",
        f"At 10 Gbit/s a small CNN's step is compute-bound on these CPUs, and compression only adds encoding: TernGrad "
        f"{step['terngrad', '10gbit']:.2f}, AdaComp {step['adacomp', '10gbit']:.2f}, bf16 {step['bf16', '10gbit']:.2f} "
        f"of DDP's step (LeNet).",
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


#: docs/migrating.md's alternatives to 1-bit Adam that keep AdamW: (what it replaces, what to use, the compressor
#: whose best setting (the ``lm-long-best`` table's) it is, or "" for DiLoCo with int8 pseudo-gradients)
MIGRATING_ONEBIT = [
    ("fewer bytes at Adam's loss", '`strategy="int8"`', "int8"),
    ("same, more bytes saved", '`strategy="terngrad_lm"`: TernGrad with a scaler per 64 elements, embeddings in fp32 '
     "(`recipes/lm/gpt_small_terngrad_b64.yaml`)", "terngrad"),
    ("1-bit signs with error feedback", '`strategy="onebit"` (1-bit SGD) with the embeddings in fp32 and 100 dense '
     "steps", "onebit"),
    ("the most bytes saved", '`strategy="demo_lm"` (`recipes/lm/gpt_small_demo_c16_k8.yaml`); it replaces AdamW by '
     "DeMo's own `SignSGD`", "demo"),
    ("0/1 Adam's skipped rounds", "DiLoCo with int8 pseudo-gradients every 50 steps "
     "(`recipes/diloco/gpt_stdlib_diloco_int8.yaml`)", ""),
]


def _migrating_onebit_files() -> list[Path]:
    labels = [label for _, _, name in MIGRATING_ONEBIT if name for pair in _best_pairs(name) for label in pair]
    return ([RESULTS / "lm_long" / f"{label}.json" for label in dict.fromkeys(labels)]
            + [RESULTS / "diloco" / "ddp.json", RESULTS / "diloco" / "int8_h50.json"])


def _migrating_onebit_table(runs: list[dict[str, Any]]) -> str:
    """docs/migrating.md's alternatives to 1-bit Adam: loss against DDP at the same seed (each seed, or the mean
    of more than three) and bytes, at each compressor's best setting on the 2000-step grid."""
    run = _by_path(runs)
    lines = ["| if you used 1-bit Adam for | use | measured |", "| --- | --- | --- |"]
    for need, use, name in MIGRATING_ONEBIT:
        if not name:
            diloco = run("diloco/int8_h50")
            measured = f"{_pct(_loss(diloco, run('diloco/ddp')))} at {_times(_bytes(diloco))}"
        else:
            pairs = [(run(f"lm_long/{r}"), run(f"lm_long/{d}")) for r, d in _best_pairs(name)]
            gaps = [_loss(r, d) for r, d in pairs]
            if len(gaps) > 3:
                loss = f"{_pct(statistics.mean(gaps))} (mean of {len(gaps)} seeds)"
            else:
                loss = " / ".join(_pct(g) for g in gaps) + (f" ({len(gaps)} seeds)" if len(gaps) > 1 else "")
            measured = f"{loss} at {_times(_bytes(pairs[0][0]))} fewer bytes" if name == "int8" else \
                f"{loss} at {_times(_bytes(pairs[0][0]))}"
        lines.append(f"| {need} | {use} | {measured} |")
    return "\n".join(lines)


TABLES += [
    Table("choosing-transformer", _choosing_transformer_files, _choosing_transformer_table,
          "python tools/results_tables.py --only choosing-transformer"),
    Table("migrating-onebit", _migrating_onebit_files, _migrating_onebit_table,
          "python tools/results_tables.py --only migrating-onebit"),
]


#: the target validation losses of the emulated grids' stored tables (each grid's ``emulated.py --target``)
EMULATED_TARGETS = {"lm": 2.45, "sharded": 2.45, "diloco": 1.3}
#: the README's headline compressors on the 2000-step grid, at their best settings, as the README names them
HEADLINE_BEST = [("int8", "int8"), ("qsgd", "QSGD (31 levels)"), ("terngrad", "TernGrad (per-64 scalers)"),
                 ("demo", "DeMo")]
#: the 1-bit Adam and 0/1 Adam settings the README cites (rows of :data:`FROZEN_ADAM`: the best of each)
HEADLINE_FROZEN = [("1-bit Adam", 0), ("0/1 Adam", 5)]
#: the emulated language-model grid's runs, as the README names them
EMULATED_NAMES = {"bf16": "bf16", "powersgd_r1": "PowerSGD rank 1", "powersgd_r4": "PowerSGD rank 4",
                  "powersgd_r16": "PowerSGD rank 16", "terngrad": "TernGrad", "qsgd": "QSGD", "demo_k64": "DeMo"}


def _headline_files() -> list[Path]:
    from benchmarks.emulated import GRIDS

    long = [label for name, _ in HEADLINE_BEST for pair in _best_pairs(name) for label in pair]
    long += [label for _, row in HEADLINE_FROZEN for pair in FROZEN_ADAM[row][2] for label in pair]
    emulated = [GRIDS[grid].out / wan / f"{label}.json" for grid in ("lm", "sharded") for wan in ("100mbit", "1gbit")
                for label in GRIDS[grid].runs]
    return ([RESULTS / "lm_long" / f"{label}.json" for label in dict.fromkeys(long)] + emulated
            + [RESULTS / name for name in TARGET_RUNS if "default" in name]
            + [RESULTS / "baselines/digits_5_epochs.md", RESULTS / "diloco/ddp.json", RESULTS / "diloco/int8_h50.json"]
            + [GRIDS["diloco"].out / "100mbit" / f"{label}.json" for label in ("ddp", "diloco_int8_h50")])


def _speedups(runs: list[dict[str, Any]], grid: str, wan: str) -> dict[str, float]:
    """Each stored run's time to its grid's target over the baseline's, on one WAN rate (runs that did not reach
    the target left out)."""
    from benchmarks.emulated import GRIDS, time_to

    spec = GRIDS[grid]
    folder = (spec.out / wan).as_posix()
    found = {r["label"]: time_to(r, EMULATED_TARGETS[grid]) for r in runs if Path(r["_path"]).parent.as_posix() == folder}
    base = found[spec.baseline]
    assert base is not None
    return {label: base / t for label, t in found.items() if t is not None and label != spec.baseline}


def _headline_table(runs: list[dict[str, Any]]) -> str:
    """The README's headline numbers, each from the stored runs of the page it links to."""
    from benchmarks import ratio_summary
    from lightning_gradcomp.strategies.presets import measure

    run = _by_path(runs)
    long = {Path(r["_path"]).stem: r for r in runs if Path(r["_path"]).parent.name == "lm_long"}
    seeds, cells = [], []
    for name, shown in HEADLINE_BEST:
        pairs = _best_pairs(name)
        seeds.append(len(pairs))
        gap = statistics.mean(_best_gaps(name, long.__getitem__))
        ratio = _bytes(long[pairs[0][0]])
        cells.append(f"{shown} {_pct(gap)} at {_times(ratio)}")
    frozen = []
    for method, row in HEADLINE_FROZEN:
        pairs = FROZEN_ADAM[row][2]
        seeds.append(len(pairs))
        frozen.append((method, *measure(long, pairs)))
    quality = (f"{'; '.join(cells)}; {frozen[0][0]} {frozen[0][1]:+.1f} % and {frozen[1][0]} {frozen[1][1]:+.1f} % "
               f"at {_times(frozen[0][2])} and {_times(frozen[1][2])} fewer bytes over the whole run (means over "
               f"{min(seeds)}-{max(seeds)} seeds)")
    lm = {wan: _speedups(runs, "lm", wan) for wan in ("100mbit", "1gbit")}
    best_1g = max(lm["1gbit"].values())
    ties = [EMULATED_NAMES.get(label, label) for label, s in lm["1gbit"].items() if f"{s:.2f}" == "1.00"]
    tie = f" ({' and '.join(ties)} tie)" if len(ties) > 1 else f" ({ties[0]} ties)" if ties else ""
    fastest = max(lm["1gbit"], key=lm["1gbit"].__getitem__)
    at_1g = (f"no compressor faster than DDP on this machine{tie}" if best_1g < 1.005
             else f"{EMULATED_NAMES.get(fastest, fastest)} {best_1g:.1f}x faster than DDP")
    lm_cell = f"100 Mbit/s: TernGrad {lm['100mbit']['terngrad']:.1f}x faster than DDP; 1 Gbit/s: {at_1g}"
    sharded = {wan: _speedups(runs, "sharded", wan)["hsdp_terngrad"] for wan in ("1gbit", "100mbit")}
    fp32, tern = (run(f"sharded_emulated/1gbit/{label}")["final_val_loss"] for label in ("hsdp_fp32", "hsdp_terngrad"))
    sharded_cell = (f"TernGrad's shards {sharded['1gbit']:.2f}x (1 Gbit/s) and {sharded['100mbit']:.2f}x (100 Mbit/s) "
                    f"sooner than stock HSDP, at {'its' if abs(tern / fp32 - 1) < 0.005 else _pct(tern / fp32 - 1)} "
                    f"loss")
    targets = [row for r in runs if "step_time_target_default" in r["_path"]
               for row in ratio_summary.ratios(Path(r["_path"]), "terngrad", ["ddp", "ddp_bf16"]).values()]
    step_cell = (f"TernGrad's step {statistics.median(r['ddp'] for r in targets):.2f}x of DDP's and "
                 f"{statistics.median(r['ddp_bf16'] for r in targets):.2f}x of bf16 DDP's (median of {len(targets)} "
                 f"runs)")
    digits = {cells[0]: cells for cells in _table_rows(run("baselines/digits_5_epochs")["table"])}
    tern_acc, ddp_acc = (float(digits[name][1].rstrip("%")) for name in ("terngrad", "ddp"))
    digits_cell = (f"TernGrad {tern_acc - ddp_acc:+.1f} points of DDP's accuracy with {digits['terngrad'][3]} fewer "
                   f"bytes (digits MLP: {tern_acc:.1f} % against {ddp_acc:.1f} %); paper-vs-ours tables per recipe")
    diloco, diloco_ddp = run("diloco/int8_h50"), run("diloco/ddp")
    diloco_speed = _speedups(runs, "diloco", "100mbit")["diloco_int8_h50"]
    diloco_cell = (f"{_times(_bytes(diloco))} fewer bytes than DDP; {diloco_speed:.1f}x faster than DDP to a target "
                   f"loss over 100 Mbit/s (2 sites of 2); but {_pct(_loss(diloco, diloco_ddp))} loss at equal tokens "
                   f"on this small model")
    cpu, emulated = "2-core CPU VM", "2-core CPU VM, emulated network"
    rows = [
        ("Transformer with AdamW (GPT, 120k parameters, 4 ranks, 2000 steps): loss against DDP's at each "
         "compressor's best setting", quality, cpu, "`docs/transformers.md`"),
        ("Same workload family (446k parameters), time to a target loss, 2 sites over an emulated WAN", lm_cell,
         emulated, "`docs/transformers.md`"),
        ("Sharded model (FSDP2 in each site, 446k-parameter GPT), time to a target loss, 2 sites of 2 over an "
         "emulated WAN", sharded_cell, emulated, "`docs/sharded.md`"),
        ("Step time, 36.8M-parameter MLP, 4 ranks over an emulated 1 Gbit/s link", step_cell, emulated,
         "`docs/benchmarks.md`"),
        ("CNN/MLP with SGD: the papers' tables", digits_cell, cpu, "`docs/reproductions.md`, `docs/baselines.md`"),
        ("DiLoCo, int8 pseudo-gradients, H = 50, 4 ranks (GPT, 120k parameters)", diloco_cell, emulated,
         "`docs/diloco.md`"),
    ]
    lines = ["| what | result | hardware | page |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


TABLES.append(Table("headline", _headline_files, _headline_table, "python tools/results_tables.py --only headline"))

#: docs/diloco.md's targets: the stored runs each measured cell reads, by folder under benchmarks/results/
DILOCO_TARGET_RUNS = {
    "diloco": ["ddp", "diloco_h10", "diloco_h50", "diloco_h100", "int8_h50", "terngrad_h50", "sparseloco_h50"],
    "diloco_seeds": ["diloco_h50_seed1", "int8_h50_seed1", "terngrad_h50_seed1"],
    "diloco_sweep": ["ddp_lr8e-3", "ddp_b32", "h50_b32"],
    "diloco_sparse": ["diloco_h1_avg", "diloco_h5_avg", "sparseloco_dense1d", "chunk_dct_k64", "chunk_dct_c16_k4",
                      "sparseloco_h5", "sparseloco_h10", "sparseloco_h10_3pct_dense1d"],
    "diloco_warm": ["ddp_warm", "h50_warm", "h50_warm_lr2e-3", "h10_warm", "int8_h50_warm", "terngrad_h50_warm",
                    "terngrad_b64_h50_warm", "ddp_warm2000", "h50_warm2000"],
    "diloco_emulated/1gbit": ["ddp", "diloco_int8_h50"],
    "diloco_emulated/100mbit": ["ddp", "diloco_int8_h50"],
}


def _diloco_targets_table(runs: list[dict[str, Any]]) -> str:
    """docs/diloco.md's targets, each measured cell recomputed from the stored runs (losses against the named
    reference run, bytes per step against it, times to the emulated grid's target)."""
    run = _by_path(runs)
    d = lambda label: run(f"diloco/{label}")  # noqa: E731
    gap = lambda a, b: 100 * (a["final_val_loss"] / b["final_val_loss"] - 1)  # noqa: E731
    ratio = lambda a, b: b["bytes_per_step"] / a["bytes_per_step"]  # noqa: E731
    h50, ddp = d("diloco_h50"), d("ddp")
    sweep, sparse, warm = (lambda folder: lambda label: run(f"{folder}/{label}"))("diloco_sweep"), \
        (lambda label: run(f"diloco_sparse/{label}")), (lambda label: run(f"diloco_warm/{label}"))
    warm_fp32 = [gap(warm(r), warm(base)) for r, base in (("h50_warm", "ddp_warm"), ("h50_warm_lr2e-3", "ddp_warm"),
                                                           ("h10_warm", "ddp_warm"), ("h50_warm2000", "ddp_warm2000"))]
    h1 = gap(sparse("diloco_h1_avg"), ddp)
    met1 = "yes" if gap(h50, ddp) <= 3 else "no (blocked at this model size: needs a model that does not train on 2 CPU cores)"
    row1 = (f"{gap(h50, ddp):+.1f} % ({h50['final_val_loss']:.4f} against DDP's {ddp['final_val_loss']:.4f}, both at "
            f"lr 0.004); H = 10 {gap(d('diloco_h10'), ddp):+.1f} %, H = 100 {gap(d('diloco_h100'), ddp):+.1f} %; "
            f"against DDP at its better lr 0.008 {gap(h50, sweep('ddp_lr8e-3')):+.1f} %; at 4x the worker batch "
            f"{gap(sweep('h50_b32'), sweep('ddp_b32')):+.1f} %; from a dense warm start (the paper's setting) "
            f"{min(warm_fp32):+.1f} % to {max(warm_fp32):+.1f} %. At H = 1 (averaging the workers' AdamW steps every "
            f"step, DDP's bytes) already {h1:+.1f} %: the gap is the per-worker AdamW of this small model, not the "
            f"sync interval")
    per_h = {r["steps"] // r["outer_rounds"]: ratio(r, ddp) for r in (d("diloco_h10"), h50, d("diloco_h100"))}
    met2 = "yes" if all(x >= h for h, x in per_h.items()) else "no"
    row2 = (f"{'H x' if met2 == 'yes' else 'below H x'} for fp32 DiLoCo "
            f"({', '.join(f'{x:.1f}x at H = {h}' for h, x in per_h.items())})")
    seeds = lambda label: (d(label)["final_val_loss"] + run(f"diloco_seeds/{label}_seed1")["final_val_loss"]) / 2  # noqa: E731
    two_seed = {name: 100 * (seeds(f"{name}_h50") / seeds("diloco_h50") - 1) for name in ("int8", "terngrad")}
    int8, tern = d("int8_h50"), d("terngrad_h50")
    moves = 100 * abs(run("diloco_seeds/diloco_h50_seed1")["final_val_loss"] / h50["final_val_loss"] - 1)
    sparseloco = d("sparseloco_h50")
    row3 = (f"seed 0: int8 {ratio(int8, h50):.1f}x ({ratio(int8, h50):.3f}x) fewer bytes, {gap(int8, h50):+.2f} %; "
            f"TernGrad {ratio(tern, h50):.1f}x, {gap(tern, h50):+.2f} %. Mean of seeds 0 and 1: int8 "
            f"{two_seed['int8']:+.2f} %, TernGrad {two_seed['terngrad']:+.2f} % (fp32 DiLoCo itself moves {moves:.1f} % "
            f"between the two seeds). SparseLoCo-style {ratio(sparseloco, h50):.0f}x, {gap(sparseloco, h50):+.0f} % at "
            f"H = 50 (1-D tensors dense: {gap(sparse('sparseloco_dense1d'), h50):+.0f} %; DeMo's chunked selection with "
            f"fp32 values: {gap(sparse('chunk_dct_k64'), h50):+.0f} %, with 16x16 chunks "
            f"{gap(sparse('chunk_dct_c16_k4'), h50):+.0f} %); with more rounds "
            f"{gap(sparse('sparseloco_h10'), d('diloco_h10')):+.1f} % at H = 10 and "
            f"{gap(sparse('sparseloco_h5'), sparse('diloco_h5_avg')):+.1f} % at H = 5 "
            f"({ratio(sparse('sparseloco_h5'), sparse('diloco_h5_avg')):.0f}x), top-3 % with 1-D tensors dense "
            f"{gap(sparse('sparseloco_h10_3pct_dense1d'), d('diloco_h10')):+.1f} % at H = 10 "
            f"({ratio(sparse('sparseloco_h10_3pct_dense1d'), d('diloco_h10')):.0f}x). From the dense warm start: int8 "
            f"{gap(warm('int8_h50_warm'), warm('h50_warm')):+.2f} %, TernGrad "
            f"{gap(warm('terngrad_h50_warm'), warm('h50_warm')):+.1f} % "
            f"({gap(warm('terngrad_b64_h50_warm'), warm('h50_warm')):+.1f} % with a scaler per 64 elements; one seed "
            f"each)")
    # 4x fewer bytes is met where the payload is 4x less its per-tensor scales (int8's 4 bytes of every tensor)
    within = [name for name, r in (("int8", int8), ("TernGrad", tern)) if ratio(r, h50) > 3.99
              and two_seed["int8" if name == "int8" else "terngrad"] < 1]
    met3 = (f"{' and '.join(within) or 'neither int8 nor TernGrad'} on the two-seed mean, int8's ratio being 4x less "
            f"its per-tensor scales ({ratio(int8, h50):.3f}x); SparseLoCo-style "
            f"{'no' if gap(sparseloco, h50) > 1 else 'yes'}")
    speed = {wan: _speedups(runs, "diloco", wan)["diloco_int8_h50"] for wan in ("100mbit", "1gbit")}
    row4 = "; ".join(f"{link}: {'yes' if speed[wan] > 1 else 'no'}, {speed[wan]:.2f}x{' DDP' if speed[wan] > 1 else ''}"
                     for link, wan in (("100 Mbit/s", "100mbit"), ("1 Gbit/s", "1gbit")))
    met4 = ", ".join(f"at {link}" for link, wan in (("100 Mbit/s", "100mbit"), ("1 Gbit/s", "1gbit"))
                     if speed[wan] > 1) or "no"
    rows = [("H = 50 within 3 % of DDP after at least 40 rounds", row1, met1),
            ("bytes between sites per token at least H x below DDP's", row2, met2),
            ("int8 / TernGrad / SparseLoCo-style: at least 4x fewer bytes than fp32 DiLoCo, loss within 1 %", row3, met3),
            ("DiLoCo with compressed pseudo-gradients the fastest to a target on the emulated cluster", row4, met4)]
    return "\n".join(["| target | measured | met? |", "|---|---|---|", *(f"| {' | '.join(r)} |" for r in rows)])


def _benchmarks_targets_files() -> list[Path]:
    return [*(RESULTS / name for name in TARGET_RUNS), RESULTS / "step_time_matrix.json",
            RESULTS / "perf_validate_target_default.json", RESULTS / "perf_validate_target_reuse.json",
            RESULTS / "step_time_n2_inf_lenet.json", RESULTS / "kernels.json", RESULTS / "gpu_h100/kernels.json"]


def _benchmarks_targets_table(runs: list[dict[str, Any]]) -> str:
    """docs/benchmarks.md's targets: TernGrad's step against DDP's and bf16 DDP's (the repeated target runs and the
    quick grid at N = 2), the performance model's error ranges, the fast link, and the kernels on CPU and GPU."""
    from benchmarks import ratio_summary

    run = _by_path(runs)
    per_run: dict[str, list[dict[str, float]]] = {"default": [], "reuse": []}
    for r in runs:
        if "step_time_target_" in r["_path"]:
            kind = "reuse" if "--malloc-reuse" in r["command"] else "default"
            per_run[kind] += ratio_summary.ratios(Path(r["_path"]), "terngrad", ["ddp", "ddp_bf16"]).values()
    n2 = ratio_summary.ratios(Path(run("step_time_matrix")["_path"]), "terngrad", ["ddp", "ddp_bf16"])[2, "1gbit", "mlp"]

    def step_row(baseline: str, bound: float, shown: str) -> tuple[str, str]:
        cells = []
        for kind, what in (("default", "with glibc's allocator"), ("reuse", "with `--malloc-reuse`")):
            v = [r[baseline] for r in per_run[kind]]
            cells.append(f"{statistics.median(v):.3f} over {len(v)} runs {what} ({min(v):.3f}-{max(v):.3f})")
        default = [r[baseline] for r in per_run["default"]]
        above = sum(v > bound for v in default)
        met = "**met**" if statistics.median(default) <= bound else "**not met**"
        return (f"median of per-run ratios {cells[0]}, {cells[1]}; N = 2 (a core per rank): {n2[baseline]:.2f}",
                f"{met} (median; {above} of the {len(default)} default-allocator runs above {shown})")

    # the model's error over the runs: (allocator, strategy) -> column -> (min, max) in percent
    errors: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
    counts: dict[str, int] = {}
    for kind in ("default", "reuse"):
        rows = [r for r in run(f"perf_validate_target_{kind}")["rows"] if r["link"] == "1gbit"]
        counts[kind] = max(sum(r["strategy"] == s for r in rows) for s in {r["strategy"] for r in rows})
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            mine = [r for r in rows if r["strategy"] == strategy]
            errors[kind, strategy] = {key: (100 * min(r[key] for r in mine), 100 * max(r[key] for r in mine))
                                      for key in ("error", "overlapped_error", "profiled_error",
                                                  "profiled_overlapped_error")}
    span = lambda lo_hi: f"{lo_hi[0]:+.0f} to {lo_hi[1]:+.0f}%"  # noqa: E731
    worst = lambda kind, key: max(max(abs(x) for x in errors[kind, s][key])  # noqa: E731
                                  for k, s in errors if k == kind)
    names = {"ddp": "DDP", "ddp_bf16": "bf16 DDP", "terngrad": "TernGrad"}
    timeline = ", ".join(f"{names[s]} {span(errors['default', s]['overlapped_error'])}" for k, s in errors
                         if k == "default")
    alone = " / ".join(span(errors["default", s]["profiled_overlapped_error"]) for k, s in errors if k == "default")
    tern_reuse = errors["reuse", "terngrad"]["overlapped_error"]
    perf = (f"DDP's timeline (`overlap=True`), default allocator, {counts['default']} runs: {timeline} in situ; "
            f"{alone} profiled alone. Allocator reuse, {counts['reuse']} runs: the serial model is within "
            f"{worst('reuse', 'error'):.0f}% (in situ) and {worst('reuse', 'profiled_error'):.0f}% (profiled alone); "
            f"the timeline under-predicts TernGrad by {-tern_reuse[1]:.0f}-{-tern_reuse[0]:.0f}% (section 3)")
    # a model meets the target under an allocator when one source of compute keeps every strategy within 20 %
    met_by = [f"the {model} model with {'the default allocator' if kind == 'default' else 'allocator reuse'}"
              for model, keys in (("timeline", ("overlapped_error", "profiled_overlapped_error")),
                                  ("serial", ("error", "profiled_error"))) for kind in ("default", "reuse")
              if any(worst(kind, key) <= 20 for key in keys)]
    perf_met = f"**met by {' and by '.join(met_by)}**; neither alone under both" if met_by else "**not met**"
    fast = {s: ratio_summary.ratios(Path(run("step_time_n2_inf_lenet")["_path"]), s, ["ddp"])[2, "inf", "lenet"]["ddp"]
            for s in ("terngrad", "terngrad+plan")}
    fast_cell = (f"TernGrad {fast['terngrad']:.2f}x of DDP (N = 2, `benchmarks/results/step_time_n2_inf_lenet.json`); "
                 f"the planner kept the all-gather, {fast['terngrad+plan']:.2f}x")
    fast_met = "**met** by the first clause" if fast["terngrad"] <= 1.10 else "**not met**"
    cpu = run("kernels")
    lowest: dict[str, float] = {}
    for row in cpu["rows"]:
        if row["target"] is not None and row["kernel"] in KERNEL_ROWS:
            ratio = row["fused"]["ratio_clone" if row["target_against"] == "clone" else "ratio_memory"]
            lowest[row["kernel"]] = min(lowest.get(row["kernel"], ratio), ratio)
    targets = {row["kernel"]: row["target"] for row in cpu["rows"] if row["kernel"] in lowest}
    shown = {"terngrad": "TernGrad", "graddrop": "Gradient Dropping", "adacomp": "AdaComp"}
    kernels_cell = "the lowest ratio over 1M-64M elements: " + ", ".join(
        f"{shown[k.split()[0]]} {k.split(' ', 1)[1]} {v:.2f}{' (against a clone)' if k == 'terngrad decode' else ''}"
        for k, v in lowest.items()) + " (`docs/kernels.md`)"
    kernels_met = "**met** on CPU" if all(v >= targets[k] for k, v in lowest.items()) else "**not met** on CPU"
    gpu = run("gpu_h100/kernels")
    largest = max(row["size"] for row in gpu["rows"] if row.get("torch"))
    at = {row["kernel"]: row["fused"]["ratio_memory"] for row in gpu["rows"] if row["size"] == largest}
    decode = [at["group decode int8"], at["group decode packed"]]
    compress = [at["group compress int8"], at["group compress packed"]]
    gbps = max(row["fused"]["gbps"] for row in gpu["rows"] if row["size"] == largest
               and row["kernel"] in ("group compress int8", "group compress packed"))
    gpu_cell = (f"one H100: TernGrad's group decode {min(decode):.2f}-{max(decode):.2f} of copy bandwidth, its group "
                f"compress far below ({gbps:.1f} GB/s against {gpu['memory_copy_gbps']:.0f} GB/s) (`docs/measured.md`)")
    gpu_met = "**met** on the GPU" if min(decode + compress) >= 0.3 else "**not met** on the GPU"
    rows = [("1 Gbit/s, N = 4, MLP: TernGrad <= 1/3 of fp32 DDP", *step_row("ddp", 1 / 3, "1/3")),
            ("same: TernGrad <= 1/2 of bf16 DDP", *step_row("ddp_bf16", 1 / 2, "1/2")),
            ("performance model within 20% of measured (same configuration)", perf, perf_met),
            ("fast link (`inf`), LeNet: <= 1.10x fp32 DDP, or the cost model turned compression off", fast_cell,
             fast_met),
            ("kernels: TernGrad compress and decode >= 30% of copy bandwidth, selection >= 20%", kernels_cell,
             kernels_met),
            ("GPU kernel throughput", gpu_cell, gpu_met)]
    return "\n".join(["| target | measured | status |", "|---|---|---|", *(f"| {' | '.join(r)} |" for r in rows)])


TABLES.append(Table("benchmarks-targets", _benchmarks_targets_files, _benchmarks_targets_table,
                    "python tools/results_tables.py --only benchmarks-targets",
                    machine=f"2 cores (AMD EPYC), torch 2.13.0+cpu; the GPU row {GPU_H100}"))
TABLES.append(Table("diloco-targets", lambda: [RESULTS / folder / f"{label}.json"
                                               for folder, labels in DILOCO_TARGET_RUNS.items() for label in labels],
                    _diloco_targets_table, "python tools/results_tables.py --only diloco-targets"))
REPRO_TABLES.append(Table("choosing-cnn", _choosing_cnn_files, _choosing_cnn_table,
                          "python tools/results_tables.py --only choosing-cnn"))
#: the reproductions' tables whose runs are stored under benchmarks/results/reproductions/ (all of them)
STORED_REPRO = ["repro-terngrad-lenet", "repro-graddrop", "repro-graddrop-longer", "repro-graddrop-variants",
                "repro-adacomp", "repro-weightgrad", "choosing-cnn"]
TABLES += [table for table in REPRO_TABLES if table.name in STORED_REPRO]


def _saved_order(folder: Path) -> list[Path]:
    """The runs of a folder in ``benchmarks/lm.py --saved``'s order: the default grid's labels first, then the rest."""
    from benchmarks.lm import default_grid

    stored = sorted(p.stem for p in folder.glob("*.json") if p.stem != "summary")
    first = [label for label in default_grid() if label in stored]
    return [folder / f"{label}.json" for label in first + [s for s in stored if s not in first]]


def _diloco_grid() -> list[str]:
    from benchmarks.diloco import GRID

    return [label for label in GRID if (RESULTS / "diloco" / f"{label}.json").exists()]


def _git_provenance(path: Path) -> dict[str, str] | None:
    """The commit that added ``path`` and its date (through renames, for a file that came by one), or None without
    git history."""
    # ``--follow`` alone would take a new file for a rename of a similar older one (a rerun's table beside the
    # first run's) and date it by the older file: follow renames only for a path that was never added as itself
    for follow in ([], ["--follow"]):
        try:
            out = subprocess.run(["git", "log", *follow, "--diff-filter=A", "--format=%h %cs", "--", str(path)],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        except (OSError, subprocess.CalledProcessError):
            return None
        if len(out) >= 2:
            return {"commit": out[-2], "date": out[-1]}
    return None


def _provenance(paths: list[Path], update: bool) -> list[dict[str, str]]:
    stored: dict[str, dict[str, str]] = json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {}
    found = []
    changed = False
    for path, run in zip(paths, _load(paths)):
        key = path.relative_to(RESULTS).as_posix()
        if "commit" in run and "date" in run:
            found.append({"commit": run["commit"], "date": run["date"]})
            continue
        if key not in stored and update:
            entry = _git_provenance(path)
            if entry:
                stored[key], changed = entry, True
        found.append(stored.get(key, {"commit": "uncommitted", "date": "unknown"}))
    if changed:
        PROVENANCE.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
    return found


def _machine(run: dict[str, Any]) -> str:
    machine = run.get("machine", "")
    if isinstance(machine, dict):
        return f"{machine['cores']} cores ({machine['cpu']}), Linux {machine['kernel']}, torch {machine['torch']}"
    return f"{machine}, torch {run['torch']}" if "torch" in run else str(machine)


def render(table: Table, update: bool = False) -> str:
    """The block's content: a provenance line, then the table."""
    if table.computed:
        return f"*Computed, not measured: {table.computed}. Printed by `{table.command}`.*\n\n{table.render([])}\n\n"
    paths = table.files()
    runs = _load(paths)
    for run, path in zip(runs, paths):
        run["_path"] = str(path)
    marks = _provenance(paths, update)
    dates = sorted({m["date"] for m in marks})
    commits = list(dict.fromkeys(m["commit"] for m in sorted(marks, key=lambda m: m["date"])))
    machines = [table.machine] if table.machine else sorted({_machine(r) for r in runs})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    command = table.produced or (runs[0].get("command", "") if len(runs) == 1 else "")
    produced = f"; produced by `{command}`" if command else ""
    stamp = (f"*Generated from {len(paths)} stored run file{'s' * (len(paths) > 1)} under `benchmarks/results/`: "
             f"machine {'; '.join(machines)}; stored {when}, commit{'s' * (len(commits) > 1)} {', '.join(commits)}"
             f"{produced}. Printed by `{table.command}`.*")
    return f"{stamp}\n\n{table.render(runs)}\n\n"  # a blank line ends the table before the closing marker


def _pages_with_blocks() -> dict[Path, str]:
    return {page: page.read_text() for page in PAGES if BLOCK.search(page.read_text())}


def rewrite(text: str, rendered: dict[str, str]) -> str:
    """``text`` with every known block's content replaced by its rendering."""
    def replace(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in rendered:
            raise SystemExit(f"Expected a table named in tools/results_tables.py but got results:{name}. "
                             f"Fix: use one of {', '.join(rendered)}.")
        return f"{match.group(1)}{rendered[name]}{match.group(4)}"

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="names of the tables to print")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks in the pages")
    mode.add_argument("--check", action="store_true", help="exit 1 where a page's block differs from its data")
    args = parser.parse_args(argv)
    names = [t.name for t in TABLES]
    for name in args.only or []:
        if name not in names:
            parser.error(f"Expected a table name but got --only {name}. Fix: one of {', '.join(names)}.")
    tables = [t for t in TABLES if args.only is None or t.name in args.only]
    if not (args.write or args.check):
        for table in tables:
            print(f"<!-- results:{table.name} -->\n{render(table)}<!-- /results:{table.name} -->\n")
        return 0
    rendered = {t.name: render(t, update=args.write) for t in TABLES}
    drift = 0
    for page, text in _pages_with_blocks().items():
        new = rewrite(text, rendered)
        if new == text:
            continue
        if args.write:
            page.write_text(new)
            print(f"wrote {page.relative_to(ROOT)}")
        else:
            drift += 1
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       str(page.relative_to(ROOT)), "generated"))
    if drift:
        print(f"\n{drift} page(s) differ from the stored results. Fix: python tools/results_tables.py --write")
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
