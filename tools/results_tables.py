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


def _load(paths: list[Path]) -> list[dict[str, Any]]:
    return [_load_one(p) for p in paths]


def _load_one(path: Path) -> dict[str, Any]:
    """A run's JSON, or a stored Markdown table (``# command: ...`` and ``# ...`` notes above it)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    lines = path.read_text().splitlines()
    notes = [line[2:] for line in lines if line.startswith("# ")]
    command = next((n[len("command: "):] for n in notes if n.startswith("command: ")), "")
    return {"command": command, "notes": [n for n in notes if not n.startswith("command: ")],
            "table": "\n".join(line for line in lines if line.startswith("|")), "machine": "not recorded in the file"}


def _stored_table(runs: list[dict[str, Any]]) -> str:
    """A table stored as Markdown by its benchmark, with the run's own notes (rates probed, load) above it."""
    return "\n\n".join("\n".join([*(f"{n}." for n in r["notes"]), "", r["table"]]).strip() for r in runs)


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


def _emulated_runs(grid: str, wan: str) -> Callable[[], list[Path]]:
    """The stored runs of one WAN rate, in ``benchmarks/emulated.py --saved``'s order (its grid's)."""
    def files() -> list[Path]:
        from benchmarks.emulated import GRIDS

        spec = GRIDS[grid]
        return [p for p in (spec.out / wan / f"{label}.json" for label in spec.runs) if p.exists()]

    return files


def _emulated(wan: str, target: float) -> Callable[[list[dict[str, Any]]], str]:
    def render(runs: list[dict[str, Any]]) -> str:
        from benchmarks.emulated import summarize

        return summarize({wan: runs}, target).strip("\n").split("\n", 2)[2]  # the table, without its heading line

    return render


#: the 2000-step grid's compressors whose paper default is within 2 % of DDP: (compressor, setting, named recipe or
#: "", default label, [(run, DDP run at the same seed and warm-up), ...] with seed 0 first)
AT_DEFAULT: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    ("bf16", "the default", "", "bf16", [("bf16", "ddp")]),
    ("fp16", "the default", "", "fp16", [("fp16", "ddp")]),
    ("int8", "the default", "", "int8", [("int8", "ddp"), ("int8_seed1", "ddp_seed1")]),
]


def _best() -> list[tuple[str, str, str, str, list[tuple[str, str]]]]:
    """The best setting per compressor, as :data:`AT_DEFAULT`'s rows: the others from the presets' table
    (``lightning_gradcomp/presets.py``: the preset, or the best setting found where none is within 2 %)."""
    from lightning_gradcomp.presets import PAPER_DEFAULTS, PRESETS

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
        ratios = [by_label[run]["final_val_loss"] / by_label[ddp]["final_val_loss"] - 1 for run, ddp in pairs]
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
    from lightning_gradcomp.presets import PAPER_DEFAULTS, PRESETS

    labels = []
    for entry in PAPER_DEFAULTS.values():
        for measured in (entry.measured, PRESETS[entry.preset].measured if entry.preset else entry.best):
            labels += [label for pair in measured.runs for label in pair]  # type: ignore[union-attr]
    return list(dict.fromkeys(labels))


def _preset_table(runs: list[dict[str, Any]]) -> str:
    """What the paper-default warning says (``lightning_gradcomp/presets.py``): each paper default's gap to AdamW
    DDP, and the preset that closes it or the best setting found, recomputed from the stored runs."""
    from lightning_gradcomp.presets import PAPER_DEFAULTS, PRESETS, measure

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
    from lightning_gradcomp.presets import measure

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


LM_DEFAULTS = ["ddp", "adacomp", "bf16", "demo", "dgc", "fp16", "fp32", "graddrop", "onebit", "powersgd", "qsgd",
               "terngrad", "topk"]
TARGET_RUNS = [f"step_time_target_default_{i}.json" for i in range(1, 9)] + \
    [f"step_time_target_reuse_{i}.json" for i in range(1, 5)]

TABLES = [
    Table("lm-long-best", _lm("lm_long", _best_labels()), _best_table,
          "python tools/results_tables.py --only lm-long-best"),
    Table("lm-long-presets", lambda: [RESULTS / "lm_long" / f"{label}.json" for label in _preset_labels()],
          _preset_table, "python tools/results_tables.py --only lm-long-presets"),
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
    Table("diloco", lambda: [RESULTS / "diloco" / f"{label}.json" for label in _diloco_grid()], _diloco_table,
          "python benchmarks/diloco.py --saved"),
    Table("diloco-sweep", lambda: _saved_order(RESULTS / "diloco_sweep"), _lm_table,
          "python benchmarks/lm.py --saved --out benchmarks/results/diloco_sweep"),
    Table("diloco-emulated-1gbit", _emulated_runs("diloco", "1gbit"),
          _emulated("1gbit", 1.3), "python benchmarks/emulated.py --grid diloco --saved --target 1.3 --wan 1gbit"),
    Table("diloco-emulated-100mbit", _emulated_runs("diloco", "100mbit"),
          _emulated("100mbit", 1.3), "python benchmarks/emulated.py --grid diloco --saved --target 1.3 --wan 100mbit"),
]


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
    """The commit that added ``path`` (renames followed) and its date, or None without git history."""
    try:
        out = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%h %cs", "--", str(path)],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": out[-2], "date": out[-1]} if len(out) >= 2 else None


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
