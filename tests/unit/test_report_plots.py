"""``gradcomp report`` figures: warm-up left out of the time scale, overlapping layers told apart, labels, titles;
readable at 3, 31 and 295 layers (bounded legends outside the plot, rows grouped by kind, axes that do not magnify
noise)."""

import csv
import math
import random
from pathlib import Path
from typing import Any

import pytest

from gradcomp_lab import report

pytest.importorskip("matplotlib")

_LAYERS = ("net-0-weight", "net-0-bias", "net-2-weight")


@pytest.fixture(autouse=True)
def _close_figures():  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())  # the module's laid-out figures stay open for the tests after this one
    yield
    for number in set(plt.get_fignums()) - before:
        plt.close(number)


def _write_run(root: Path, warmup_ms: float = 2900.0, stall_ms: float = 0.0) -> Path:
    """A CSVLogger-shaped run: two layers with identical compression ratios, a slow first logged step."""
    run = root / "terngrad" / "version_0"
    run.mkdir(parents=True)
    (run / "hparams.yaml").write_text("gradcomp:\n  compressor: TernGrad\n  clip_factor: 2.5\n  world_size: 2\n")
    rows = []
    for step in range(0, 50, 5):
        row: dict[str, float] = {"step": step}
        for i, layer in enumerate(_LAYERS):
            row[f"gradcomp/compression_ratio/{layer}"] = 16.0 if layer != "net-0-bias" else 13.3
            row[f"gradcomp/sparsity/{layer}"] = 0.7 + 0.01 * i + 0.001 * step
            row[f"gradcomp/density/{layer}"] = 1 - row[f"gradcomp/sparsity/{layer}"]
        row["gradcomp/compression_ratio/net-2-weight"] = 16.0  # identical to net-0-weight
        row["gradcomp/compression_ratio/total"] = 15.0
        row["gradcomp/time_ms/compress"] = warmup_ms if step == 0 else 10.0 + step % 3
        if step == 25 and stall_ms:
            row["gradcomp/time_ms/compress"] = stall_ms
        row["gradcomp/time_ms/collective_wait"] = 5.0
        row["gradcomp/time_ms/decompress"] = 1.0
        rows.append(row)
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return run


_BLOCK = ("ln1-weight", "ln1-bias", "ln2-weight", "ln2-bias", "attn-qkv-weight", "attn-qkv-bias", "attn-proj-weight",
          "attn-proj-bias", "mlp-0-weight", "mlp-0-bias", "mlp-2-weight", "mlp-2-bias")
RUNAWAY = "blocks-1-mlp-2-weight"


def write_model_run(root: Path, depth: int, seed: int = 0) -> Path:
    """A TernGrad CSVLogger run of a GPT-like model: ``12 * depth + 7`` layers (31 at depth 2, 295 at depth 24).

    Every weight's compression ratio is 16 and the total 15.96 (the scalers), as TernGrad logs them; the 50-element
    head bias packs to 15.4. Sparsities scatter between 0.6 and 0.95, scalers over two decades with a common trend;
    the scaler of ``RUNAWAY`` grows 100-fold over the run. Also ``python -c`` material for looking at the plots::

        python -c "from tests.unit.test_report_plots import write_model_run as w; from gradcomp_lab import report; \\
            from pathlib import Path; print(report.render(w(Path('/tmp/r31'), 2), Path('/tmp/r31/png')))"
    """
    rng = random.Random(seed)
    names = ["token_embedding-weight", "position_embedding-weight", "segment_embedding-weight"]
    names += [f"blocks-{b}-{p}" for b in range(depth) for p in _BLOCK]
    names += ["ln_f-weight", "ln_f-bias", "head-weight", "head-bias"]
    run = root / "terngrad" / "version_0"
    run.mkdir(parents=True, exist_ok=True)  # rerun into the same folder: files rewritten
    (run / "hparams.yaml").write_text("gradcomp:\n  compressor: TernGrad\n  world_size: 2\n")
    base = {n: (rng.uniform(0.6, 0.95), 10 ** rng.uniform(-2.5, -1.0)) for n in names}
    rows = []
    for step in range(0, 300, 5):
        trend = math.exp(-step / 400) * (1 + 0.3 * math.sin(step / 25))
        row: dict[str, Any] = {"step": step}
        for n in names:
            sparsity, scaler = base[n]
            row[f"gradcomp/compression_ratio/{n}"] = 15.38 if n == "head-bias" else 16.0
            row[f"gradcomp/sparsity/{n}"] = min(1.0, max(0.0, sparsity + rng.gauss(0, 0.02)))
            row[f"gradcomp/density/{n}"] = 1 - row[f"gradcomp/sparsity/{n}"]
            growth = 100 ** (step / 295) if n == RUNAWAY else 1.0
            row[f"gradcomp/scaler/{n}"] = scaler * trend * growth * math.exp(rng.gauss(0, 0.15))
            row[f"gradcomp/bytes/{n}"] = 4096.0 if n.endswith("weight") else 32.0
        row["gradcomp/compression_ratio/total"] = 15.96
        row["gradcomp/bytes/total"] = sum(row[f"gradcomp/bytes/{n}"] for n in names)
        row["gradcomp/time_ms/compress"] = 2900.0 if step == 0 else 10.0 + rng.random()
        row["gradcomp/time_ms/collective_wait"] = 5.0 + rng.random()
        row["gradcomp/time_ms/decompress"] = 1.0
        rows.append(row)
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return run


