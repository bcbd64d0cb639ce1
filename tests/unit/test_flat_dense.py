"""The dense baselines, written once at group level, against their per-layer oracle (``tests/oracles/dense.py``).

For fp32, fp16/bf16, int8, QSGD and 1-bit SGD, on a group of layers of mixed shapes (a 1-element and a 0-element
layer among them): ``compress_flat`` / ``decompress_flat`` (SUM) or ``decompress_flat_mean_into`` (GATHER) /
``sent_flat`` give what the oracle's loop over its per-layer methods gives, bit for bit (int8's and QSGD's draws
included: their counter-based streams draw per layer in one call), with the same per-layer bytes and statistics
(1-bit SGD, whose per-row means have no other statement than its group code, against its own layers one by one);
and they dispatch the same number of ops for 8 and 32 layers, with no host read.
"""

import gc
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from gradcomp_lab.opcount import OpCount, count_ops
from lightning_gradcomp.wire.bits import pack_bits
from lightning_gradcomp.compressors import BF16, FP16, QSGD, Identity, OneBit
from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.int8 import Int8
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.oracles.dense import LayerCast, LayerIdentity, LayerInt8, LayerQSGD

RANKS = 3
SHAPES = [torch.Size(s) for s in [(6, 5), (1,), (0,), (37,), (3, 2, 4), (0, 4), (2, 700), (9,)]]

FACTORIES: dict[str, Callable[[], Compressor]] = {
    "fp32": Identity,
    "fp16": FP16,
    "bf16": BF16,
    "int8": lambda: Int8(seed=3),
    "qsgd": lambda: QSGD(levels=5, bucket_size=16, seed=3),
    "qsgd-paper": lambda: QSGD(),
    "onebit-row": lambda: OneBit("row"),
    "onebit-tensor": lambda: OneBit("tensor"),
}

#: the per-layer oracle of each (``None``: the base class's loop over the compressor's own per-layer methods)
ORACLES: dict[str, Callable[[], Compressor] | None] = {
    "fp32": LayerIdentity,
    "fp16": lambda: LayerCast(torch.float16),
    "bf16": lambda: LayerCast(torch.bfloat16),
    "int8": lambda: LayerInt8(seed=3),
    "qsgd": lambda: LayerQSGD(levels=5, bucket_size=16, seed=3),
    "qsgd-paper": lambda: LayerQSGD(),
    "onebit-row": None,
    "onebit-tensor": None,
}


def _group(shapes: list[torch.Size], seed: int = 0) -> tuple[Segments, list[Tensor]]:
    """A layout and one flat fp32 gradient per rank (values of several magnitudes, exact zeros among them)."""
    gen = torch.Generator().manual_seed(seed)
    segments = Segments([f"layer{i}.weight" for i in range(len(shapes))], shapes)
    flats = []
    for _ in range(RANKS):
        x = torch.randn(segments.total, generator=gen) * torch.rand(segments.total, generator=gen).pow(4) * 10
        flats.append(torch.where(torch.rand(segments.total, generator=gen) < 0.1, 0.0, x))
    return segments, flats


def _ranks(name: str, oracle: bool = False) -> list[Compressor]:
    """One compressor (or its oracle) per rank, set up for a group of :data:`RANKS`."""
    out = []
    for rank in range(RANKS):
        make = ORACLES[name] if oracle else FACTORIES[name]
        compressor = (make or FACTORIES[name])()
        compressor.setup(rank, RANKS, torch.device("cpu"))
        out.append(compressor)
    return out


def _exchange(batched: bool, compressors: list[Compressor], segments: Segments, flats: list[Tensor]) -> dict:
    """One simulated exchange of the group: the hook's steps, through the compressors' group methods or the base
    class's loop over their per-layer methods (an oracle's group methods are that loop)."""
    call = (lambda method, c, *args: getattr(c, method)(*args)) if batched else (
        lambda method, c, *args: getattr(per_tensor(c), method)(*args))
    statistics = [call("flat_statistic", c, x, segments) for c, x in zip(compressors, flats)]
    shared = None
    if statistics[0] is not None:
        reduced = torch.stack([s.values for s in statistics]).amax(0)  # the hook's max all-reduce
        shared = statistics[0].with_values(reduced)
    packets: list[FlatPacket] = [call("compress_flat", c, x, segments, shared) for c, x in zip(compressors, flats)]
    sent = [call("sent_flat", c, x, p) for c, x, p in zip(compressors, flats, packets)]
    head = compressors[0]
    if head.aggregation is Aggregation.SUM:
        summed = torch.stack([p.payload for p in packets]).sum(0, dtype=packets[0].payload.dtype)  # the all-reduce
        decoded = call("decompress_flat", head, packets[0].with_payload(summed))
    else:
        raw = [p.payload.view(torch.uint8) if p.payload.dtype != torch.uint8 else p.payload for p in packets]
        mine = packets[0]
        theirs = [mine.with_payload(r if mine.payload.dtype == torch.uint8 else r.view(mine.payload.dtype),
                                    layer_nbytes=p.layer_nbytes) for r, p in zip(raw, packets)]
        decoded = call("decompress_flat_mean_into", head, theirs, torch.empty(segments.total))
    return {"payloads": [p.payload for p in packets], "layer_nbytes": [tuple(p.layer_nbytes) for p in packets],
            "sent": sent, "decoded": decoded, "stats": [_stats(p) for p in packets],
            "state": [c.state_dict() for c in compressors]}


