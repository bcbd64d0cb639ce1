"""TopK and DGC on a whole group of layers (issue 17's flat contract): the batched overrides give what the default
per-layer loop gives, bit for bit (selection, wire bytes per layer, stats, ``sent``, the ranks' mean), in a number of
ops that does not depend on the number of layers, with no host read; and the segmented helpers they use."""

from collections.abc import Callable

import pytest
import torch

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp.compressors import DGC, TopK
from lightning_gradcomp.compressors.base import Compressor, FlatPacket
from lightning_gradcomp.kernels import segmented
from lightning_gradcomp.exchange.segments import Segments

CPU = torch.device("cpu")
RANKS = 3

#: mixed shapes: sampled DGC layers (> 2 / ratio elements), small exact ones, 1-element and 0-element layers, 1-D
SHAPES = [(40, 30), (1,), (0, 4), (7,), (300, 200), (1, 1), (5000,), (2, 3, 4), (9000,)]

COMPRESSORS: dict[str, Callable[[], Compressor]] = {
    "topk": lambda: TopK(0.01),
    "topk_fp16": lambda: TopK(0.05, value_dtype="fp16"),
    "topk_int2_sparse_1d": lambda: TopK(0.03, value_dtype="int2", dense_1d=False),
    "dgc": lambda: DGC(0.01),
    "dgc_sparse_1d": lambda: DGC(0.001, dense_1d=False),
    "dgc_fp16": lambda: DGC(0.02, value_dtype="fp16"),
}


