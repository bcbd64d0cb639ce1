"""The performance model: the paper models' parameter tables, exact bytes from the compressor, the step formula."""

import math
from pathlib import Path

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
    gpt_shapes,
    main,
    measure_cast_codec,
    paper_curve,
    predict,
    predict_paper_model,
    profile_compute,
)
from lightning_gradcomp.exchange.codec import Codec, measure_codec
from lightning_gradcomp.compressors import Aggregation, PowerSGD, TernGrad
from lightning_gradcomp.exchange.costmodel import Link, Network, ring_allreduce_seconds
from lightning_gradcomp.compressors.per_tensor import per_tensor


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
    packets = sum(per_tensor(per_layer).compress(torch.randn(*s), n, None).nbytes for n, s in shapes)
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


# -- transformers on named GPUs and links ----------------------------------------------------------------------
def test_gpt_shapes_are_the_lab_models_in_its_parameter_order() -> None:
    from gradcomp_lab.models import GPT
    from gradcomp_lab.perfmodel import gpt_shapes

    model = GPT(vocab_size=256, width=64, depth=2, num_heads=4, context=64)
    assert gpt_shapes(64, 2, 256, 64) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_transformer_flops_are_six_per_weight_per_token_plus_attention() -> None:
    from gradcomp_lab.perfmodel import transformer_train_flops

    width, depth, seq, batch, vocab = 64, 2, 32, 3, 256
    per_block = 12 * width * width + 13 * width  # qkv, proj, the 4x MLP, two norms (weights and biases)
    weights = vocab * width + depth * per_block + 2 * width  # tied embedding; position embeddings are a lookup
    expected = seq * batch * (6 * weights + 12 * depth * seq * width)
    assert transformer_train_flops(width, depth, seq, batch, vocab) == expected


def test_stored_methods_read_bytes_and_loss_from_the_stored_runs() -> None:
    from gradcomp_lab.perfmodel import LM_SETTINGS, stored_methods

    methods = {m.setting.name: m for m in stored_methods()}
    assert list(methods) == [s.name for s in LM_SETTINGS]
    assert methods["ddp"].bytes_ratio == 1.0 and methods["ddp"].loss_vs_ddp == 0.0
    assert methods["bf16"].bytes_ratio == pytest.approx(2.0)
    # docs/transformers.md's best-setting table: DeMo 20.9x at +1.0 % (seed 0), TernGrad 4.3x at +0.1 %
    assert methods["demo"].bytes_ratio == pytest.approx(20.9, abs=0.05)
    assert methods["demo"].loss_vs_ddp == pytest.approx(0.010, abs=0.0005)
    assert methods["terngrad"].bytes_ratio == pytest.approx(4.26, abs=0.01)


def test_stored_codec_gives_back_the_stored_bytes_and_keeps_fp32_layers_fp32() -> None:
    from gradcomp_lab.perfmodel import gpt_shapes, stored_codec, stored_methods

    stored_model = gpt_shapes(64, 2, 256, 64)  # the runs' model, at their 4 ranks: their own bytes back
    methods = {m.setting.name: m for m in stored_methods()}
    for method in methods.values():
        assert stored_codec(method, stored_model, 4, 0.0).nbytes == pytest.approx(4 * 120576 / method.bytes_ratio)
    # a wide model: TernGrad's run kept the embeddings in fp32, so they cost 4 bytes an element there too, and the
    # rest 2 bits plus a 4-byte scaler per 64 elements
    wide = gpt_shapes(1024, 2, 50257, 512)
    embeddings = (50257 + 512) * 1024
    rest = sum(math.prod(s) for _, s in wide) - embeddings
    assert stored_codec(methods["terngrad"], wide, 4, 0.0).nbytes == pytest.approx(4 * embeddings + rest * (0.25 + 4 / 64))