def _stats(packet: FlatPacket) -> dict[str, Tensor]:
    """Per-layer statistics as ``[layers]`` vectors (the loop keeps them on its per-layer packets)."""
    if packet.layers is None:
        return packet.stats
    return {k: torch.stack([p.stats[k].reshape(()) for p in packet.layers]) for k in packet.layers[0].stats}


def _assert_identical(a: object, b: object, where: str = "") -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("name", list(FACTORIES))
def test_group_code_equals_the_per_layer_oracle(name: str) -> None:
    segments, flats = _group(SHAPES)
    batched, looped = _ranks(name), _ranks(name, oracle=True)
    assert all(getattr(c, "batched", False) for c in batched)
    for step in range(2):  # a second step: the random streams moved on identically
        got = _exchange(True, batched, segments, flats)
        want = _exchange(ORACLES[name] is not None, looped, segments, flats)
        _assert_identical(got, want, f"step {step}")
    # each layer's bytes are its per-layer packet's, and the group payload is all of them
    payload = got["payloads"][0]
    per_layer = [per_tensor(looped[0]).compress(x, n).nbytes for n, x in segments.items(flats[0])]
    assert list(got["layer_nbytes"][0]) == per_layer and sum(per_layer) == payload.numel() * payload.element_size()
    assert all(type(n) is int for n in got["layer_nbytes"][0])


def _count(name: str, layers: int) -> OpCount:
    shapes = [torch.Size((3 + i % 4, 2 + i % 3)) if i % 2 else torch.Size((5 + i,)) for i in range(layers)]
    segments, flats = _group(shapes)
    compressors = _ranks(name)
    _exchange(True, compressors, segments, flats)  # first use builds the layout's index tensors (cached after)
    with count_ops() as counted:
        _exchange(True, compressors, segments, flats)
    return counted


@pytest.mark.parametrize("name", list(FACTORIES))
def test_batched_ops_do_not_grow_with_the_number_of_layers(name: str) -> None:
    few, many = _count(name, 8), _count(name, 32)
    assert few.total == many.total, (few.ops - many.ops) + (many.ops - few.ops)
    assert few.host_reads == many.host_reads == 0
    assert few.data_dependent == many.data_dependent == 0


# -- the draws: counter-based per-name streams ----------------------------------------------------------------------
def test_a_group_draws_what_its_layers_draw_one_by_one() -> None:
    segments, _ = _group(SHAPES)
    together, alone = CounterStreams(7), CounterStreams(7)
    together.reset(1)
    alone.reset(1)
    for _ in range(2):
        cpu = torch.device("cpu")
        expected = torch.cat([alone.uniform(name, n, cpu) for name, n in zip(segments.names, segments.numels)])
        assert torch.equal(together.uniform_flat(segments, torch.device("cpu")), expected)
    drawn = {name: 2 for name, n in zip(segments.names, segments.numels) if n}  # an empty layer draws nothing
    assert together.counters == alone.counters == drawn
    # distinct layers, ranks and steps draw distinct numbers
    twin = Segments(["a", "b"], [torch.Size([64])] * 2)
    first = CounterStreams(7).uniform_flat(twin, torch.device("cpu"))
    assert not torch.equal(first[:64], first[64:])
    other_rank = CounterStreams(7)
    other_rank.reset(2)
    assert not torch.equal(other_rank.uniform_flat(twin, torch.device("cpu")), first)