def test_warmup_step_is_left_out_of_the_time_scale_and_named(tmp_path: Path) -> None:
    figures = report.figures(_write_run(tmp_path))
    ax = figures["time_split"].axes[0]
    low, high = ax.get_ylim()
    assert high < 50, f"the 2.9 s warm-up sets the scale: {high}"
    assert high >= 18.0  # the slowest later step (12 + 5 + 1 ms) stays visible
    notes = [t.get_text() for t in ax.texts]
    assert any("warm-up" in n and "step 0" in n and "2,906 ms" in n for n in notes), notes


def test_a_later_stall_stays_drawn_but_off_the_scale(tmp_path: Path) -> None:
    ax = report.figures(_write_run(tmp_path, stall_ms=500.0))["time_split"].axes[0]
    assert ax.get_ylim()[1] < 50
    assert any("off scale: step 25: 506 ms" in t.get_text() for t in ax.texts)
    drawn = ax.collections[0].get_paths()[0].vertices
    assert drawn[:, 0].min() == 5 and drawn[:, 1].max() == 500.0  # the stall is in the data, the warm-up is not


def test_a_run_without_warmup_keeps_every_point(tmp_path: Path) -> None:
    ax = report.figures(_write_run(tmp_path, warmup_ms=12.0))["time_split"].axes[0]
    assert not ax.texts and ax.get_ylim()[1] >= 18.0


def test_identical_layers_share_one_labelled_line_and_styles_differ(tmp_path: Path) -> None:
    ax = report.figures(_write_run(tmp_path))["compression_ratio"].axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "net-0-weight = net-2-weight" in labels and "net-0-bias" in labels and "total" in labels
    assert len(labels) == 3
    layer_lines = [line for line in ax.get_lines() if line.get_label() != "total"]
    styles = {(line.get_marker(), line.get_linestyle()) for line in layer_lines}
    assert len(styles) == len(layer_lines), "two layers drawn with the same marker and line style"


def test_density_is_not_drawn_beside_sparsity(tmp_path: Path) -> None:
    figures = report.figures(_write_run(tmp_path))
    assert "sparsity" in figures and "density" not in figures


def test_every_figure_names_run_and_compressor_and_labels_its_axes(tmp_path: Path) -> None:
    figures = report.figures(_write_run(tmp_path))
    assert {"compression_ratio", "sparsity", "time_split", "compression_by_layer"} <= set(figures)
    for stem, fig in figures.items():
        title = fig._suptitle.get_text()
        assert "terngrad/version_0" in title and "TernGrad" in title, (stem, title)
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), (stem, ax.get_xlabel(), ax.get_ylabel())


