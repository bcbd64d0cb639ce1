"""``gradcomp report RUN``: the CompressionMonitor's views as PNG plots, from a CSV or TensorBoard log.

For people without W&B. ``RUN`` is a ``CSVLogger`` or ``TensorBoardLogger`` directory (a version directory,
or any directory above one: the most recently written log below it is used) or a ``metrics.csv`` file.
Writes one PNG per per-layer statistic over steps (TernGrad Fig. 4c, AdaComp Fig. 5): up to ``MAX_LINES`` lines,
one per layer, layers with identical values sharing one line labelled ``a = b``; with more, the layers' spread (median,
middle half, range), the ``MAX_NAMED`` layers furthest from the median, and a heat map of every layer over steps,
grouped by kind beyond ``MAX_ROWS`` layers. Legends sit beside the plot, and y-axes start at 0 (shares span 0 to 1,
log axes at least a decade), so noise is not magnified; density is left out, it mirrors sparsity. Also the time split
per step (a warm-up step far above the rest is left out, a later stall drawn off the scale; both named on the plot),
the compression ratio by layer (AdaComp Fig. 7; by kind beyond ``MAX_ROWS`` layers) and, from TensorBoard logs, the
histograms of each layer's original, clipped, compressed and averaged gradient (TernGrad Fig. 2). Needs the
``report`` extra (matplotlib; tensorboard to read TensorBoard logs)::

    pip install "lightning_gradcomp[report]"
    gradcomp report lightning_logs/version_0 --out report/
"""

import argparse
import csv
import fnmatch
import math
import re
import textwrap
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


def natural_key(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders ``blocks-2-...`` before ``blocks-10-...`` (numbers compared as numbers)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part)


def layer_kind(name: str) -> str:
    """The layer key with its first all-digit component as ``*``: ``blocks-3-mlp-0-bias`` -> ``blocks-*-mlp-0-bias``.

    The first index is the repeated block (a transformer block, a ``Sequential`` position), so the layers of one
    kind are the same parameter in every block.
    """
    parts = name.split("-")
    for i, part in enumerate(parts):
        if part.isdigit():
            return "-".join([*parts[:i], "*", *parts[i + 1 :]])
    return name


def _by_layer(series: Series, statistic: str, layers: Optional[Sequence[str]]) -> dict[str, list[tuple[int, float]]]:
    head = f"{PREFIX}{statistic}/"
    out = {}
    for key, points in sorted(series.items(), key=lambda item: natural_key(item[0])):
        if key.startswith(head):
            layer = key[len(head) :]
            if layer == "total" or layers is None or any(fnmatch.fnmatchcase(layer, p) for p in layers):
                out[layer] = points
    return out


#: a plot over steps draws at most this many lines of layers (distinct series); with more it draws their spread,
#: the ``MAX_NAMED`` layers furthest from the median, and a heat map of every layer over steps
MAX_LINES = 8
MAX_NAMED = 3
#: at most this many labelled rows in a heat map or bar chart; with more layers the rows are grouped by kind
#: (:func:`layer_kind`), so each label stays legible
MAX_ROWS = 40
#: shares of a tensor's elements: drawn on their whole range, 0 to 1
_SHARES = {"sparsity", "density", "clipped_fraction"}
_LABEL_NAMES = 4
_LABEL_KINDS = 3
_LABEL_WIDTH = 40  # characters per legend line; longer labels wrap between words
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
    """Series with exactly the same points, drawn once under a label naming all of them (``"a = b"``).

    Many layers are named by kind (:func:`group_label`); the one line shared by many layers of many kinds (every
    TernGrad weight at 16) is named by what it is not: ``"the other 294 layers"``.
    """
    groups: dict[tuple[tuple[int, float], ...], list[str]] = {}
    for layer, points in lines.items():
        groups.setdefault(tuple(points), []).append(layer)
    wide = [
        layers for layers in groups.values()
        if len(layers) > _LABEL_NAMES and len(set(map(layer_kind, layers))) > _LABEL_KINDS
    ]
    out = {}
    for shared, layers in groups.items():
        if len(wide) == 1 and layers is wide[0]:
            label = f"all {len(layers)} layers" if len(groups) == 1 else f"the other {len(layers)} layers"
        else:
            label = group_label(layers)
        out[label] = list(shared)
    return out