@pytest.mark.parametrize("name", ["int8", "qsgd"])
def test_stream_state_round_trips_and_old_generator_states_are_refused(name: str) -> None:
    segments, flats = _group(SHAPES)
    ran, resumed = _ranks(name)[0], _ranks(name)[0]
    shared = ran.flat_statistic(flats[0], segments)
    ran.compress_flat(flats[0], segments, shared)
    resumed.load_state_dict(ran.state_dict())
    assert torch.equal(ran.compress_flat(flats[1], segments, shared).payload,
                       resumed.compress_flat(flats[1], segments, shared).payload)
    generator_state = {"streams": {"layer0.weight": ("cpu", torch.Generator().get_state())}}
    with pytest.raises(ValueError, match="resume_compression='reset'"):
        resumed.load_state_dict(generator_state)


def test_int8_batched_rounding_is_unbiased_with_the_bernoulli_variance() -> None:
    segments, flats = _group([torch.Size([40]), torch.Size([1]), torch.Size([5, 6])])
    compressor = Int8(seed=1)
    compressor.setup(0, 2, torch.device("cpu"))  # 2 ranks: 63 levels
    x = flats[0]
    shared = compressor.flat_statistic(x, segments)
    assert shared is not None
    draws = 1000
    packets = [compressor.compress_flat(x, segments, shared) for _ in range(draws)]
    samples = torch.stack([compressor.decompress_flat(p) for p in packets])
    step = segments.expand(shared.values / compressor.levels)
    frac = (x.abs() / step).frac()
    variance = step**2 * frac * (1 - frac)  # one Bernoulli(frac) step of size scale / L
    excess = (samples.mean(0) - x).abs() - 5 * (variance / draws).sqrt()
    assert excess.max() < 1e-5, excess.max()
    # the summed variance (each element's sample variance alone is too noisy where frac is near 0 or 1)
    torch.testing.assert_close(samples.var(0).sum(), variance.sum(), rtol=0.05, atol=0)


def test_qsgd_batched_rounding_has_the_bernoulli_variance() -> None:
    segments, flats = _group([torch.Size([40]), torch.Size([1]), torch.Size([5, 6])])
    compressor = QSGD(levels=3, bucket_size=16, seed=1)
    compressor.setup(0, 1, torch.device("cpu"))
    x = flats[0]
    draws = 1000
    samples = torch.stack([compressor.decompress_flat(compressor.compress_flat(x, segments)) for _ in range(draws)])
    padding = segments.padding(16)
    norms = padding.pad(x).view(-1, 16).norm(dim=1).index_select(0, padding.index(x.device) // 16)
    frac = (x.abs() / norms * 3).frac()
    variance = (norms / 3) ** 2 * frac * (1 - frac)
    excess = (samples.mean(0) - x).abs() - 5 * (variance / draws).sqrt()
    assert excess.max() < 1e-5, excess.max()
    # the summed variance (each element's sample variance alone is too noisy where frac is near 0 or 1)
    torch.testing.assert_close(samples.var(0).sum(), variance.sum(), rtol=0.05, atol=0)


def test_onebit_wire_format_is_unchanged() -> None:
    """Signs bit-packed then (pos, neg) means per row as float32: what a per-layer packet has always carried."""
    x = torch.randn(5, 13)
    packet = per_tensor(OneBit("row")).compress(x, "w")
    positive = x >= 0
    zero = x.new_zeros(())
    means = [torch.stack((r[p].mean() if p.any() else zero, -r[~p].mean() if (~p).any() else zero))
             for r, p in zip(x, positive)]
    expected = torch.cat((pack_bits(positive, 1), torch.stack(means).reshape(-1).view(torch.uint8)))
    assert packet.payload.shape == expected.shape
    assert torch.equal(packet.payload[: math.ceil(65 / 8)], expected[: math.ceil(65 / 8)])
    scales = packet.payload[math.ceil(65 / 8) :].clone().view(torch.float32)
    torch.testing.assert_close(scales, expected[math.ceil(65 / 8) :].clone().view(torch.float32), rtol=1e-6, atol=0)


def test_layouts_derived_from_a_group_go_with_it() -> None:
    """The layouts cached per group (bit paddings, buckets, rows) are freed with its Segments: nothing in them
    refers back to it."""
    from lightning_gradcomp.compressors import grouped

    compressors = [_ranks("qsgd")[0], _ranks("onebit-row")[0]]
    gc.collect()  # the groups of earlier tests
    before = len(grouped._DERIVED)
    segments, flats = _group(SHAPES)
    for compressor in compressors:
        compressor.compress_flat(flats[0], segments)
    assert len(grouped._DERIVED) == before + 1
    del segments
    gc.collect()
    assert len(grouped._DERIVED) == before
