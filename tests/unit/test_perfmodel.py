"""The performance model: the paper models' parameter tables, exact bytes from the compressor, the step formula."""

import math

import pytest
from torch import nn

from lightning_gradcomp.compressors import Aggregation, TernGrad
from lightning_gradcomp.costmodel import Link, Network, ring_allreduce_seconds
from lightning_gradcomp.emulate import cluster as emulate_cluster
from lightning_gradcomp.perfmodel import PAPER_MODELS, fp32_codec, main, measure_codec, paper_curve, predict, profile_compute


@pytest.mark.parametrize(("model", "millions"), [("alexnet", 60.97), ("googlenet", 7.0), ("vgg_a", 132.86)])
def test_parameter_tables(model: str, millions: float) -> None:
    numel = sum(math.prod(s) for _, s in PAPER_MODELS[model].shapes())
    assert numel / 1e6 == pytest.approx(millions, rel=0.01)


def test_codec_bytes_are_the_compressors_own() -> None:
    shapes = [("a", (1000, 10)), ("b", (7,))]
    codec = measure_codec(TernGrad(), shapes, 2)
    assert codec.nbytes == math.ceil(10000 / 4) + math.ceil(7 / 4)  # 2-bit packing, shared scalers stay local
    assert codec.aggregation is Aggregation.GATHER and codec.rounds == 1
    assert measure_codec(TernGrad(), shapes, 16, timed=False).aggregation is Aggregation.SUM  # int8 from N = 8


def test_step_formula() -> None:
    net = Network(Link(1e9, 0.0))
    p = predict(0.1, fp32_codec(25_000_000), 4, net, batch=32, cpu_share=0.5)
    assert p.compute_s == pytest.approx(0.2)
    assert p.comm_s == pytest.approx(ring_allreduce_seconds(1e8, 4, net))
    assert p.throughput == pytest.approx(4 * 32 / (0.2 + p.comm_s))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    assert profile_compute(model, 8, (16,), classes=4, steps=2) > 0


def test_fig5_shape_and_cli(capsys: pytest.CaptureFixture, tmp_path: object) -> None:
    fp = paper_curve("alexnet", "a", [4, 8], "fp32")
    tg = paper_curve("alexnet", "a", [4, 8], "terngrad")
    # inside one node PCIe carries fp32 well; across 1 Gbps Ethernet TernGrad wins by ~3x (paper: 3.04x at 8 GPUs)
    assert tg[1].throughput / fp[1].throughput > 2.0 and fp[1].throughput < fp[0].throughput
    main(["predict", "--model", "googlenet", "--compressor", "fp32-ddp", "--nproc", "2", "8"])
    assert "| 8 | fp32-ddp |" in capsys.readouterr().out


def test_emulation_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulate_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(emulate_cluster.EmulationUnavailable, match="needs root"):
        emulate_cluster.check_available()
    monkeypatch.setattr(emulate_cluster.shutil, "which", lambda _: None)
    with pytest.raises(emulate_cluster.EmulationUnavailable, match="iproute2"):
        emulate_cluster.check_available()
