"""CompressionMonitor end to end: 2 Gloo ranks, W&B offline run file read back, CSV and TensorBoard scalars."""

import csv
import math
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.callbacks.monitor import SUMMARIES
from lightning_gradcomp.wire.ternary import packed_nbytes
from tests import wandb_reader
from tests.distributed.monitor_ranks import monitored_runs
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

_PER_LAYER = ("sparsity", "density", "scaler", "bytes", "bits_per_element", "compression_ratio")
_KINDS = ("original", "clipped", "compressed", "averaged")


def _key(statistic: str, name: str) -> str:
    return f"gradcomp/{statistic}/{name.replace('.', '-')}"


def _csv_rows(log_dir: str) -> list[dict[str, float]]:
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _nonzero_bins(histogram: dict) -> int:
    return sum(1 for c in histogram["values"] if c)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("monitor")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    return run_ranks(monitored_runs, 2, str(tmp), env=env, timeout=300), tmp


def test_fails_fast_without_logger_and_does_not_perturb_training(runs: tuple[list[dict], Path]) -> None:
    results, _ = runs
    assert "no logger" in results[0]["no_logger_error"] and "Fix:" in results[0]["no_logger_error"]
    # the monitor draws no randomness and changes no gradient: bit-identical to the unmonitored run
    for r in results:
        assert torch.equal(r["params"], r["plain_params"])
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert results[0]["progress_bar"]["comp_ratio"] == pytest.approx(results[0]["ratio"], rel=1e-6)


