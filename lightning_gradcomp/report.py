"""``gradcomp report RUN``: the CompressionMonitor's views as PNG plots, from a CSV or TensorBoard log.

For people without W&B. ``RUN`` is a ``CSVLogger`` or ``TensorBoardLogger`` directory (a version directory,
or any directory above one: the most recently written log below it is used) or a ``metrics.csv`` file.
Writes one PNG per per-layer statistic (one line per layer over steps: TernGrad Fig. 4c, AdaComp Fig. 5),
the time split per step, the compression ratio by layer (AdaComp Fig. 7) and, from TensorBoard logs, the
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
from typing import Optional

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


def load_histograms(log: Path) -> dict[str, list[tuple[int, list[float], list[float]]]]:
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


def render(run: Path, out_dir: Optional[Path] = None, layers: Optional[Sequence[str]] = None) -> list[Path]:
    """Write the report's PNGs for ``run`` into ``out_dir`` (default: ``<log dir>/report``); returns their paths.

    Args:
        run: a log directory or metrics file (see :func:`find_log`).
        out_dir: where the PNGs go.
        layers: fnmatch patterns of the layer keys to plot (dots in parameter names are dashes); ``None``: all.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("`gradcomp report` needs matplotlib: pip install 'lightning_gradcomp[report]'") from exc

    log = find_log(Path(run))
    series = load_scalars(log)
    if not series:
        raise ValueError(f"No `gradcomp/...` metrics in {str(log)!r}. Fix: train with the CompressionMonitor callback.")
    out = Path(out_dir) if out_dir is not None else (log.parent if log.is_file() else log) / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    for statistic, label in STATISTICS.items():
        lines = _by_layer(series, statistic, layers)
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for layer, points in lines.items():
            steps, values = zip(*points)
            style = dict(color="black", linestyle="--", linewidth=2) if layer == "total" else dict(marker=".")
            ax.plot(steps, values, label=layer, **style)
        values = [v for points in lines.values() for _, v in points]
        if statistic in _LOG_SCALE and values and min(values) > 0:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{statistic} by layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=max(1, math.ceil(len(lines) / 12)), loc="best")
        written.append(_save(fig, out / f"{statistic}.png", plt))

    times = {p: dict(series.get(f"{PREFIX}time_ms/{p}", [])) for p in _PHASES}
    steps = sorted(set().union(*[t.keys() for t in times.values()]))
    if steps:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.stackplot(steps, *[[times[p].get(s, 0.0) for s in steps] for p in _PHASES], labels=_PHASES, alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("ms per step (summed over buckets)")
        ax.set_title("time split: compression, collective wait, decompression")
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "time_split.png", plt))

    # TernGrad Fig. 2: the four stages of one layer's gradient at the last logged step, side by side
    by_layer: dict[str, dict[str, list]] = defaultdict(dict)
    for tag, events in load_histograms(log).items():
        layer, kind = tag[len(f"{PREFIX}histogram/") :].rsplit("/", 1)
        if layers is None or any(fnmatch.fnmatchcase(layer, p) for p in layers):
            by_layer[layer][kind] = events[-1]
    for layer, kinds in sorted(by_layer.items()):
        order = [k for k in _HISTOGRAM_KINDS if k in kinds]
        fig, axes = plt.subplots(1, len(order), figsize=(3.2 * len(order), 3.2), squeeze=False)
        for ax, kind in zip(axes[0], order):
            step, edges, counts = kinds[kind]
            widths = [b - a for a, b in zip(edges, edges[1:])]
            ax.bar(edges[:-1], counts, width=widths, align="edge", color="tab:blue")
            ax.set_yscale("log")
            ax.set_title(f"{kind} (step {step})", fontsize=9)
            ax.tick_params(labelsize=7)
        fig.suptitle(f"gradient histograms of {layer}", fontsize=10)
        written.append(_save(fig, out / f"histograms_{layer}.png", plt))

    ratios = {k: v for k, v in _by_layer(series, "compression_ratio", layers).items() if k != "total"}
    if ratios:
        names = list(ratios)
        means = [sum(v for _, v in ratios[n]) / len(ratios[n]) for n in names]
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(names) + 1)))
        ax.barh(names, means, color="tab:blue")
        ax.invert_yaxis()  # first key at the top
        ax.set_xlabel("mean compression ratio over the run")
        ax.set_title("compression ratio by layer")
        ax.grid(axis="x", alpha=0.3)
        written.append(_save(fig, out / "compression_by_layer.png", plt))
    return written


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