def _segments(shapes: list[tuple[int, ...]] = SHAPES) -> Segments:
    return Segments([f"layer{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _pair(make: Callable[[], Compressor], rank: int = 0) -> tuple[Compressor, Compressor]:
    batched, looping = make(), make()
    for c in (batched, looping):
        c.setup(rank, RANKS, CPU)
    batched.batch_on_cpu = True  # the path a GPU runs (on CPU the hook keeps the per-layer selections)
    return batched, looping


def test_on_cpu_the_group_path_loops_unless_asked_and_decodes_either_packet() -> None:
    seg = _segments()
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(7))
    default, forced = _pair(lambda: TopK(0.05))
    forced.batch_on_cpu, default.batch_on_cpu = True, False
    looped, batched = default.compress_flat(x, seg), forced.compress_flat(x, seg)
    assert looped.layers is not None and batched.layers is None
    assert torch.equal(default.decompress_flat(looped), forced.decompress_flat(batched))


def _gradient(total: int, step: int, rank: int) -> torch.Tensor:
    """Dense Gaussian steps, and every third step a mostly-zero one (DGC's sample then misses the few large
    values: its threshold is too low and an exact top-k follows, or too high and it adapts downwards)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(total, generator=gen)
    if step % 3 == 2:
        x = x * (torch.rand(total, generator=gen) < 0.01)
    return x


def _sizes(packet: FlatPacket) -> tuple[int, ...]:
    nbytes = packet.layer_nbytes
    return tuple(nbytes.tolist()) if isinstance(nbytes, torch.Tensor) else nbytes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and +0.0 differ, NaN payloads compare


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_batched_matches_the_per_layer_loop(name: str) -> None:
    seg = _segments()
    ranks = [_pair(COMPRESSORS[name], r) for r in range(RANKS)]
    assert all(batched.batched for batched, _ in ranks)
    residual = [(torch.zeros(seg.total), torch.zeros(seg.total)) for _ in range(RANKS)]
    for step in range(6):
        flat_a, flat_b = [], []
        for r, ((a, b), (res_a, res_b)) in enumerate(zip(ranks, residual)):
            g = _gradient(seg.total, step, r)
            x_a, x_b = g + res_a, g + res_b
            pa, pb = a.compress_flat(x_a, seg, a.flat_statistic(x_a, seg)), Compressor.compress_flat(b, x_b, seg)
            assert pa.layers is None and pb.layers is not None  # batched, and the reference really loops
            assert _sizes(pa) == pb.layer_nbytes and pa.nbytes == pb.nbytes == sum(pb.layer_nbytes)
            assert torch.equal(pa.stats["density"], torch.stack([p.stats["density"] for p in pb.layers]))
            sent_a, sent_b = a.sent_flat(x_a, pa), Compressor.sent_flat(b, x_b, pb)
            assert torch.equal(_bits(sent_a), _bits(sent_b))
            assert torch.equal(_bits(a.decompress_flat(pa)), _bits(Compressor.decompress_flat(b, pb)))
            residual[r] = (x_a - sent_a, x_b - sent_b)
            flat_a.append(pa)
            flat_b.append(pb)
        # rank 0 decodes everyone's gathered bytes (copies, as off the wire) with its own context
        a0, b0 = ranks[0]
        out_a, out_b = torch.full((seg.total,), 7.0), torch.full((seg.total,), 7.0)
        a0.decompress_flat_mean_into([flat_a[0].with_payload(p.payload.clone(), _sizes(p)) for p in flat_a], out_a)
        Compressor.decompress_flat_mean_into(
            b0, [flat_b[0].with_payload(p.payload.clone(), p.layer_nbytes) for p in flat_b], out_b)
        assert torch.equal(_bits(out_a), _bits(out_b))
    # the same draws were made per name: the checkpointed state is the loop's
    assert ranks[1][0].state_dict() == ranks[1][1].state_dict()


def test_dgc_steps_take_every_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    # the reference's selections on _gradient's steps (what the comparison above covers): a second topk per select
    # is DGC's exact top-k of more than 1.3k survivors, a second nonzero a threshold adapted downwards
    calls = {"select": 0, "topk": 0, "nonzero": 0}

    def counting(name: str, real: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "topk", counting("topk", torch.topk))
    monkeypatch.setattr(torch, "nonzero", counting("nonzero", torch.nonzero))
    monkeypatch.setattr(DGC, "select", counting("select", DGC.select))
    seg = _segments()
    _, looping = _pair(COMPRESSORS["dgc_sparse_1d"])
    for step in range(6):
        Compressor.compress_flat(looping, _gradient(seg.total, step, 0), seg)
    assert calls["topk"] > calls["select"] and calls["nonzero"] > calls["select"]


def test_dgc_threshold_adapted_every_time_allowed() -> None:
    # spikes exactly where this step's sample looks: the sampled threshold is so high that ten times 0.8 still
    # leaves fewer than 0.8k survivors, and DGC sends those above the last threshold
    seg = _segments([(300, 200), (3, 5)])
    batched, looping = _pair(lambda: DGC(0.001))
    probe, _ = _pair(lambda: DGC(0.001))
    assert isinstance(probe, DGC)
    stride = probe.sampling(60000)[0]
    start = probe._start("layer0", stride)
    x = torch.rand(seg.total) * 1e-3
    x[start : start + 5 * stride : stride] = 1000.0
    x[start + 1 : start + 4] = 120.0  # above the 10th threshold 1000 * 0.8**10 only: off the sample
    packet, reference = batched.compress_flat(x, seg), Compressor.compress_flat(looping, x, seg)
    assert _sizes(packet) == reference.layer_nbytes == (8 * 8, 8)
    assert torch.equal(batched.sent_flat(x, packet), Compressor.sent_flat(looping, x, reference))


@pytest.mark.parametrize("name", ["topk", "dgc", "dgc_sparse_1d"])
@pytest.mark.parametrize("case", ["one_nan", "many_nans", "infinities", "zeros"])
def test_non_finite_and_zero_gradients_match_the_loop(name: str, case: str) -> None:
    # NaN ranks above everything in torch.topk and sorts first; DGC never selects it (|x| >= t is false), and
    # a NaN among the top samples makes DGC's threshold NaN: nothing is sent from that layer
    seg = _segments([(300, 200), (50, 40), (7,)])
    batched, looping = _pair(COMPRESSORS[name])
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(3))
    if case == "one_nan":
        x[5] = float("nan")
    elif case == "many_nans":
        x[100:140] = float("nan")
    elif case == "infinities":
        x[7], x[9] = float("inf"), -float("inf")
    else:
        x.zero_()
    packet, reference = batched.compress_flat(x, seg), Compressor.compress_flat(looping, x, seg)
    assert _sizes(packet) == reference.layer_nbytes
    assert torch.equal(_bits(batched.sent_flat(x, packet)), _bits(Compressor.sent_flat(looping, x, reference)))


def test_dgc_int2_loops_over_layers() -> None:
    dgc = DGC(0.01, value_dtype="int2")
    dgc.setup(0, 1, CPU)
    seg = _segments()
    packet = dgc.compress_flat(torch.randn(seg.total), seg)
    assert not dgc.batched and packet.layers is not None
    assert isinstance(packet.layer_nbytes, tuple)


def test_dgc_state_round_trips_and_resumes_the_same_draws() -> None:
    seg = _segments()
    first, _ = _pair(COMPRESSORS["dgc"])
    for step in range(2):
        first.compress_flat(_gradient(seg.total, step, 0), seg)
    resumed, _ = _pair(COMPRESSORS["dgc"])
    resumed.load_state_dict(first.state_dict())
    x = _gradient(seg.total, 2, 0)
    assert torch.equal(first.compress_flat(x, seg).payload, resumed.compress_flat(x, seg).payload)


def test_topk_ties_go_to_the_lowest_positions() -> None:
    seg = _segments([(2, 4), (3, 3)])
    topk = TopK(0.25)  # k = 2 and 3
    topk.setup(0, 1, CPU)
    topk.batch_on_cpu = True
    x = torch.tensor([1.0, 5.0, -5.0, 5.0, 0.0, 2.0, 5.0, 1.0] + [3.0, -3.0, 3.0, 3.0, 9.0, 0.0, 3.0, 0.0, 1.0])
    sent = topk.sent_flat(x, topk.compress_flat(x, seg))
    kept = torch.nonzero(sent).reshape(-1).tolist()
    assert kept == [1, 2, 8, 9, 12]


def test_decodes_a_payload_at_an_unaligned_offset() -> None:
    seg = _segments()
    for name in ("topk_fp16", "dgc"):
        c, _ = _pair(COMPRESSORS[name])
        packet = c.compress_flat(torch.randn(seg.total), seg)
        wire = torch.cat((torch.zeros(1, dtype=torch.uint8), packet.payload))[1:]  # storage offset 1
        assert wire.storage_offset() == 1
        assert torch.equal(c.decompress_flat(packet.with_payload(wire)), c.decompress_flat(packet))


def _layers(pairs: int) -> Segments:
    # weights sampled by DGC (600 > 2 / 0.01 elements) and biases sent dense
    return _segments([(30, 20), (20,)] * (pairs // 2) + [(1,), (0, 3)] * (pairs - pairs // 2))


def _step_ops(c: Compressor, seg: Segments) -> tuple[int, int, int]:
    xs = [torch.randn(seg.total) for _ in range(RANKS)]
    with count_ops() as counted:
        packets = [c.compress_flat(x, seg, c.flat_statistic(x, seg)) for x in xs]
        c.sent_flat(xs[0], packets[0])
        out = torch.empty(seg.total)
        c.decompress_flat_mean_into([packets[0].with_payload(p.payload, p.layer_nbytes) for p in packets], out)
    return counted.total, counted.host_reads, counted.data_dependent


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_ops_do_not_grow_with_the_number_of_layers(name: str) -> None:
    counts = []
    for layers in (8, 32):
        c = COMPRESSORS[name]()
        c.batch_on_cpu = True
        c.setup(0, RANKS, CPU)
        seg = _layers(layers // 2)
        _step_ops(c, seg)  # the layout's index tensors are made on first use
        counts.append(_step_ops(c, seg))
    (few, reads, dependent), (many, _, _) = counts
    assert few == many and counts[0] == counts[1]
    assert reads == 0
    # top-k: a fixed-size encoding; DGC: one nonzero per group and rank
    assert dependent == (RANKS if name.startswith("dgc") else 0)


def test_segmented_kth_largest_and_ties_match_a_sort() -> None:
    seg = _segments([(5,), (1,), (100,), (0,), (7, 3), (1000,)])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(seg.total, generator=gen)
    x[6:30] = 0.5  # ties inside the 100-element segment
    x[200], x[201], x[202] = float("inf"), -0.0, 0.0
    k = torch.tensor([3, 1, 30, 0, 21, 17])
    value, ties = segmented.kth_largest(x, seg, k)
    for s, (offset, n) in enumerate(zip(seg.offsets, seg.numels)):
        if n == 0:
            continue
        part = x[offset : offset + n]
        expected = part.sort(descending=True).values[int(k[s]) - 1]
        assert value[s] == expected
        assert ties[s] == int(k[s]) - int((part > expected).sum())
    assert ties[2] > 1  # the 30th largest of that segment is one of the tied 0.5s


def test_segmented_cumsum_restarts_at_every_segment() -> None:
    seg = _segments([(4,), (0,), (1,), (6,)])
    values = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1])
    assert segmented.cumsum(values, seg).tolist() == [1, 1, 2, 3, 1, 0, 1, 2, 2, 3, 4]


def test_order_key_round_trips_and_orders_floats() -> None:
    x = torch.tensor([-float("inf"), -2.5, -0.0, 0.0, 1e-30, 3.0, float("inf")])
    keys = segmented.order_key(x)
    assert torch.equal(_bits(segmented.from_order_key(keys)), _bits(x))
    assert bool((keys[1:] > keys[:-1]).all())


def test_dgc_refuses_a_checkpoint_of_its_former_generator_streams() -> None:
    dgc, _ = _pair(COMPRESSORS["dgc"])
    legacy = {"streams": {"layer0": ("cpu", torch.Generator().get_state())}}
    with pytest.raises(ValueError, match=r"Expected `DGC`'s random-stream state to be per-name counters.*"
                                         r"resume_compression='reset'"):
        dgc.load_state_dict(legacy)
    dgc.load_state_dict({})  # nothing saved: a fresh start