def test_wandb_offline_run_file(runs: tuple[list[dict], Path]) -> None:
    results, tmp = runs
    numel = results[0]["numel"]
    files = sorted((tmp / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    records = wandb_reader.read_records(files[0])

    rows = [row for row in wandb_reader.history(records) if any(k.startswith("gradcomp/") for k in row)]
    # log_every_n_steps=2, 6 steps: one row per logging step, each with every statistic (one log call per step)
    assert [row["trainer/global_step"] for row in rows] == [1, 3, 5]
    for row in rows:
        for name, n in numel.items():
            for statistic in _PER_LAYER:
                assert _key(statistic, name) in row, (statistic, name)
            assert math.isclose(row[_key("sparsity", name)] + row[_key("density", name)], 1.0, abs_tol=1e-6)
            # 2-bit packing, all-gathered between 2 ranks
            assert row[_key("bytes", name)] == packed_nbytes(n, "2bit")
            assert row[_key("compression_ratio", name)] == pytest.approx(32 / row[_key("bits_per_element", name)])
            hists = {kind: row[_key("histogram", name) + f"/{kind}"] for kind in _KINDS}
            for kind, h in hists.items():
                assert h["_type"] == "histogram" and len(h["bins"]) == len(h["values"]) + 1 == 65
                assert sum(h["values"]) == n, (name, kind)
            assert _nonzero_bins(hists["compressed"]) <= 3  # {-s, 0, s}
            assert _nonzero_bins(hists["averaged"]) <= 5  # means of two ternaries
            # clipping only narrows the range
            assert hists["clipped"]["bins"][-1] <= hists["original"]["bins"][-1] + 1e-7
            assert hists["clipped"]["bins"][0] >= hists["original"]["bins"][0] - 1e-7
        layer_bytes = sum(row[_key("bytes", name)] for name in numel)
        assert row["gradcomp/bytes/total"] == layer_bytes + 4 * len(numel)  # + one fp32 shared scaler per tensor
        for phase in ("compress", "collective_wait", "decompress"):
            assert row[f"gradcomp/time_ms/{phase}"] >= 0
        assert row["gradcomp/time_ms/compress"] > 0
    assert rows[-1]["gradcomp/compression_ratio/total"] == pytest.approx(results[0]["ratio"])

    summary = wandb_reader.summary(records)
    for key in (_key("sparsity", "net.2.weight"), "gradcomp/compression_ratio/total", "gradcomp/time_ms/compress"):
        values = [row[key] for row in rows]
        assert summary[key]["last"] == pytest.approx(values[-1])
        assert summary[key]["mean"] == pytest.approx(sum(values) / len(values))
    assert summary[_key("scaler", "net.0.weight")]["max"] == pytest.approx(max(r[_key("scaler", "net.0.weight")] for r in rows))

    definitions = wandb_reader.metric_definitions(records)
    for key in rows[-1]:
        if key.startswith("gradcomp/"):
            metric = definitions[key]
            assert metric.step_metric == "trainer/global_step"
            statistic = key.split("/")[1]
            for aggregate in SUMMARIES[statistic].split(","):
                assert getattr(metric.summary, aggregate), (key, aggregate)

    config = wandb_reader.config(records)["gradcomp"]
    assert config["compressor"] == "TernGrad" and config["clip_factor"] == 2.5 and config["world_size"] == 2


def test_csv_logger_gets_the_same_scalars(runs: tuple[list[dict], Path]) -> None:
    results, tmp = runs
    files = sorted((tmp / "wandb").glob("offline-run-*/run-*.wandb"))
    wandb_rows = [r for r in wandb_reader.history(wandb_reader.read_records(files[0])) if "gradcomp/bytes/total" in r]
    csv_rows = [r for r in _csv_rows(results[0]["csv_dir"]) if "gradcomp/bytes/total" in r]
    assert [r["step"] for r in csv_rows] == [1, 3, 5]
    for w, c in zip(wandb_rows, csv_rows):
        scalars = {k: v for k, v in w.items() if k.startswith("gradcomp/") and not isinstance(v, dict)}
        assert set(scalars) == {k for k in c if k.startswith("gradcomp/")}
        for key, value in scalars.items():
            assert c[key] == pytest.approx(value, rel=1e-6), key
    hparams = (Path(results[0]["csv_dir"]) / "hparams.yaml").read_text()
    assert "compressor: TernGrad" in hparams


def test_residual_statistics_and_report(runs: tuple[list[dict], Path], tmp_path: Path) -> None:
    results, _ = runs
    rows = [r for r in _csv_rows(results[0]["half_csv_dir"]) if "gradcomp/bytes/total" in r]
    last = rows[-1]
    assert last["step"] == 5  # the last step: residuals in memory are the ones logged
    for name, norm in results[0]["half_residual_norms"].items():
        assert last[_key("residual_norm", name)] == pytest.approx(norm, rel=1e-5)
        assert last[_key("residual_max", name)] == pytest.approx(results[0]["half_residual_max"][name], rel=1e-6)
        assert 0 <= last[_key("residual_p95", name)] <= last[_key("residual_max", name)] <= norm * (1 + 1e-6)
        # fp16 payloads: the monitor computes sparsity from what was sent
        assert 0 <= last[_key("sparsity", name)] < 0.5
        assert last[_key("compression_ratio", name)] == 2.0

    from gradcomp_lab import report

    pytest.importorskip("matplotlib", reason="`gradcomp report` plots need the optional [report] extra (matplotlib)")
    for source, name in ((results[0]["half_csv_dir"], "csv"), (results[0]["half_tb_dir"], "tb")):
        scalars = report.load_scalars(report.find_log(Path(source)))
        assert scalars[_key("residual_norm", "net.0.weight")][-1][1] == pytest.approx(
            last[_key("residual_norm", "net.0.weight")], rel=1e-5)
        written = report.render(Path(source), tmp_path / name)
        names = {p.name for p in written}
        assert {"residual_norm.png", "sparsity.png", "time_split.png", "compression_by_layer.png"} <= names
        assert all(p.stat().st_size > 1000 for p in written)
        if name == "tb":  # TensorBoard also got the four histograms of every layer (CSV cannot hold them)
            histograms = report.load_histograms(report.find_log(Path(source)))
            for layer, n in results[0]["numel"].items():
                for kind in _KINDS:
                    events = histograms[_key("histogram", layer) + f"/{kind}"]
                    assert [e[0] for e in events] == [1, 3, 5]
                    assert all(sum(counts) == n and len(edges) == len(counts) + 1 for _, edges, counts in events)
            assert f"histograms_{_key('h', 'net.0.weight').split('/')[-1]}.png" in names