def test_histogram_axes_are_labelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _write_run(tmp_path)
    events = [(5, [-1.0, 0.0, 1.0], [3.0, 4.0])]
    monkeypatch.setattr(report, "load_histograms", lambda log: {
        f"gradcomp/histogram/net-0-weight/{kind}": events for kind in ("original", "compressed")
    })
    fig = report.figures(run)["histograms_net-0-weight"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["gradient value"] * 2
    assert all("elements" in ax.get_ylabel() for ax in fig.axes)
    assert "TernGrad" in fig._suptitle.get_text()


def test_render_writes_the_figures(tmp_path: Path) -> None:
    written = report.render(_write_run(tmp_path), tmp_path / "out")
    assert {p.name for p in written} == {
        "compression_ratio.png", "sparsity.png", "time_split.png", "compression_by_layer.png"
    }


_CHECKED = ("compression_ratio", "sparsity", "scaler", "compression_by_layer")


@pytest.fixture(scope="module", params=[2, 24], ids=["31_layers", "295_layers"])
def model_figures(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The report's figures of a 31- and a 295-layer run, laid out (drawn) as they are saved."""
    run = write_model_run(tmp_path_factory.mktemp(f"depth{request.param}"), request.param)
    figures = {stem: fig for stem, fig in report.figures(run).items() if stem in _CHECKED}
    for fig in figures.values():
        fig.canvas.draw()
    yield len(report._by_layer(report.load_scalars(report.find_log(run)), "sparsity", None)), figures
    import matplotlib.pyplot as plt

    for fig in figures.values():
        plt.close(fig)


def _inside(inner: Any, outer: Any) -> bool:
    return bool(inner.x0 >= outer.x0 - 1 and inner.y0 >= outer.y0 - 1 and inner.x1 <= outer.x1 + 1
                and inner.y1 <= outer.y1 + 1)


def _overlap(a: Any, b: Any) -> bool:
    return bool(a.x0 < b.x1 - 1 and b.x0 < a.x1 - 1 and a.y0 < b.y1 - 1 and b.y0 < a.y1 - 1)


def test_legends_are_bounded_and_cover_no_plot(model_figures) -> None:  # type: ignore[no-untyped-def]
    layers, figures = model_figures
    assert layers in (31, 295)
    for stem in ("compression_ratio", "sparsity", "scaler"):
        fig = figures[stem]
        renderer = fig.canvas.get_renderer()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert len(legends) == 1, stem
        legend = legends[0]
        entries = [t.get_text() for t in legend.get_texts()]
        assert 2 <= len(entries) <= 9, (stem, len(entries))  # at most 8 lines of layers and the total
        box = legend.get_window_extent(renderer)
        assert _inside(box, fig.bbox), (stem, box, fig.bbox)  # no entry runs off an edge
        for ax in fig.axes:
            assert not _overlap(box, ax.get_window_extent(renderer)), (stem, "the legend covers a plot")


def test_labels_are_whole_and_rows_do_not_collide(model_figures) -> None:  # type: ignore[no-untyped-def]
    layers, figures = model_figures
    for stem, fig in figures.items():
        renderer = fig.canvas.get_renderer()
        # everything drawn (titles, tick and axis labels, legend, colour bar, notes) lies within the image
        assert _inside(fig._suptitle.get_window_extent(renderer), fig.bbox), stem
        for ax in fig.axes:
            assert _inside(ax.get_tightbbox(renderer), fig.bbox), (stem, ax.get_tightbbox(renderer), fig.bbox)
        assert fig.get_size_inches()[1] <= 12, (stem, "taller than a page")
    # the axes labelled with layer names: the heat maps and the bars
    for ax in (figures["sparsity"].axes[1], figures["scaler"].axes[1], figures["compression_by_layer"].axes[0]):
        renderer = ax.figure.canvas.get_renderer()
        labels = [t for t in ax.get_yticklabels() if t.get_text()]
        assert 2 <= len(labels) <= 40, len(labels)
        boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.y0)
        for low, high in zip(boxes, boxes[1:]):
            assert low.y1 <= high.y0 + 0.5, "two layer labels overlap"


def test_every_layer_is_drawn_and_the_runaway_named(model_figures) -> None:  # type: ignore[no-untyped-def]
    layers, figures = model_figures
    fig = figures["scaler"]
    spread, heat = fig.axes[0], fig.axes[1]
    assert heat.collections[0].get_array().shape == (layers, 60)  # one row per layer, one column per logged step
    assert RUNAWAY in [line.get_label() for line in spread.get_lines()]
    ticks = [t.get_text() for t in heat.get_yticklabels()]
    assert ("blocks-*-mlp-2-weight (24)" in ticks) if layers == 295 else (RUNAWAY in ticks)
    bars = figures["compression_by_layer"].axes[0].patches
    assert len(bars) == (31 if layers == 31 else 19)  # 295 layers: 12 kinds in the blocks, 7 layers outside them


def test_a_constant_series_is_not_magnified(tmp_path: Path) -> None:
    # every weight at 16, the total at 15.96: two touching lines, not a gap across the plot
    ax = report.figures(write_model_run(tmp_path, 2))["compression_ratio"].axes[0]
    low, high = ax.get_ylim()
    assert low <= 0 < 16 < high
    assert (16 - 15.96) / (high - low) < 0.01
    # shares span 0..1, a log axis at least a decade
    assert report.value_range("sparsity", [0.79, 0.8]) == (0.0, 1.0, False)
    low, high, log = report.value_range("bytes", [4096.0, 4100.0])
    assert log and high / low >= 10


def test_layers_without_repeated_blocks_stay_within_the_row_bound() -> None:
    # 60 layers of 60 kinds (no block index to group by): every layer kept, at most 40 labels and bars
    names = [f"layer_{chr(97 + i // 26)}{chr(97 + i % 26)}-weight" for i in range(60)]
    order, edges, ticks, separators = report._row_layout(names)
    assert sorted(order) == sorted(names) and len(edges) == 61 and not separators
    assert len(ticks) <= 40
    bars = report._ratio_bars({name: 16.0 - i / 10 for i, name in enumerate(names)})
    assert len(bars) == 40 and bars[-1][0] == "the other 21 layers"
    assert bars[-1][2:] == (16.0 - 2.0, 16.0)  # the summarised layers' range: the 21 most compressed
