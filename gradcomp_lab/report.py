"""``gradcomp report RUN``: the CompressionMonitor's views as PNG plots, from a CSV or TensorBoard log.

For people without W&B. ``RUN`` is a ``CSVLogger`` or ``TensorBoardLogger`` directory (a version directory,
or any directory above one: the most recently written log below it is used) or a ``metrics.csv`` file.
Writes one PNG per per-layer statistic (one line per layer over steps: TernGrad Fig. 4c, AdaComp Fig. 5;
layers with identical values share one line labelled ``a = b``; density is left out, it mirrors sparsity),
the time split per step (a warm-up step far above the rest is left out, a later stall drawn off the scale; both
named on the plot), the compression ratio by layer (AdaComp Fig. 7) and, from TensorBoard logs, the
histograms of each layer's original, clipped, compressed and averaged gradient (TernGrad Fig. 2). Needs the ``report`` extra
(matplotlib; tensorboard to read TensorBoard logs)::

    pip install "lightning_gradcomp[report]"
    gradcomp report lightning_logs/version_0 --out report/
"""

import argparse
import csv
import fnmatch
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

PREFIX = "gradcomp/"
#: per-layer statistics, in the order the report shows them, with their axis labels
STATISTICS = {
    "compression_ratio": "compression ratio (fp32 bits / bits sent)",
    "bits_per_element": "bits per element sent",
    "bytes": "bytes sent per step",
    "sparsity": "sparsity (share of zeros sent)",
    "density": "density (share of non-zeros sent)",
    "scaler": "scaler",
    "clipped_fraction": "share of elements clipped",
    "residual_norm": "residual L2 norm",
    "residual_max": "residual max |r|",
    "residual_p95": "residual 95th percentile |r|",
}
# spread over orders of magnitude: plotted on a log axis when every value is positive
_LOG_SCALE = {"scaler", "residual_norm", "residual_max", "residual_p95", "bytes"}
_PHASES = ("compress", "collective_wait", "decompress")
_HISTOGRAM_KINDS = ("original", "clipped", "compressed", "averaged")

Series = dict[str, list[tuple[int, float]]]
Histogram = tuple[int, list[float], list[float]]  # (step, bucket edges, bucket counts)


def find_log(run: Path) -> Path:
    """The metrics file or TensorBoard directory to read for ``run`` (see the module docstring)."""
    run = Path(run)
    if run.is_file():
        return run
    if not run.is_dir():
        raise ValueError(f"Expected `RUN` to be a log directory or a metrics.csv file, but {str(run)!r} does not exist.")
    candidates = list(run.rglob("metrics.csv")) + [p for p in run.rglob("events.out.tfevents.*")]
    if not candidates:
        raise ValueError(
            f"Expected a CSVLogger (metrics.csv) or TensorBoardLogger (events.out.tfevents.*) log under {str(run)!r}, "
            f"but found none. Fix: pass the logger's `log_dir`."
        )
    newest = max(candidates, key=lambda p: p.stat().st_mtime)
    return newest if newest.name == "metrics.csv" else newest.parent


def load_scalars(log: Path) -> Series:
    """Every ``gradcomp/...`` scalar of a log as ``{key: [(step, value), ...]}``, sorted by step."""
    series: Series = defaultdict(list)
    if log.is_file():
        with open(log, newline="") as f:
            for row in csv.DictReader(f):
                step = int(float(row.get("step") or 0))
                for key, value in row.items():
                    if key.startswith(PREFIX) and value not in ("", None):
                        series[key].append((step, float(value)))
    else:
        try:
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        except ImportError as exc:
            raise ImportError("Reading TensorBoard logs needs tensorboard: pip install 'lightning_gradcomp[report]'") from exc
        accumulator = EventAccumulator(str(log), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tag.startswith(PREFIX):
                series[tag] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    return {k: sorted(v) for k, v in series.items()}


def load_histograms(log: Path) -> dict[str, list[Histogram]]:
    """``gradcomp/histogram/...`` histograms of a TensorBoard log: ``{tag: [(step, edges, counts), ...]}``.

    CSV logs hold no histograms: an empty dict.
    """
    if log.is_file():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log), size_guidance={"histograms": 0})
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags().get("histograms", []):
        if tag.startswith(f"{PREFIX}histogram/"):
            out[tag] = [
                (e.step, [e.histogram_value.min, *e.histogram_value.bucket_limit], list(e.histogram_value.bucket))
                for e in accumulator.Histograms(tag)
            ]
    return out


def _by_layer(series: Series, statistic: str, layers: Optional[Sequence[str]]) -> dict[str, list[tuple[int, float]]]:
    head = f"{PREFIX}{statistic}/"
    out = {}
    for key, points in sorted(series.items()):
        if key.startswith(head):
            layer = key[len(head) :]
            if layer == "total" or layers is None or any(fnmatch.fnmatchcase(layer, p) for p in layers):
                out[layer] = points
    return out


