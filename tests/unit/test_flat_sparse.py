"""TopK and DGC on a whole group of layers: the group code (the one implementation, on every device) gives what the
per-layer oracle (``tests/oracles/topk.py``) gives, bit for bit, for every setting and either selection (a
``torch.topk`` per layer, or the batched ops a GPU runs without Triton): selection, wire bytes per layer, stats,
``sent``, the ranks' mean. The batched selection runs a number of ops that does not depend on the number of layers,
with no host read; ties at a layer's k-th largest go to the lowest positions whichever selection runs."""

from collections.abc import Callable

import pytest
import torch

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp.compressors import DGC, TopK
from lightning_gradcomp.compressors.topk_kernels import TorchTopK
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.kernels import segmented
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.oracles.topk import LayerDGC, LayerTopK

CPU = torch.device("cpu")
RANKS = 3
SELECTIONS = ("loop", "batched")

#: mixed shapes: sampled DGC layers (> 2 / ratio elements), small exact ones, 1-element and 0-element layers, 1-D
SHAPES = [(40, 30), (1,), (0, 4), (7,), (300, 200), (1, 1), (5000,), (2, 3, 4), (9000,)]

#: every setting: (group compressor, its per-layer oracle) of the same options
SETTINGS: dict[str, tuple[type[TopK], dict[str, object]]] = {
    "topk": (TopK, {"ratio": 0.01}),
    "topk_sparse_1d": (TopK, {"ratio": 0.02, "dense_1d": False}),
    "topk_fp16": (TopK, {"ratio": 0.05, "value_dtype": "fp16"}),
    "topk_int2": (TopK, {"ratio": 0.03, "value_dtype": "int2"}),
    "topk_int2_sparse_1d": (TopK, {"ratio": 0.03, "value_dtype": "int2", "dense_1d": False}),
    "topk_all": (TopK, {"ratio": 1.0, "dense_1d": False}),
    "dgc": (DGC, {"ratio": 0.01}),
    "dgc_sparse_1d": (DGC, {"ratio": 0.001, "dense_1d": False}),
    "dgc_fp16": (DGC, {"ratio": 0.02, "value_dtype": "fp16"}),
    "dgc_int2_sparse_1d": (DGC, {"ratio": 0.01, "value_dtype": "int2", "dense_1d": False}),
    "dgc_no_adaptation": (DGC, {"ratio": 0.01, "max_adaptation_iters": 0}),
    "dgc_bounds": (DGC, {"ratio": 0.005, "sample_ratio": 0.05, "upper_bound": 1.05, "lower_bound": 0.95}),
}
ORACLES: dict[type[TopK], type[TopK]] = {TopK: LayerTopK, DGC: LayerDGC}


