"""The performance model: the paper models' parameter tables, exact bytes from the compressor, the step formula."""

import math

import pytest
import torch
from torch import nn

from gradcomp_lab.emulate import cluster as emulate_cluster
from gradcomp_lab.perfmodel import (
    PAPER_MODELS,
    ComputeTime,
    bucket_fractions,
    comm_seconds,
    ddp_bucket_fractions,
    fp32_codec,
    main,
    measure_cast_codec,
    paper_curve,
    predict,
    profile_compute,
)
from lightning_gradcomp.codec import Codec, measure_codec
from lightning_gradcomp.compressors import Aggregation, PowerSGD, TernGrad
from lightning_gradcomp.costmodel import Link, Network, ring_allreduce_seconds


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
    cast = measure_cast_codec(10_001, 4)
    assert cast.nbytes == 2 * 10_001 and cast.aggregation is Aggregation.SUM and cast.rounds == 0
    assert cast.encode_s > 0 and cast.decode_s > 0



def test_a_multiround_codec_times_the_hooks_flat_exchange_and_keeps_the_packets_bytes() -> None:
    shapes = [("w1", (64, 48)), ("b1", (64,)), ("w2", (64, 48)), ("w3", (10, 64))]
    per_layer = PowerSGD(rank=2)
    per_layer.setup(0, 4, torch.device("cpu"))
    packets = sum(per_layer.compress(torch.randn(*s), n, None).nbytes for n, s in shapes)
    codec = measure_codec(PowerSGD(rank=2), shapes, 4)
    # the flat exchange's bytes: the dense bias, and (n + m) r floats per low-rank matrix
    assert codec.nbytes == packets == 4 * (64 + 2 * (64 + 48) * 2 + (10 + 64) * 2)
    assert codec.aggregation is Aggregation.SUM and codec.encode_s > 0 and codec.decode_s == 0
    untimed = measure_codec(PowerSGD(rank=2), shapes, 4, timed=False)
    assert untimed.nbytes == packets and untimed.encode_s == 0
def test_step_formula() -> None:
    net = Network(Link(1e9, 0.0))
    p = predict(0.1, fp32_codec(25_000_000), 4, net, batch=32, cpu_share=0.5)
    assert p.compute_s == pytest.approx(0.2)
    assert p.comm_s == pytest.approx(ring_allreduce_seconds(1e8, 4, net))
    assert p.throughput == pytest.approx(4 * 32 / (0.2 + p.comm_s))
    assert p.hidden_s == 0.0 and p.compute_s + p.comm_s == pytest.approx(p.step_s)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    parts = profile_compute(model, 8, (16,), classes=4, steps=2)
    assert min(parts.forward_s, parts.backward_s, parts.update_s) > 0
    assert parts.total_s == pytest.approx(parts.forward_s + parts.backward_s + parts.update_s)


def test_compute_split_keeps_the_profiles_proportions() -> None:
    like = ComputeTime(0.1, 0.6, 0.3)
    split = ComputeTime.from_total(2.0, like=like)
    assert (split.forward_s, split.backward_s, split.update_s) == pytest.approx((0.2, 1.2, 0.6))
    flops = ComputeTime.from_total(0.3)  # the FLOP-count convention: backward twice the forward
    assert (flops.forward_s, flops.backward_s, flops.update_s) == pytest.approx((0.1, 0.2, 0.0))


def _bucket_payload_and_stat(codec: Codec, n: int, net: Network, buckets: int) -> tuple[float, float]:
    stat = codec.rounds * ring_allreduce_seconds(4.0, n, net)
    return comm_seconds(codec, n, net, buckets) / buckets - stat, stat


@pytest.mark.parametrize("buckets", [1, 4])
def test_overlap_hides_what_the_serial_model_adds(buckets: int) -> None:
    """DDP's timeline: one bucket hides nothing; a transfer shorter than each bucket's share of backward hides
    all but the last bucket's; a transfer much longer than backward hides all of backward after the first bucket."""
    net = Network(Link(1e9, 50e-6))
    compute = ComputeTime(0.05, 0.4, 0.1)
    n = 4
    small = Codec(2e6, Aggregation.GATHER, encode_s=0.04, decode_s=0.02, rounds=1)
    big = Codec(4e8, Aggregation.SUM, encode_s=0.04, decode_s=0.02, rounds=1)
    for codec in (small, big):
        serial = predict(compute, codec, n, net, batch=8, buckets=buckets)
        timeline = predict(compute, codec, n, net, batch=8, buckets=buckets, overlap=True)
        assert 0.0 <= timeline.hidden_s <= timeline.comm_s + codec.decode_s
        assert timeline.step_s <= serial.step_s
        if buckets == 1:
            assert timeline.step_s == pytest.approx(serial.step_s)
    if buckets == 1:
        return
    payload, stat = _bucket_payload_and_stat(small, n, net, buckets)
    assert payload + small.decode_s / buckets < compute.backward_s / buckets  # each transfer fits behind backward
    fits = predict(compute, small, n, net, batch=8, buckets=buckets, overlap=True)
    blocking = compute.total_s + small.encode_s + buckets * stat
    assert fits.step_s == pytest.approx(blocking + payload + small.decode_s / buckets)
    payload, stat = _bucket_payload_and_stat(big, n, net, buckets)
    assert payload > compute.backward_s  # communication-bound: the queue never drains
    bound = predict(compute, big, n, net, batch=8, buckets=buckets, overlap=True)
    first_ready = compute.forward_s + compute.backward_s / buckets + stat + big.encode_s / buckets
    assert bound.step_s == pytest.approx(first_ready + buckets * (payload + big.decode_s / buckets) + compute.update_s)


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


@pytest.mark.parametrize("model", ["mlp", "alexnet", "vgg_a"])
def test_ddp_bucket_fractions_match_ddps_own_assignment(model: str) -> None:
    import torch
    import torch.distributed as dist

    if model == "mlp":
        shapes = [("w0", (4096, 784)), ("b0", (4096,)), ("w1", (4096, 4096)), ("b1", (4096,)),
                  ("w2", (4096, 4096)), ("b2", (4096,)), ("w3", (10, 4096)), ("b3", (10,))]
    else:
        shapes = PAPER_MODELS[model].shapes()
    backward_order = [torch.empty(()).expand(*s) for _, s in reversed(shapes)]  # no memory: only sizes matter
    groups, _ = dist._compute_bucket_assignment_by_size(backward_order, [1 << 20, 25 << 20], [False] * len(shapes))
    sizes = [sum(backward_order[i].numel() for i in g) for g in groups]
    assert ddp_bucket_fractions(shapes) == pytest.approx([n / sum(sizes) for n in sizes])


def test_bucket_fractions_reject_what_is_not_a_split() -> None:
    assert bucket_fractions(4) == [0.25] * 4
    assert bucket_fractions([1, 3]) == [0.25, 0.75]
    with pytest.raises(ValueError, match=r"buckets=\[-1.0, 2.0\]"):
        bucket_fractions([-1.0, 2.0])