def test_transformer_projection_scales_with_the_link_and_the_given_step() -> None:
    from gradcomp_lab.perfmodel import transformer_projection

    rows = transformer_projection(256, 4, 128, 4, 8, ["1gbit", "100gbit"], step_s=0.05, sync_every=(10,))
    by = {(r.method, r.link): r for r in rows}
    for link in ("1gbit", "100gbit"):
        assert by[("ddp", link)].speedup == 1.0 and by[("ddp", link)].prediction.compute_s == pytest.approx(0.05)
    slow, fast = by[("ddp", "1gbit")].prediction, by[("ddp", "100gbit")].prediction
    assert slow.comm_s > 50 * fast.comm_s  # 100x the bandwidth, latency apart
    bf16 = by[("bf16", "1gbit")].prediction
    assert bf16.comm_s == pytest.approx(slow.comm_s / 2, rel=0.05) and by[("bf16", "1gbit")].speedup > 1.5
    # DiLoCo with every GPU a site: one outer all-reduce every H steps, nothing in between
    diloco = by[("diloco H=10 fp32", "1gbit")]
    assert diloco.prediction.comm_s == pytest.approx(slow.comm_s / 10) and diloco.bytes_ratio == 10
    assert diloco.loss_vs_ddp == pytest.approx(0.2161, abs=0.0005)  # docs/diloco.md: diloco_h10 +21.61 %
    overlapped = transformer_projection(256, 4, 128, 4, 8, ["1gbit"], step_s=0.05, sync_every=(10,), overlap=True)
    assert overlapped[0].method == "ddp" and overlapped[0].prediction.step_s < slow.step_s  # behind backward
    with pytest.raises(ValueError, match=r"Expected `step_s` .* but got 0"):
        transformer_projection(256, 4, 128, 4, 8, ["1gbit"], step_s=0.0)
    with pytest.raises(ValueError, match=r"multiple of gpus_per_node=4, but got 6"):
        transformer_projection(256, 4, 128, 4, 6, ["1gbit"], gpus_per_node=4)


_H100_KERNELS = Path(__file__).resolve().parents[2] / "benchmarks/results/gpu_h100/kernels.json"


def _kernel_run(rows: dict[str, float], sizes: tuple[int, ...] = (2**20, 16 * 2**20)) -> dict[str, object]:
    """A stored kernel run's JSON: each row at each size, at the given fused GB/s."""
    return {"command": "python benchmarks/kernels.py --device cuda", "machine": "host, 16 cores, torch x, Some GPU",
            "rows": [{"kernel": name, "size": n, "torch": None, "fused": {"gbps": gbps}}
                     for n in sizes for name, gbps in rows.items()]}


def test_stored_kernels_give_each_compressor_its_measured_codec_cost(tmp_path: Path) -> None:
    import json

    from gradcomp_lab.perfmodel import load_kernels

    h100 = load_kernels(_H100_KERNELS)
    assert h100.device == "NVIDIA H100 80GB HBM3" and h100.size == 16 * 2**20  # the stored size nearest a 25 MB bucket
    assert sorted(h100.seconds) == ["adacomp", "dgc", "graddrop", "terngrad", "topk"]
    stored = json.loads(_H100_KERNELS.read_text())
    gbps = {r["kernel"]: r["fused"]["gbps"] for r in stored["rows"] if r["size"] == h100.size}
    assert h100.seconds["terngrad"] == pytest.approx((4 / (gbps["group compress packed"] * 1e9),
                                                      4 / (gbps["group decode packed"] * 1e9)))
    # a compressor the run has no rows for keeps the assumed cost, and says so
    assert h100.per_element("qsgd", 1e-12) == (1e-12, 1e-12) and h100.assumed(["qsgd", "topk"]) == ["qsgd"]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(_kernel_run({"group compress packed": 10.0})))  # compress without its decode row
    assert load_kernels(path).seconds == {}
    with pytest.raises(FileNotFoundError, match=r"Expected `--kernels` .* but got '.*missing.json'.* Fix:"):
        load_kernels(tmp_path / "missing.json")
    path.write_text(json.dumps({"machine": "x"}))
    with pytest.raises(ValueError, match=r"Expected `--kernels` .* with `rows`, but got .* Fix:"):
        load_kernels(path)
    path.write_text(json.dumps(_kernel_run({"terngrad statistic": 5.0})))
    with pytest.raises(ValueError, match=r"group rows .* but got none of them. Fix:"):
        load_kernels(path)


