"""Single-process checks of the monitor's maths: histograms, residual statistics, the time split, arguments."""

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.callbacks.monitor import layer_key, residual_statistics
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.exchange.stats import HookStats, _device_histogram, histogram


@pytest.mark.parametrize("values", [torch.randn(1000) * 3 + 1, torch.full((17,), 0.25), torch.zeros(5),
                                    torch.tensor([-1.0, 1.0]), torch.randn(4, 7).double()])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-range", "device-range"])
def test_histogram_counts_every_element_within_its_edges(values: torch.Tensor, on_device: bool) -> None:
    counts, edges = _device_histogram(values.reshape(-1).float(), 16) if on_device else histogram(values, bins=16)
    assert counts.shape == (16,) and edges.shape == (17,)
    assert counts.sum().item() == values.numel()
    assert torch.all(edges[1:] > edges[:-1])
    assert edges[0].item() == pytest.approx(values.min().item())
    assert edges[-1].item() >= values.max().item() - 1e-6
    # agrees with numpy's binning over the same edges
    reference, _ = np.histogram(values.float().numpy(), bins=edges.numpy().astype(np.float64))
    assert np.abs(reference - counts.numpy()).sum() <= 2  # edge rounding may move a value to a neighbour bin


def test_residual_statistics_exact_and_sampled() -> None:
    r = torch.randn(1000)
    norm, peak, p95 = residual_statistics(r)
    assert norm.item() == pytest.approx(r.norm().item(), rel=1e-6)
    assert peak.item() == r.abs().max().item()
    assert p95.item() == pytest.approx(float(np.quantile(r.abs().numpy(), 0.95, method="inverted_cdf")))
    big = torch.rand(3 << 20)  # above the exact limit: a strided sample
    _, _, p95_big = residual_statistics(big)
    assert p95_big.item() == pytest.approx(0.95, abs=5e-3)


def test_time_split_adds_phases_and_blocking_waits() -> None:
    stats = HookStats()
    # start 0, blocked 1..3 inside the hook body, launched 5, decode 6.5..7 (perf-counter seconds)
    stats._record(0.0, 5.0, 6.5, 7.0, [(1.0, 3.0)])
    times = stats.take_times()
    assert times == {"compress": 3.0, "collective_wait": 3.5, "decompress": 0.5}
    assert stats.take_times() == dict.fromkeys(times, 0.0)  # read once


def test_capture_only_when_armed() -> None:
    stats = HookStats(histogram_layers=["fc.*"], bins=8)
    g = torch.randn(32)
    stats.observe_input("fc.weight", g, g, TernGrad())
    assert stats.histograms == {}  # not armed: nothing computed
    stats.capture = True
    stats.observe_input("fc.weight", g, g, TernGrad(clip_factor=1.0))
    stats.observe_input("conv.weight", g, g, TernGrad())
    assert set(stats.histograms) == {"fc.weight"}
    clipped_counts, clipped_edges = stats.histograms["fc.weight"]["clipped"]
    assert clipped_edges[-1] <= g.max() and clipped_counts.sum() == 32
    stats.clear_capture()
    assert not stats.capture and stats.histograms == {}
    # a logging step without histograms (the monitor's histogram_every) still captures scalars, no histograms
    stats.capture, stats.capture_histograms = True, False
    stats.observe_input("fc.weight", g, g, TernGrad())
    assert stats.histograms == {}


def test_terngrad_clipped_matches_its_clipping() -> None:
    g = torch.randn(1000)
    t = TernGrad(clip_factor=2.5)
    threshold = 2.5 * g.std(correction=0)
    torch.testing.assert_close(t.clipped(g), g.clamp(-threshold, threshold))
    assert torch.equal(TernGrad(clip_factor=0.0).clipped(g), g)


def test_layer_key_and_argument_errors() -> None:
    assert layer_key("sparsity", "net.0.weight") == "gradcomp/sparsity/net-0-weight"
    with pytest.raises(ValueError, match="logging_interval"):
        CompressionMonitor(logging_interval=0)
    with pytest.raises(ValueError, match="histogram_bins"):
        CompressionMonitor(histogram_bins=0)
    with pytest.raises(ValueError, match="histogram_every"):
        CompressionMonitor(histogram_every=0)
    with pytest.raises(ValueError, match=r"Fix: use \['fc\.\*'\]"):
        CompressionMonitor(histogram_layers="fc.*")


def test_report_cli_rejects_a_missing_or_empty_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradcomp_lab import report

    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path / "nope")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.csv").write_text("step,loss\n0,1.0\n")
    with pytest.raises(SystemExit):
        report.main([str(tmp_path)])
    assert "CompressionMonitor" in capsys.readouterr().err