def group_label(layers: Sequence[str]) -> str:
    """A legend label for layers drawn as one line: ``"a = b"``, or by kind with counts when there are more.

    ``["net-0-weight", "net-2-weight", "net-4-weight", "net-0-bias", "net-2-bias"]`` ->
    ``"5 layers: net-*-weight (3), net-*-bias (2)"``; at most ``_LABEL_KINDS`` kinds are listed, so a label stays
    a few lines long however many layers share the line.
    """
    if len(layers) <= _LABEL_NAMES:
        return " = ".join(layers)
    kinds: dict[str, int] = {}
    for layer in layers:
        kinds[layer_kind(layer)] = kinds.get(layer_kind(layer), 0) + 1
    listed = [f"{kind} ({n})" if n > 1 else kind for kind, n in list(kinds.items())[:_LABEL_KINDS]]
    more = len(kinds) - _LABEL_KINDS
    return f"{len(layers)} layers: " + ", ".join(listed) + (f" and {more} more kinds" if more > 0 else "")


def value_range(statistic: str, values: Sequence[float]) -> tuple[float, float, bool]:
    """``(low, high, log)``: the y-axis (or colour scale) of ``statistic`` for ``values``.

    The range never magnifies noise: shares span 0 to 1, other linear statistics include 0 (so a ratio constant at
    16 with a total at 15.96 draws as two touching lines, not as a gap), and a log axis spans at least one decade.
    Log when the statistic spreads over orders of magnitude (``_LOG_SCALE``) and every value is positive.
    """
    finite = [v for v in values if math.isfinite(v)] or [0.0]
    low, high = min(finite), max(finite)
    if statistic in _LOG_SCALE and low > 0:
        centre = math.sqrt(low * high)
        low, high = min(low, centre / math.sqrt(10)), max(high, centre * math.sqrt(10))
        margin = (high / low) ** 0.05
        return low / margin, high * margin, True
    if statistic in _SHARES and 0 <= low and high <= 1:
        return 0.0, 1.0, False
    low, high = min(low, 0.0), max(high, 0.0)
    if high == low:
        high = low + 1.0
    margin = 0.05 * (high - low)
    return (low - margin if low < 0 else 0.0), (high + margin if high > 0 else 0.0), False


def _legend(ax: Any) -> None:
    """The legend right of the plot, so it covers no data, with long labels wrapped rather than cut."""
    handles, labels = ax.get_legend_handles_labels()
    # layer keys stay whole on their lines: a break at a dash would read as two names
    wrapped = [textwrap.fill(label, _LABEL_WIDTH, break_on_hyphens=False, break_long_words=False) for label in labels]
    ax.legend(handles, wrapped, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7)


def _heat_height(labels: int) -> float:
    """Inches of a heat map with ``labels`` row labels: room for each label, within a page."""
    return min(7.0, max(2.5, 0.16 * labels + 0.8))


def _row_layout(names: Sequence[str]) -> tuple[list[str], list[float], list[tuple[float, str]], list[float]]:
    """Heat map rows: ``(layers in row order, row edges, (y, label) ticks, y of the separators between kinds)``.

    Up to ``MAX_ROWS`` layers: key order (:func:`natural_key`), one row and label per layer. More: grouped by kind
    (each kind's layers together, in block order), one label per kind at the middle of its rows, and a kind of few
    layers (the embedding, the head) drawn taller so its label has room and no label covers another. With more kinds
    than ``MAX_ROWS``: key order and every n-th layer labelled.
    """
    if len(names) <= MAX_ROWS:
        return list(names), [float(i) for i in range(len(names) + 1)], [(i + 0.5, n) for i, n in enumerate(names)], []
    kinds: dict[str, list[str]] = defaultdict(list)
    for name in names:
        kinds[layer_kind(name)].append(name)
    if len(kinds) > MAX_ROWS:
        every = math.ceil(len(names) / MAX_ROWS)
        edges = [float(i) for i in range(len(names) + 1)]
        return list(names), edges, [(i + 0.5, names[i]) for i in range(0, len(names), every)], []
    # the smallest block height (in rows) that gives every kind's label 0.12 inch of the heat map's height
    min_share = 0.12 / (_heat_height(len(kinds)) - 0.8)
    rows = 1
    while rows / sum(max(len(m), rows) for m in kinds.values()) < min_share:
        rows += 1
    order: list[str] = []
    edges = [0.0]
    ticks: list[tuple[float, str]] = []
    separators: list[float] = []
    for kind, members in kinds.items():
        top = edges[-1]
        if order:
            separators.append(top)
        height = max(len(members), rows) / len(members)
        edges.extend(top + height * (i + 1) for i in range(len(members)))
        ticks.append(((top + edges[-1]) / 2, f"{kind} ({len(members)})" if len(members) > 1 else kind))
        order.extend(members)
    return order, edges, ticks, separators