def test_projection_with_slow_measured_kernels_is_slower(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from gradcomp_lab.perfmodel import load_kernels, transformer_projection

    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(_kernel_run({"group compress packed": 1.0, "group decode packed": 2.0})))
    slow = load_kernels(path)
    args = (256, 4, 128, 4, 8, ["1gbit"])
    assumed = {r.method: r.prediction for r in transformer_projection(*args, step_s=0.05, sync_every=(10,))}
    measured = {r.method: r.prediction for r in transformer_projection(*args, step_s=0.05, sync_every=(10,),
                                                                        kernels=slow)}
    numel = sum(math.prod(s) for _, s in gpt_shapes(256, 4, context=128))
    # TernGrad at 1 GB/s to compress and 2 GB/s to decode, of 4-byte elements
    assert measured["terngrad"].codec_s == pytest.approx(numel * (4 / 1e9 + 4 / 2e9))
    assert measured["terngrad"].step_s > assumed["terngrad"].step_s + 0.9 * measured["terngrad"].codec_s
    for method in ("ddp", "bf16", "qsgd", "topk"):  # no rows for them in this run: the assumption, unchanged
        assert measured[method] == assumed[method]
    main(["transformer", "--width", "256", "--depth", "4", "--seq-len", "128", "--nproc", "8", "--link", "1gbit",
          "--diloco-h", "10", "--kernels", str(path)])
    out = capsys.readouterr().out
    assert f"measured group compress and decode of terngrad on Some GPU ({path}" in out
    assert "memory-bound kernels at h100's 3,350 GB/s (an assumption) for int8, qsgd, graddrop" in out


def test_hierarchical_rows_compress_only_between_nodes() -> None:
    from gradcomp_lab.perfmodel import transformer_projection

    rows = transformer_projection(512, 4, 128, 4, 16, ["1gbit"], device="a100", gpus_per_node=4, sync_every=(50,))
    by = {r.method: r for r in rows}
    # a gathered payload grows with the ranks it crosses: 4 sites instead of 16 ranks
    assert by["hierarchical demo"].prediction.comm_s < by["demo"].prediction.comm_s
    assert math.isnan(by["hierarchical demo"].loss_vs_ddp)  # not measured on the language model
    assert by["diloco H=50 int8"].speedup > by["diloco H=50 fp32"].speedup > 1


def test_the_model_against_the_emulated_clusters_stored_step_times() -> None:
    """The error the docs state: every emulated run re-predicted from its 1 Gbit/s step onto the 100 Mbit/s WAN."""
    from gradcomp_lab.perfmodel import validate_emulated

    rows = validate_emulated()
    assert len(rows) == 12
    errors = {(r.benchmark, r.run): r.error for r in rows}
    assert abs(errors[("lm_emulated", "ddp")]) < 0.05 and abs(errors[("diloco_emulated", "ddp")]) < 0.10
    assert sum(abs(e) for e in errors.values()) / len(errors) < 0.13  # 12.2 % mean, documented in docs/choosing.md


def test_transformer_and_validate_commands(capsys: pytest.CaptureFixture) -> None:
    main(["transformer", "--width", "256", "--depth", "2", "--seq-len", "64", "--nproc", "4", "--link", "1gbit",
          "--diloco-h", "50"])
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION (a model, not a measurement)") and "| demo | 16x16 chunks" in out
    assert "| diloco H=50 int8 |" in out and "sharded" not in out
    main(["transformer", "--width", "256", "--depth", "2", "--seq-len", "64", "--nproc", "4", "--gpus-per-node", "2",
          "--link", "1gbit", "--diloco-h", "50"])
    out = capsys.readouterr().out
    assert "Sharded rows: FSDP2 over each node's GPUs" in out
    assert "| sharded fp32 | fp32 all-reduce | 1.0x | n/a |" in out and "| sharded diloco H=50 int8 |" in out
    main(["validate"])
    assert "mean absolute error 12.2%" in capsys.readouterr().out