def _segments(shapes: list[tuple[int, ...]] = SHAPES) -> Segments:
    return Segments([f"layer{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _pair(setting: str, selection: str = "loop", rank: int = 0) -> tuple[TopK, TopK]:
    """(the group code with ``selection``, the per-layer oracle) of ``setting``, set up as ``rank``."""
    cls, options = SETTINGS[setting]
    group, oracle = cls(**options), ORACLES[cls](**options)  # type: ignore[arg-type]
    for c in (group, oracle):
        c.setup(rank, RANKS, CPU)
    group.selection = selection  # type: ignore[assignment]
    return group, oracle


def _gradient(total: int, step: int, rank: int) -> torch.Tensor:
    """Dense Gaussian steps, and every second step a spiky one: 0.1% of the elements Gaussian, the others 10^4 times
    smaller (DGC's sample then misses the few large values: its threshold is too low and an exact top-k follows, or
    too high and it adapts downwards). No ties at any layer's k-th largest: there ``torch.topk`` (the oracle) picks
    among equal values as its kernel happens to."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(total, generator=gen)
    if step % 2:
        x = x * torch.where(torch.rand(total, generator=gen) < 0.001, 1.0, 1e-4)
    return x


def _sizes(packet: FlatPacket) -> tuple[int, ...]:
    nbytes = packet.layer_nbytes
    return tuple(nbytes.tolist()) if isinstance(nbytes, torch.Tensor) else nbytes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and +0.0 differ, NaN payloads compare


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_group_code_equals_the_oracle_bit_for_bit(setting: str, selection: str) -> None:
    seg = _segments()
    ranks = [_pair(setting, selection, r) for r in range(RANKS)]
    residual = [(torch.zeros(seg.total), torch.zeros(seg.total)) for _ in range(RANKS)]
    steps = 3
    for step in range(steps):
        flat_a, flat_b = [], []
        for r, ((a, b), (res_a, res_b)) in enumerate(zip(ranks, residual)):
            g = _gradient(seg.total, step, r)
            x_a, x_b = g + res_a, g + res_b
            pa, pb = a.compress_flat(x_a, seg, a.flat_statistic(x_a, seg)), b.compress_flat(x_b, seg)
            assert pa.layers is None and pb.layers is not None  # one group packet, and the oracle really loops
            assert _sizes(pa) == pb.layer_nbytes and pa.nbytes == pb.nbytes == sum(pb.layer_nbytes)
            assert torch.equal(pa.stats["density"], torch.stack([p.stats["density"] for p in pb.layers]))
            sent_a, sent_b = a.sent_flat(x_a, pa), b.sent_flat(x_b, pb)
            assert torch.equal(_bits(sent_a), _bits(sent_b))
            assert torch.equal(_bits(a.decompress_flat(pa)), _bits(b.decompress_flat(pb)))
            residual[r] = (x_a - sent_a, x_b - sent_b)
            flat_a.append(pa)
            flat_b.append(pb)
        # rank 0 decodes everyone's gathered bytes (copies, as off the wire) with its own context
        a0, b0 = ranks[0]
        out_a, out_b = torch.full((seg.total,), 7.0), torch.full((seg.total,), 7.0)
        a0.decompress_flat_mean_into([flat_a[0].with_payload(p.payload.clone(), _sizes(p)) for p in flat_a], out_a)
        b0.decompress_flat_mean_into([flat_b[0].with_payload(p.payload.clone(), p.layer_nbytes) for p in flat_b], out_b)
        assert torch.equal(_bits(out_a), _bits(out_b))
    # the same draws were made per name: the checkpointed state is the oracle's
    assert ranks[1][0].state_dict() == ranks[1][1].state_dict()


@pytest.mark.parametrize("setting", ["topk", "topk_int2_sparse_1d", "dgc_sparse_1d", "dgc_int2_sparse_1d"])
def test_the_per_layer_api_is_the_group_code_on_a_group_of_one(setting: str) -> None:
    # compress / decompress / sent / decompress_sum of one tensor: the oracle's selection and decoded bits; the
    # payload is the group layout's (indices before values), the same number of bytes
    group, oracle = _pair(setting)
    for name, shape in [("w", (300, 200)), ("b", (50,)), ("one", (1,)), ("empty", (0, 3))]:
        xs = [_gradient(torch.Size(shape).numel(), step, 0).view(shape) for step in range(3)]
        packets = [per_tensor(group).compress(x, name) for x in xs]
        references = [per_tensor(oracle).compress(x, name) for x in xs]
        for x, p, q in zip(xs, packets, references):
            assert p.nbytes == q.nbytes and p.shape == q.shape and torch.equal(p.stats["density"], q.stats["density"])
            assert torch.equal(_bits(per_tensor(group).decompress(p)), _bits(per_tensor(oracle).decompress(q)))
            assert torch.equal(_bits(per_tensor(group).sent(x, p)), _bits(per_tensor(oracle).sent(x, q)))
        assert torch.equal(_bits(per_tensor(group).decompress_sum(packets)), _bits(per_tensor(oracle).decompress_sum(references)))


def test_dgc_steps_take_every_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    # the oracle's selections on _gradient's steps (what the comparison above covers): a second topk per select
    # is DGC's exact top-k of more than 1.3k survivors, a second nonzero a threshold adapted downwards
    calls = {"select": 0, "topk": 0, "nonzero": 0}

    def counting(name: str, real: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "topk", counting("topk", torch.topk))
    monkeypatch.setattr(torch, "nonzero", counting("nonzero", torch.nonzero))
    monkeypatch.setattr(LayerDGC, "select", counting("select", LayerDGC.select))
    seg = _segments()
    _, oracle = _pair("dgc_sparse_1d")
    for step in range(3):
        oracle.compress_flat(_gradient(seg.total, step, 0), seg)
    assert calls["topk"] > calls["select"] and calls["nonzero"] > calls["select"]


@pytest.mark.parametrize("selection", SELECTIONS)
def test_dgc_threshold_adapted_every_time_allowed(selection: str) -> None:
    # spikes exactly where this step's sample looks: the sampled threshold is so high that ten times 0.8 still
    # leaves fewer than 0.8k survivors, and DGC sends those above the last threshold
    seg = _segments([(300, 200), (3, 5)])
    group, oracle = _pair("dgc", selection)
    group.ratio = oracle.ratio = 0.001
    probe, _ = _pair("dgc")
    probe.ratio = 0.001
    assert isinstance(probe, DGC)
    stride = probe.sampling(60000)[0]
    start = probe._start("layer0", stride)
    x = torch.rand(seg.total) * 1e-3
    x[start : start + 5 * stride : stride] = 1000.0
    x[start + 1 : start + 4] = 120.0  # above the 10th threshold 1000 * 0.8**10 only: off the sample
    packet, reference = group.compress_flat(x, seg), oracle.compress_flat(x, seg)
    assert _sizes(packet) == reference.layer_nbytes == (8 * 8, 8)
    assert torch.equal(group.sent_flat(x, packet), oracle.sent_flat(x, reference))


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("name", ["topk", "dgc", "dgc_sparse_1d"])
@pytest.mark.parametrize("case", ["one_nan", "many_nans", "infinities", "zeros"])
def test_non_finite_and_zero_gradients_match_the_oracle(name: str, case: str, selection: str) -> None:
    # NaN ranks above everything in torch.topk and sorts first; DGC never selects it (|x| >= t is false), and
    # a NaN among the top samples makes DGC's threshold NaN: nothing is sent from that layer
    seg = _segments([(300, 200), (50, 40), (7,)])
    group, oracle = _pair(name, selection)
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(3))
    if case == "one_nan":
        x[5] = float("nan")
    elif case == "many_nans":
        x[100:140] = float("nan")
    elif case == "infinities":
        x[7], x[9] = float("inf"), -float("inf")
    else:
        x.zero_()
    packet, reference = group.compress_flat(x, seg), oracle.compress_flat(x, seg)
    assert _sizes(packet) == reference.layer_nbytes
    assert torch.equal(_bits(group.sent_flat(x, packet)), _bits(oracle.sent_flat(x, reference)))


@pytest.mark.parametrize("selection", SELECTIONS)
def test_dgc_int2_sizes_are_host_integers_and_decode_per_rank(selection: str) -> None:
    # int2's codes are padded per layer: the group packet's sizes are host integers, and each rank's payload
    # decodes with its own counts (the ranks select different numbers)
    seg = _segments()
    ranks = [_pair("dgc_int2_sparse_1d", selection, r)[0] for r in range(2)]
    packets = [c.compress_flat(_gradient(seg.total, 2, r), seg) for r, c in enumerate(ranks)]
    assert all(p.layers is None and isinstance(p.layer_nbytes, tuple) for p in packets)
    assert packets[0].layer_nbytes != packets[1].layer_nbytes
    received = [packets[0].with_payload(p.payload.clone(), p.layer_nbytes) for p in packets]
    out = torch.empty(seg.total)
    ranks[0].decompress_flat_mean_into(received, out)
    total = ranks[0].decompress_flat(received[0]) + ranks[0].decompress_flat(received[1])
    assert torch.equal(out, total / 2)
    assert torch.equal(ranks[0].decompress_flat(received[1]), ranks[1].sent_flat(torch.empty(0), packets[1]))


def test_dgc_state_round_trips_and_resumes_the_same_draws() -> None:
    seg = _segments()
    first, _ = _pair("dgc")
    for step in range(2):
        first.compress_flat(_gradient(seg.total, step, 0), seg)
    resumed, _ = _pair("dgc")
    resumed.load_state_dict(first.state_dict())
    x = _gradient(seg.total, 2, 0)
    assert torch.equal(first.compress_flat(x, seg).payload, resumed.compress_flat(x, seg).payload)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_topk_ties_go_to_the_lowest_positions(selection: str) -> None:
    seg = _segments([(2, 4), (3, 3)])
    topk = TopK(0.25)  # k = 2 and 3
    topk.setup(0, 1, CPU)
    topk.selection = selection  # type: ignore[assignment]
    x = torch.tensor([1.0, 5.0, -5.0, 5.0, 0.0, 2.0, 5.0, 1.0] + [3.0, -3.0, 3.0, 3.0, 9.0, 0.0, 3.0, 0.0, 1.0])
    sent = topk.sent_flat(x, topk.compress_flat(x, seg))
    kept = torch.nonzero(sent).reshape(-1).tolist()
    assert kept == [1, 2, 8, 9, 12]


def _ties(total: int, step: int) -> torch.Tensor:
    """Values on a coarse grid (many ties at every layer's k-th largest), -0.0s, mostly zeros every second step,
    and NaN and +-inf."""
    gen = torch.Generator().manual_seed(step)
    x = (torch.randn(total, generator=gen) * 2).round() / 4
    x[torch.rand(total, generator=gen) < 0.05] = -0.0
    if step % 2:
        x = x * (torch.rand(total, generator=gen) < 0.02)
    special = torch.tensor([5, 1300, 1301, 1900, 40000]) % total
    x[special] = torch.tensor([float("nan"), -float("inf"), float("nan"), float("inf"), float("nan")])
    return x


@pytest.mark.parametrize("setting", ["topk_sparse_1d", "topk_int2_sparse_1d", "dgc_sparse_1d", "dgc", "dgc_bounds"])
def test_both_selections_send_the_same_bits_on_ties_and_non_finite_values(setting: str) -> None:
    # where torch.topk's choice among ties is its kernel's, the loop keeps the lowest positions as the sorts do
    seg = _segments()
    loop, batched = _pair(setting, "loop")[0], _pair(setting, "batched")[0]
    for step in range(2):
        x = _ties(seg.total, step)
        p, q = loop.compress_flat(x, seg), batched.compress_flat(x, seg)
        assert torch.equal(p.payload, q.payload) and _sizes(p) == _sizes(q)
        assert torch.equal(p.stats["density"], q.stats["density"])


def test_top_k_of_a_layer_is_a_stable_sorts_first_k() -> None:
    from lightning_gradcomp.compressors.topk_group import top_k_segment

    x = _ties(3000, 1).abs()
    for k in (1, 7, 60, 2999, 3000):
        expected = torch.sort(x, descending=True, stable=True).indices[:k].sort().values
        assert torch.equal(top_k_segment(x, k), expected), k


def test_decodes_a_payload_at_an_unaligned_offset() -> None:
    seg = _segments()
    for name in ("topk_fp16", "dgc"):
        c, _ = _pair(name)
        packet = c.compress_flat(torch.randn(seg.total), seg)
        wire = torch.cat((torch.zeros(1, dtype=torch.uint8), packet.payload))[1:]  # storage offset 1
        assert wire.storage_offset() == 1
        assert torch.equal(c.decompress_flat(packet.with_payload(wire)), c.decompress_flat(packet))


def _layers(pairs: int) -> Segments:
    # weights sampled by DGC (600 > 2 / 0.01 elements) and biases sent dense
    return _segments([(30, 20), (20,)] * (pairs // 2) + [(1,), (0, 3)] * (pairs - pairs // 2))


def _step_ops(c: TopK, seg: Segments) -> tuple[int, int, int]:
    xs = [torch.randn(seg.total) for _ in range(RANKS)]
    with count_ops() as counted:
        packets = [c.compress_flat(x, seg, c.flat_statistic(x, seg)) for x in xs]
        c.sent_flat(xs[0], packets[0])
        out = torch.empty(seg.total)
        c.decompress_flat_mean_into([packets[0].with_payload(p.payload, p.layer_nbytes) for p in packets], out)
    return counted.total, counted.host_reads, counted.data_dependent


@pytest.mark.parametrize("name", ["topk", "topk_fp16", "topk_int2_sparse_1d", "dgc", "dgc_sparse_1d", "dgc_fp16"])
def test_batched_selection_ops_do_not_grow_with_the_number_of_layers(name: str) -> None:
    counts = []
    for layers in (8, 32):
        c, _ = _pair(name, "batched")
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
    dgc, _ = _pair("dgc")
    legacy = {"streams": {"layer0": ("cpu", torch.Generator().get_state())}}
    with pytest.raises(ValueError, match=r"Expected `DGC`'s random-stream state to be per-name counters.*"
                                         r"resume_compression='reset'"):
        dgc.load_state_dict(legacy)
    dgc.load_state_dict({})  # nothing saved: a fresh start


def test_the_selection_is_chosen_by_device_and_checked() -> None:
    topk = TopK(0.05)
    topk.setup(0, 1, CPU)
    x = torch.randn(100)
    torch_ops = TorchTopK(topk)
    assert torch_ops.selecting(x) == "loop"  # a CPU's partial selections
    topk.selection = "batched"
    assert torch_ops.selecting(x) == "batched"
    topk.selection = "sorted"  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"Expected `selection` to be one of \['loop', 'batched'\] or None but got "
                                         r"'sorted'\. Fix:"):
        topk.compress_flat(x, _segments([(10, 10)]))