#: markers and line styles cycled over layers, so lines that overlap stay distinguishable in print and colour
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
_LINESTYLES = ("-", "--", "-.", ":")
#: a step whose time exceeds this multiple of the run's median is far off: at the start it is the warm-up (bucket
#: rebuild, first-use kernel compilation, the planner's measurement) and left out; later (a stall of a shared
#: machine) it stays drawn but off the scale. Both are named on the plot, so the scale follows the typical step.
OUTLIER_FACTOR = 5.0


def run_label(log: Path) -> str:
    """``"run <dir> · <compressor>"`` for plot titles: the log's version directory and the logged compressor.

    The compressor comes from the ``hparams.yaml`` the loggers write beside the metrics (the monitor's ``gradcomp``
    config entry).
    """
    run_dir = log.parent if log.is_file() else log
    name = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name else run_dir.name
    compressor = "compressor not logged"
    hparams = run_dir / "hparams.yaml"
    if hparams.is_file():
        import yaml

        config = (yaml.safe_load(hparams.read_text()) or {}).get(PREFIX.rstrip("/"), {})
        if isinstance(config, dict) and config.get("compressor"):
            compressor = str(config["compressor"])
    return f"run {name} \u00b7 {compressor}"


def merge_identical(lines: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Series with exactly the same points, drawn once under a label naming all of them (``"a = b"``)."""
    groups: dict[tuple[tuple[int, float], ...], list[str]] = {}
    for layer, points in lines.items():
        groups.setdefault(tuple(points), []).append(layer)
    return {" = ".join(layers): list(points) for points, layers in groups.items()}


def far_off(totals: Sequence[float]) -> tuple[int, list[int]]:
    """Time-split outliers: how many leading points are warm-up, and the indices of later points off the scale.

    A point is far off when above ``OUTLIER_FACTOR`` times the median of all points (none with fewer than 3 points).
    """
    if len(totals) < 3:
        return 0, []
    limit = OUTLIER_FACTOR * sorted(totals)[len(totals) // 2]
    warm = 0
    while warm < len(totals) - 1 and totals[warm] > limit:
        warm += 1
    return warm, [i for i in range(warm, len(totals)) if totals[i] > limit]


def figures(run: Path, layers: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The report's matplotlib figures for ``run`` by file stem (``"sparsity"``, ``"time_split"``, ...).

    Args:
        run: a log directory or metrics file (see :func:`find_log`).
        layers: fnmatch patterns of the layer keys to plot (dots in parameter names are dashes); ``None``: all.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    log = find_log(Path(run))
    series = load_scalars(log)
    if not series:
        raise ValueError(f"No `gradcomp/...` metrics in {str(log)!r}. Fix: train with the CompressionMonitor callback.")
    label = run_label(log)
    out: dict[str, Any] = {}

    for statistic, axis_label in STATISTICS.items():
        lines = _by_layer(series, statistic, layers)
        if not lines or (statistic == "density" and _by_layer(series, "sparsity", layers)):
            continue  # density is 1 - sparsity: the same signal mirrored, drawn once
        fig, ax = plt.subplots(figsize=(8, 4.5))
        total = lines.pop("total", None)
        for i, (name, points) in enumerate(merge_identical(lines).items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=name, marker=_MARKERS[i % len(_MARKERS)], markersize=4 + (i % 3),
                    linestyle=_LINESTYLES[i % len(_LINESTYLES)], linewidth=1.2, alpha=0.85)
        if total is not None:
            xs, ys = zip(*total)
            ax.plot(xs, ys, label="total", color="black", linestyle="--", linewidth=2)
            lines["total"] = total
        values = [v for points in lines.values() for _, v in points]
        if statistic in _LOG_SCALE and values and min(values) > 0:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(axis_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=max(1, math.ceil(len(lines) / 12)), loc="best")
        fig.suptitle(f"{statistic} by layer\n{label}", fontsize=10)
        out[statistic] = fig

    times = {p: dict(series.get(f"{PREFIX}time_ms/{p}", [])) for p in _PHASES}
    steps = sorted(set().union(*[t.keys() for t in times.values()]))
    if steps:
        stacks = [[times[p].get(s, 0.0) for s in steps] for p in _PHASES]
        totals = [sum(column) for column in zip(*stacks)]
        warm, off_scale = far_off(totals)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.stackplot(steps[warm:], *[stack[warm:] for stack in stacks], labels=_PHASES, alpha=0.8)
        notes = []
        if warm:
            notes.append("left out (warm-up): " + ", ".join(f"step {steps[i]}: {totals[i]:,.0f} ms" for i in range(warm)))
        if off_scale:
            notes.append("off scale: " + ", ".join(f"step {steps[i]}: {totals[i]:,.0f} ms" for i in off_scale))
        if notes:
            ax.text(0.99, 0.97, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=8,
                    bbox=dict(facecolor="white", edgecolor="0.6", alpha=0.9))
        typical = [t for i, t in enumerate(totals) if i >= warm and i not in off_scale]
        ax.set_ylim(0, max(typical) * 1.15)
        ax.set_xlabel("step")
        ax.set_ylabel("ms per step (summed over buckets)")
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
        fig.suptitle(f"time split: compression, collective wait, decompression\n{label}", fontsize=10)
        out["time_split"] = fig

    # TernGrad Fig. 2: the four stages of one layer's gradient at the last logged step, side by side
    by_layer: dict[str, dict[str, Histogram]] = defaultdict(dict)
    for tag, events in load_histograms(log).items():
        layer, kind = tag[len(f"{PREFIX}histogram/") :].rsplit("/", 1)
        if layers is None or any(fnmatch.fnmatchcase(layer, p) for p in layers):
            by_layer[layer][kind] = events[-1]
    for layer, kinds in sorted(by_layer.items()):
        order = [k for k in _HISTOGRAM_KINDS if k in kinds]
        fig, axes = plt.subplots(1, len(order), figsize=(3.2 * len(order), 3.6), squeeze=False)
        for ax, kind in zip(axes[0], order):
            step, edges, counts = kinds[kind]
            widths = [b - a for a, b in zip(edges, edges[1:])]
            ax.bar(edges[:-1], counts, width=widths, align="edge", color="tab:blue")
            ax.set_yscale("log")
            ax.set_title(f"{kind} (step {step})", fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=4))  # small gradients: long tick labels must not collide
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
            ax.set_xlabel("gradient value", fontsize=8)
            ax.set_ylabel("elements (log scale)", fontsize=8)
            ax.tick_params(labelsize=7)
        fig.suptitle(f"gradient histograms of {layer}\n{label}", fontsize=10)
        out[f"histograms_{layer}"] = fig

    ratios = {k: v for k, v in _by_layer(series, "compression_ratio", layers).items() if k != "total"}
    if ratios:
        names = list(ratios)
        means = [sum(v for _, v in ratios[n]) / len(ratios[n]) for n in names]
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(names) + 1.4)))
        ax.barh(names, means, color="tab:blue")
        for y, mean in enumerate(means):  # equal bars are told apart by their values
            ax.text(mean, y, f" {mean:.3g}", va="center", fontsize=8)
        ax.invert_yaxis()  # first key at the top
        ax.set_xlabel("mean compression ratio over the run")
        ax.set_ylabel("layer")
        ax.grid(axis="x", alpha=0.3)
        fig.suptitle(f"compression ratio by layer\n{label}", fontsize=10)
        out["compression_by_layer"] = fig
    return out


def render(run: Path, out_dir: Optional[Path] = None, layers: Optional[Sequence[str]] = None) -> list[Path]:
    """Write the report's PNGs for ``run`` into ``out_dir`` (default: ``<log dir>/report``); returns their paths.

    Args:
        run: a log directory or metrics file (see :func:`find_log`).
        out_dir: where the PNGs go.
        layers: fnmatch patterns of the layer keys to plot (dots in parameter names are dashes); ``None``: all.
    """
    plt = _pyplot()
    made = figures(run, layers)
    log = find_log(Path(run))
    out = Path(out_dir) if out_dir is not None else (log.parent if log.is_file() else log) / "report"
    out.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out / f"{stem}.png", plt) for stem, fig in made.items()]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("`gradcomp report` needs matplotlib: pip install 'lightning_gradcomp[report]'") from exc
    return plt


def _save(fig: object, path: Path, plt: object) -> Path:
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[attr-defined]
    return path


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``gradcomp report RUN [--out DIR] [--layers PATTERN ...]`` (the arguments after ``report``)."""
    parser = argparse.ArgumentParser(prog="gradcomp report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="CSVLogger/TensorBoardLogger log directory, or a metrics.csv file")
    parser.add_argument("--out", type=Path, default=None, help="directory for the PNGs (default: <log dir>/report)")
    parser.add_argument("--layers", nargs="+", default=None, help="fnmatch patterns of layer keys to plot")
    args = parser.parse_args(argv)
    try:
        # a wrong path is the user's first mistake: name it before anything asks for matplotlib
        find_log(args.run)
        paths = render(args.run, args.out, args.layers)
    except (ValueError, ImportError) as exc:
        parser.exit(2, f"gradcomp report: error: {exc}\n")
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