def test_the_stored_projections_of_the_guide_are_what_the_model_computes() -> None:
    """docs/choosing.md's "speed-up (projected)" columns are printed from ``benchmarks/projections.py``'s stored
    JSON (``tools/results_tables.py``; a test checks the page against the file): the file equals what the model
    computes now for every transformer row, and for AlexNet's fp32 DDP and TernGrad rows (AdaComp's are left out:
    building its codec on AlexNet's 61M elements takes seconds)."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("projections", root / "benchmarks/projections.py")
    assert spec is not None and spec.loader is not None
    projections = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(projections)
    stored = json.loads((root / "benchmarks/results/projections/choosing.json").read_text())
    kernels = stored["transformer"]["kernels"]  # the device kernels the stored projection used, named in the page
    assert root / kernels["file"] == projections.KERNELS
    computed = projections.transformer_rows(projections.load_kernels(root / kernels["file"]))
    assert [r["method"] for r in computed] == [r["method"] for r in stored["transformer"]["rows"]]
    for now, then in zip(computed, stored["transformer"]["rows"]):
        assert {k: v for k, v in now.items() if isinstance(v, float)} == pytest.approx(
            {k: v for k, v in then.items() if isinstance(v, float)}), now["method"]
    cheap = [row for row in stored["cnn"]["rows"] if row["compressor"] != "adacomp"]
    cnn = projections.CNN
    for row in cheap:
        p = predict_paper_model(cnn["model"], row["compressor"], cnn["world_size"], row["link"], cnn["device"],
                                gpus_per_node=cnn["gpus_per_node"], intra=cnn["intra"],
                                overlap=not row["hierarchical"], hierarchical=row["hierarchical"])
        assert p.step_s == pytest.approx(row["step_s"]) and p.collective == row["collective"], row
    assert len(cheap) == 9


def test_sharded_exchange_seconds_by_hand() -> None:
    """HSDP on 2 replicas of 2 shards, 2 FSDP2 units of 4 MB each (8 MB of fp32 gradient), fp32 between replicas."""
    from gradcomp_lab.perfmodel import diloco_comm_seconds, hierarchical_comm_seconds, sharded_comm_seconds

    net = Network(Link(1e10, 1e-4), sites=2, wan=Link(1e9, 1e-4))
    dense = Codec(8e6, Aggregation.SUM)
    # per unit inside a replica: all-gather + reduce-scatter of 4 MB on 2 ranks = 2 x 1e-4 + 8 x 4e6 / 1e10 s;
    # the first unit (a block) all-gathers its 2 MB shard again in backward: 1e-4 + 8 x 2e6 / 1e10 s;
    # between replicas per unit: each rank's 2 MB shard, both over the replica's link: 2 x 1e-4 + 8 x 4e6 / 1e9 s
    inside, regather, between = 2 * 3.4e-3, 1.7e-3, 2 * 0.0322
    assert sharded_comm_seconds(dense, 8e6, 4, net, [0.5, 0.5]) == pytest.approx(inside + regather + between)
    # DiLoCo over the shards: FSDP2 inside every step, the shards between replicas every 10 steps
    assert sharded_comm_seconds(dense, 8e6, 4, net, [0.5, 0.5], sync_every=10) == pytest.approx(
        inside + regather + between / 10)
    # the same bytes as the hierarchical exchange (reduce to each share's owner, shares between sites, gather)
    assert sharded_comm_seconds(dense, 8e6, 4, net, 2, regather=False) == pytest.approx(
        hierarchical_comm_seconds(dense, 8e6, 4, net, 2))
    # DiLoCo over DDP sites also reduces the pseudo-gradient inside the site at each round; over shards it does not
    assert diloco_comm_seconds(dense, 8e6, 4, net, 10, 2) - sharded_comm_seconds(
        dense, 8e6, 4, net, 2, sync_every=10, regather=False) == pytest.approx(inside / 10)
    with pytest.raises(ValueError, match="at least 2 sites"):
        sharded_comm_seconds(dense, 8e6, 4, Network(Link(1e10)))


def test_cross_node_fsdp_seconds_by_hand() -> None:
    """FSDP2 over 4 ranks of 2 nodes, 2 units of 4 MB each (8 MB of fp32), the second the root (not regathered)."""
    from gradcomp_lab.perfmodel import cross_node_fsdp_comm_seconds

    net = Network(Link(1e10, 1e-4), sites=2, wan=Link(1e9, 1e-4))
    # stock, flat rings over the 4 ranks at the WAN's rate: per unit a reduce-scatter of 4 MB (half a ring
    # all-reduce: 3 x 1e-4 + 3/4 x 8 x 4e6 / 1e9 s) and all-gathers of its 1 MB pieces (3 x (1e-4 + 8 x 1e6 / 1e9))
    # once, the first unit twice: both 0.0243 s
    assert cross_node_fsdp_comm_seconds(0.0, 8e6, 4, net, [0.5, 0.5]) == pytest.approx(5 * 0.0243)
    # compressed: inside a node of 2 on the fast link, a reduce-scatter of 4 MB (1e-4 + 8 x 2e6 / 1e10) and
    # all-gathers of 2 MB (the same): 1.7e-3 s each; between nodes, the node's 2 ranks' 1 MB each on its one WAN link
    # and one latency per collective
    between = 8 * 2e6 / 1e9
    assert cross_node_fsdp_comm_seconds(1e6, 8e6, 4, net, [0.5, 0.5], reduce_scatter=True, all_gather=True) == (
        pytest.approx(5 * 1.7e-3 + 5 * 1e-4 + between))
    # the reduce-scatter alone: the all-gathers stay stock's flat rings
    assert cross_node_fsdp_comm_seconds(1e6, 8e6, 4, net, [0.5, 0.5], reduce_scatter=True) == pytest.approx(
        2 * 1.7e-3 + 3 * 0.0243 + 2 * 1e-4 + between)


def test_fsdp_units_are_the_blocks_last_first_then_the_root() -> None:
    from gradcomp_lab.perfmodel import fsdp_unit_fractions, gpt_shapes

    shapes = gpt_shapes(64, 2, 256, 64)  # 120,576 parameters
    block = 4 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64
    root = 256 * 64 + 64 * 64 + 2 * 64
    assert 2 * block + root == 120_576
    assert fsdp_unit_fractions(shapes) == pytest.approx([block / 120_576, block / 120_576, root / 120_576])


def test_sharded_rows_of_the_transformer_projection() -> None:
    from gradcomp_lab.perfmodel import transformer_projection

    rows = transformer_projection(512, 4, 128, 4, 16, ["1gbit"], device="a100", gpus_per_node=4, sync_every=(50,))
    by = {r.method: r for r in rows}
    hsdp, tern = by["sharded fp32"], by["sharded terngrad"]
    # stock HSDP sends the whole fp32 gradient between nodes (as shards), dense FSDP2 traffic inside them
    assert hsdp.bytes_ratio == 1.0 and math.isnan(hsdp.loss_vs_ddp) and hsdp.prediction.collective == "sharded"
    # the same bytes between nodes as the hierarchical exchange, plus FSDP2's all-gather again in backward
    assert hsdp.prediction.comm_s > by["hierarchical bf16"].prediction.comm_s
    assert tern.bytes_ratio == pytest.approx(by["hierarchical terngrad"].bytes_ratio)
    bf16 = by["sharded bf16"]
    assert bf16.bytes_ratio == 2.0 and bf16.prediction.comm_s < hsdp.prediction.comm_s and bf16.speedup > hsdp.speedup
    # each rank encodes its shard only: a quarter of the hierarchical exchange's codec time
    assert tern.prediction.codec_s == pytest.approx(by["hierarchical terngrad"].prediction.codec_s / 4)
    assert by["sharded diloco H=50 int8"].speedup > by["sharded diloco H=50 fp32"].speedup > hsdp.speedup


def test_a_stored_sharded_run_is_predicted_on_the_other_link() -> None:
    """A sharded run's step on 100 Mbit/s from its step on 1 Gbit/s: only the exchange between the replicas changes
    (each rank's shard, both ranks of a site over its one link); FSDP2's traffic stays inside the site."""
    from gradcomp_lab.perfmodel import fsdp_unit_fractions, gpt_shapes, predict_from_stored

    run = {"recipe": "recipes/lm/gpt_stdlib_sharded_terngrad.yaml", "overrides": [
        "--trainer.strategy.init_args.compressor=fp32"], "strategy": "ShardedGradCompStrategy",
        "compressor": {"compressor": "Identity"}, "world_size": 4, "parameters": 445_952,
        "bytes_per_step": 891_904, "median_step_seconds": 0.5}
    units = len(fsdp_unit_fractions(gpt_shapes(128, 2, 256, 128)))
    assert units == 3
    # 2 ranks x 891,904 bytes all-reduced by the 2 sites: 8 x 1,783,808 bytes at each rate, a latency per unit
    swap = 8 * 1_783_808 * (1 / 1e8 - 1 / 1e9)
    assert predict_from_stored(run, "1gbit", run, "100mbit") == pytest.approx(0.5 + swap)
    outer = dict(run, strategy="ShardedDiLoCoStrategy", steps=200, outer_rounds=4, bytes_per_step=891_904 / 50 / 4)
    assert predict_from_stored(outer, "1gbit", outer, "100mbit") == pytest.approx(0.5 + swap / 50 / 4)