def _draw_spread(ax: Any, lines: dict[str, list[tuple[int, float]]], log: bool) -> None:
    """Median, middle half and range of the layers at each step, and the ``MAX_NAMED`` layers furthest off."""
    import numpy as np

    steps = sorted({step for points in lines.values() for step, _ in points})
    column = {step: i for i, step in enumerate(steps)}
    grid = np.full((len(lines), len(steps)), np.nan)
    for row, points in enumerate(lines.values()):
        for step, value in points:
            grid[row, column[step]] = value
    low, q1, median, q3, high = np.nanpercentile(grid, [0, 25, 50, 75, 100], axis=0)
    ax.fill_between(steps, low, high, color="tab:blue", alpha=0.15, linewidth=0,
                    label=f"all {len(lines)} layers (range)")
    ax.fill_between(steps, q1, q3, color="tab:blue", alpha=0.35, linewidth=0, label="middle half of the layers")
    ax.plot(steps, median, color="tab:blue", linewidth=1.8, label="median layer")
    scale = np.log10 if log else (lambda a: a)
    with np.errstate(invalid="ignore", divide="ignore"):
        distance = np.nanmean(np.abs(scale(grid) - scale(median)), axis=1)
    furthest = [i for i in np.argsort(-np.nan_to_num(distance, nan=-1.0)) if distance[i] > 0][:MAX_NAMED]
    names = list(lines)
    for n, i in enumerate(furthest):
        xs, ys = zip(*lines[names[i]])
        ax.plot(xs, ys, label=names[i], color=f"C{n + 1}", marker=_MARKERS[n], markersize=3,
                linestyle=_LINESTYLES[n], linewidth=1.0)
    ax.set_title(f"spread over the {len(lines)} layers; the {len(furthest)} furthest from the median named",
                 fontsize=8)


def _draw_heat_map(fig: Any, ax: Any, lines: dict[str, list[tuple[int, float]]], value_axis: tuple[float, float, bool],
                   label: str) -> None:
    """Every layer (rows) over steps (columns), coloured by value on the statistic's range."""
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    order, row_edges, ticks, separators = _row_layout(list(lines))
    steps = sorted({step for points in lines.values() for step, _ in points})
    column = {step: i for i, step in enumerate(steps)}
    grid = np.full((len(order), len(steps)), np.nan)
    for row, name in enumerate(order):
        for step, value in lines[name]:
            grid[row, column[step]] = value
    # column edges halfway between logged steps, so each cell is centred on its step
    middle = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5
    edges = [steps[0] - half, *middle, steps[-1] + (steps[-1] - middle[-1] if middle else half)]
    low, high, log = value_axis
    norm = LogNorm(low, high) if log else Normalize(low, high)
    mesh = ax.pcolormesh(edges, row_edges, np.ma.masked_invalid(grid), norm=norm, cmap="viridis")
    for y in separators:
        ax.axhline(y, color="white", linewidth=0.8)
    ax.set_ylim(row_edges[-1], 0)  # first layer at the top
    ax.set_yticks([y for y, _ in ticks], [text for _, text in ticks], fontsize=7 if len(ticks) <= 24 else 6)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("step")
    ax.set_ylabel("layer (kind, layers)" if separators else "layer")
    ax.set_title("every layer over steps" + (", grouped by kind" if separators else ""), fontsize=8)
    # beside the heat map, not in the column's right margin, which the legend of the plot above sets
    fig.colorbar(mesh, cax=ax.inset_axes((1.015, 0.0, 0.02, 1.0)), label=textwrap.fill(label, 30))


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
        total = lines.pop("total", None)
        value_axis = value_range(statistic, [v for points in [*lines.values(), total or []] for _, v in points])
        merged = merge_identical(lines)
        if len(merged) <= MAX_LINES:
            fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
            for i, (name, points) in enumerate(merged.items()):
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=name, marker=_MARKERS[i % len(_MARKERS)], markersize=4 + (i % 3),
                        linestyle=_LINESTYLES[i % len(_LINESTYLES)], linewidth=1.2, alpha=0.85)
            ax.set_xlabel("step")
        else:
            heat_height = _heat_height(len(_row_layout(list(lines))[2]))
            fig, (ax, heat) = plt.subplots(2, 1, sharex=True, layout="constrained", figsize=(10, 3.4 + heat_height),
                                           height_ratios=[3.4, heat_height])
            _draw_spread(ax, lines, value_axis[2])
            _draw_heat_map(fig, heat, lines, value_axis, axis_label)
        if total is not None:
            xs, ys = zip(*total)
            ax.plot(xs, ys, label="total", color="black", linestyle="--", linewidth=2)
        if value_axis[2]:
            ax.set_yscale("log")
        ax.set_ylim(value_axis[0], value_axis[1])
        ax.set_ylabel(textwrap.fill(axis_label, 30))
        ax.grid(alpha=0.3)
        _legend(ax)
        fig.suptitle(f"{statistic} by layer\n{label}", fontsize=10)
        out[statistic] = fig

    times = {p: dict(series.get(f"{PREFIX}time_ms/{p}", [])) for p in _PHASES}
    steps = sorted(set().union(*[t.keys() for t in times.values()]))
    if steps:
        stacks = [[times[p].get(s, 0.0) for s in steps] for p in _PHASES]
        totals = [sum(column) for column in zip(*stacks)]
        warm, off_scale = far_off(totals)
        fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
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
        _legend(ax)
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
        bars = _ratio_bars({name: sum(v for _, v in points) / len(points) for name, points in ratios.items()})
        fig, ax = plt.subplots(figsize=(10, max(2.5, 0.22 * len(bars) + 1.4)), layout="constrained")
        names = [bar[0] for bar in bars]
        means = [bar[1] for bar in bars]
        spread = [[mean - low for _, mean, low, _ in bars], [high - mean for _, mean, _, high in bars]]
        ax.barh(names, means, color="tab:blue", xerr=spread if any(map(any, spread)) else None,
                error_kw=dict(ecolor="0.3", capsize=2, linewidth=0.8))
        for y, (_, mean, low, high) in enumerate(bars):  # equal bars are told apart by their values
            text = f" {mean:.3g}" if low == high else f" {mean:.3g} ({low:.3g}\u2013{high:.3g})"
            ax.text(high, y, text, va="center", fontsize=7)
        ax.set_xlim(0, max(high for *_, high in bars) * 1.25)
        ax.invert_yaxis()  # first key at the top
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("mean compression ratio over the run" + (" (bars: kind's mean, whiskers: its layers' range)"
                                                                if len(bars) < len(ratios) else ""))
        ax.set_ylabel("layer (kind, layers)" if len(bars) < len(ratios) else "layer")
        ax.grid(axis="x", alpha=0.3)
        fig.suptitle(f"compression ratio by layer\n{label}", fontsize=10)
        out["compression_by_layer"] = fig
    return out


def _ratio_bars(means: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """Bars of the compression ratio by layer: ``(label, mean, lowest, highest)``, at most ``MAX_ROWS`` of them.

    Up to ``MAX_ROWS`` layers: one bar each. More: one bar per kind (:func:`layer_kind`), the mean of its layers with
    their range; with more kinds than ``MAX_ROWS``, the least compressed kinds and one bar for all the others.
    """
    if len(means) <= MAX_ROWS:
        return [(name, mean, mean, mean) for name, mean in means.items()]
    kinds: dict[str, list[float]] = defaultdict(list)
    for name, mean in means.items():
        kinds[layer_kind(name)].append(mean)
    bars = [
        (f"{kind} ({len(v)})" if len(v) > 1 else kind, sum(v) / len(v), min(v), max(v)) for kind, v in kinds.items()
    ]
    if len(bars) <= MAX_ROWS:
        return bars
    kept = sorted(kinds, key=lambda kind: sum(kinds[kind]) / len(kinds[kind]))[: MAX_ROWS - 1]
    rest = [mean for kind, values in kinds.items() if kind not in kept for mean in values]
    return [bar for kind, bar in zip(kinds, bars) if kind in kept] + [
        (f"the other {len(rest)} layers", sum(rest) / len(rest), min(rest), max(rest))
    ]


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
    if fig.get_layout_engine() is None:  # type: ignore[attr-defined]  # constrained figures are laid out already
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
