"""Gradient Dropping's group code (a whole group of layers per call) against its per-layer oracle, bit for bit.

The oracle (:class:`~tests.oracles.graddrop.LayerGradientDropping`) is the per-layer implementation looped over the
layers; both draw the random sample from the same counter-based streams, so for every setting (sample, scope,
quantizer, index encoding, value format, gradient dtype) on both backends the group code must give the same per-layer
bytes, statistics, decoded values, ``sent``, ranks' mean and state. Unquantized ``coo32`` survivors travel as one
group payload (compared through what it decodes to); every other wire form is each layer's own encoding back to back,
so there the payloads are compared byte for byte.
"""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import GradientDropping
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import FlatPacket, Packet, Segments
from lightning_gradcomp.compressors.graddrop import Sample, Scope
from lightning_gradcomp.compressors.graddrop_group import gather_samples
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.kernels import torch_ops
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.oracles.graddrop import LayerGradientDropping

RANKS = 3
#: a 0-element and a 1-element layer, convolutions, matrices and vectors
SHAPES = [(30, 40), (1,), (0,), (8, 3, 3, 3), (2500,), (17,), (5, 4, 3)]


def _layout(shapes: Sequence[tuple[int, ...]] = SHAPES) -> Segments:
    return Segments([f"layer{i}.weight" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _gradient(seg: Segments, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seg.total, generator=gen) * torch.rand(seg.total, generator=gen) ** 4
    if len(seg) == len(SHAPES):
        x[seg.offsets[5] : seg.offsets[6]] = 0.25  # a layer of ties: nothing above its threshold
        x[:7] = 0.0
    return x


#: the settings whose unquantized coo32 survivors have a fixed number of ops per group (the Triton tests' cases too)
GRADDROP_CASES: dict[str, dict[str, Any]] = {
    "exact": dict(sample="exact"),
    "strided": dict(sample="strided", max_sample=300),
    "random": dict(sample="random", sample_fraction=0.05, min_sample=40),
    "ratio0": dict(drop_ratio=0.0, sample="exact"),
    "bf16": dict(drop_ratio=0.9, values="bf16"),
    "fp16": dict(drop_ratio=0.5, values="fp16", sample="exact"),
    "global_exact": dict(scope="global", sample="exact"),
    "global_random": dict(scope="global", drop_ratio=0.9, sample_fraction=0.05, min_sample=40),
}
#: every other setting: quantized survivors, delta16 indices (each layer's own encoding, looped inside the group code)
LAYER_CASES: dict[str, dict[str, Any]] = {
    "threshold": dict(quantize="threshold", drop_ratio=0.9, sample="exact"),
    "column_mean": dict(quantize="column_mean", drop_ratio=0.9, min_sample=40, sample_fraction=0.05),
    "global_mean-delta16": dict(quantize="global_mean", index_encoding="delta16", sample="strided", max_sample=300),
    "2bit": dict(quantize="2bit", drop_ratio=0.9, min_sample=40, sample_fraction=0.05),
    "2bit-delta16-global": dict(quantize="2bit", index_encoding="delta16", scope="global", drop_ratio=0.9,
                                min_sample=40, sample_fraction=0.05),
    "delta16": dict(index_encoding="delta16", min_sample=40, sample_fraction=0.05),
    "delta16-fp16": dict(index_encoding="delta16", values="fp16", drop_ratio=0.5, sample="exact"),
    "delta16-bf16-global": dict(index_encoding="delta16", values="bf16", scope="global", sample="exact"),
}
#: gradients of another dtype: selected from their float32 values, decoded and summed in their dtype
DTYPE_CASES: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    "bf16-grad": (dict(drop_ratio=0.9, min_sample=40, sample_fraction=0.05), torch.bfloat16),
    "fp16-grad-fp16": (dict(drop_ratio=0.5, values="fp16", sample="exact"), torch.float16),
    "bf16-grad-2bit": (dict(quantize="2bit", drop_ratio=0.9, sample="exact"), torch.bfloat16),
}
CASES: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    **{k: (v, torch.float32) for k, v in {**GRADDROP_CASES, **LAYER_CASES}.items()}, **DTYPE_CASES,
}


def _stack(looped: FlatPacket, key: str) -> Tensor:
    assert looped.layers is not None
    return torch.stack([p.stats[key].reshape(()) for p in looped.layers])


def _assert_same_packet(group: FlatPacket, looped: FlatPacket, layered: bool) -> None:
    """Per-layer bytes and statistics; the payload byte for byte where it is each layer's own encoding."""
    assert group.layers is None and looped.layers is not None
    assert group.payload.dtype == torch.uint8 and group.nbytes == looped.nbytes
    sizes = group.layer_nbytes
    assert (list(sizes) if isinstance(sizes, tuple) else sizes.tolist()) == list(looped.layer_nbytes)
    if layered:
        assert torch.equal(group.payload, looped.payload)
    assert set(group.stats) == set(looped.layers[0].stats)
    for key in group.stats:
        torch.testing.assert_close(group.stats[key], _stack(looped, key), rtol=0, atol=0, equal_nan=True, msg=key)


def _same_state(a: object, b: object) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and bool(torch.equal(a, b))


def _compare(kwargs: dict[str, Any], backend: Backend, seg: Segments, dtype: torch.dtype = torch.float32,
             steps: int = 2) -> None:
    """``RANKS`` ranks' steps through the group code and through the oracle: everything equal, bit for bit."""
    ours: list[tuple[GradientDropping, FlatPacket]] = []
    oracles: list[tuple[GradientDropping, FlatPacket]] = []
    for rank in range(RANKS):
        group, oracle = GradientDropping(backend=backend, seed=7, **kwargs), LayerGradientDropping(
            backend=backend, seed=7, **kwargs)
        for c in (group, oracle):
            c.setup(rank, RANKS, torch.device("cpu"))
        for step in range(steps):  # the random streams and the global pool advance alike
            x = (_gradient(seg, 10 * rank + step) * 1.5).to(dtype)
            a, b = group.compress_flat(x, seg), oracle.compress_flat(x, seg)
            _assert_same_packet(a, b, layered=not group._group_coo32(seg))
            decoded = group.decompress_flat(a)
            assert _equal(decoded, oracle.decompress_flat(b)) and decoded.dtype == dtype
            assert _equal(group.sent_flat(x, a), oracle.sent_flat(x, b))
        assert _same_state(group.state_dict(), oracle.state_dict())
        ours.append((group, a))
        oracles.append((oracle, b))
    # the hook hands remote sizes back as it exchanged them: host integers (a device tensor stays one for rank 1)
    received = [p.with_payload(p.payload.clone(), p.layer_nbytes if r == 1 or isinstance(p.layer_nbytes, tuple)
                               else tuple(p.layer_nbytes.tolist())) for r, (_, p) in enumerate(ours)]
    got, want = torch.full((seg.total,), float("nan"), dtype=dtype), torch.empty(seg.total, dtype=dtype)
    ours[0][0].decompress_flat_mean_into(received, got)
    oracles[0][0].decompress_flat_mean_into([p for _, p in oracles], want)
    assert _equal(got, want) and got.abs().sum() > 0


def _skip_without_kernels(backend: Backend) -> None:
    if backend == "fused" and not kernels.fused_available():
        pytest.skip("the compiled kernels do not load here")


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_group_code_equals_the_per_layer_oracle(case: str, backend: Backend) -> None:
    _skip_without_kernels(backend)
    kwargs, dtype = CASES[case]
    _compare(kwargs, backend, _layout(), dtype)


@pytest.mark.parametrize("case", ["random", "2bit-delta16-global"])
def test_group_code_on_the_kernels_torch_ops_equals_the_oracle(case: str) -> None:
    # the fused backend where the kernels do not compile (and on CUDA without Triton): their torch-ops forms
    with torch_ops():
        _compare(CASES[case][0], "fused", _layout())


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("case", ["random", "2bit-delta16-global", "delta16-fp16", "threshold"])
def test_tiny_groups_equal_the_oracle(case: str, backend: Backend) -> None:
    # only empty layers, one element, a 1-D layer between empty ones
    _skip_without_kernels(backend)
    for shapes in ([(0,)], [(1,)], [(0,), (3,), (0,), (1,)], [(64,)]):
        seg = _layout(shapes)
        if seg.total:
            _compare(CASES[case][0], backend, seg, steps=1)


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("case", ["exact", "fp16", "threshold", "column_mean", "2bit", "delta16"])
def test_per_layer_api_is_the_group_code_on_a_group_of_one(case: str, backend: Backend) -> None:
    """``compress``/``decompress``/``sent``/``decompress_sum`` of one tensor equal the oracle's per-layer code: the same
    payload bytes, statistics (0-d tensors) and decoded values."""
    _skip_without_kernels(backend)
    kwargs, _ = CASES[case]
    ours, oracle = GradientDropping(backend=backend, **kwargs), LayerGradientDropping(backend=backend, **kwargs)
    for shape in [(30, 40), (1,), (0,), (17,)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        packets: list[Packet] = []
        for c in (ours, oracle):
            packets.append(per_tensor(c).compress(x, "w"))
        a, b = packets
        assert torch.equal(a.payload, b.payload) and a.shape == b.shape and a.dtype == b.dtype
        assert a.stats.keys() == b.stats.keys() and all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)
        assert all(v.dim() == 0 for v in a.stats.values())
        assert _equal(per_tensor(ours).decompress(a), per_tensor(oracle).decompress(b)) and per_tensor(ours).decompress(a).shape == x.shape
        assert _equal(per_tensor(ours).sent(x, a), per_tensor(oracle).sent(x, b))
        assert _equal(per_tensor(ours).decompress_sum([a, a]), per_tensor(oracle).decompress_sum([b, b]))


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_nan_and_fp16_overflow_as_the_oracle(backend: Backend) -> None:
    _skip_without_kernels(backend)
    seg = _layout()
    for kwargs in (dict(values="fp16", sample="exact", drop_ratio=0.9), dict(quantize="2bit", sample="exact"),
                   dict(index_encoding="delta16", values="fp16", drop_ratio=0.9)):
        ours, oracle = GradientDropping(backend=backend, **kwargs), LayerGradientDropping(backend=backend, **kwargs)
        x = _gradient(seg, 3)
        x[:40] = float("nan")
        x[seg.offsets[4] : seg.offsets[4] + 5] = 1e6  # beyond fp16
        a, b = ours.compress_flat(x, seg), oracle.compress_flat(x, seg)
        _assert_same_packet(a, b, layered=not ours._group_coo32(seg))
        if "overflow" in a.stats:
            assert float(a.stats["overflow"][4]) == 5
        torch.testing.assert_close(ours.sent_flat(x, a), oracle.sent_flat(x, b), rtol=0, atol=0, equal_nan=True)


def test_every_setting_makes_one_group_packet_and_only_coo32_is_a_fixed_number_of_ops() -> None:
    seg = _layout()
    for case, (kwargs, dtype) in CASES.items():
        comp = GradientDropping(backend="torch", **kwargs)
        x = _gradient(seg, 0).to(dtype)
        assert comp.compress_flat(x, seg).layers is None, case
        assert comp.batched == (case in GRADDROP_CASES or case in DTYPE_CASES and "quantize" not in kwargs), case


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("sample", ["exact", "random"])
@pytest.mark.parametrize("quantize", ["none", "2bit"])
def test_global_scope_restarts_where_the_oracle_does(sample: Sample, backend: Backend, quantize: str) -> None:
    # groups change between steps (DDP rebuilds its buckets after the first): the step restarts at the first layer
    # seen again, in the middle of a group here, and the layers before it keep the previous threshold
    _skip_without_kernels(backend)
    layers = [f"layer{i}.weight" for i in range(6)]
    shapes = {name: torch.Size(s) for name, s in zip(layers, [(30, 40), (1,), (0,), (2500,), (17,), (300,)])}
    steps = [[layers[:4], layers[4:]], [layers[5:], layers[:5]], [layers[2:4], layers[4:], layers[:2]], [layers]]
    kwargs: dict[str, Any] = dict(backend=backend, scope="global", sample=sample, drop_ratio=0.95, min_sample=40,
                                  sample_fraction=0.05, quantize=quantize)
    ours, oracle = GradientDropping(**kwargs), LayerGradientDropping(**kwargs)
    for step, groups in enumerate(steps):
        for names in groups:
            seg = Segments(names, [shapes[n] for n in names])
            x = torch.randn(seg.total, generator=torch.Generator().manual_seed(step)) * (1 + step)
            a, b = ours.compress_flat(x, seg), oracle.compress_flat(x, seg)
            _assert_same_packet(a, b, layered=quantize != "none")
            assert torch.equal(ours.sent_flat(x, a), oracle.sent_flat(x, b))
        if step:
            assert ours._global_threshold is not None and oracle._global_threshold is not None
            assert torch.equal(ours._global_threshold, oracle._global_threshold)
        else:
            assert ours._global_threshold is None
    assert _same_state(ours.state_dict(), oracle.state_dict())


def _ops_per_step(make: Callable[[], Compressor], layers: int) -> tuple[int, int, int]:
    from gradcomp_lab.opcount import count_ops

    seg = _layout([(12, 10), (7,), (3, 2, 2, 2)] * (layers // 3) + [(1,)] * (layers % 3))
    comp = make()
    comp.setup(0, RANKS, torch.device("cpu"))
    grad = _gradient(_layout(SHAPES), 0)[: seg.total]

    def step() -> None:
        assert comp.flat_statistic(grad * 2, seg) is None
        packet = comp.compress_flat(grad * 2, seg)
        comp.sent_flat(grad * 2, packet)
        received = [packet.with_payload(packet.payload, packet.layer_nbytes)] * RANKS
        comp.decompress_flat_mean_into(received, torch.empty(seg.total))

    step()  # the first steps build the group's index tensors (and the global pool's weights), once
    step()
    with count_ops() as counted:
        step()
    return counted.total, counted.host_reads, counted.data_dependent


#: aten ops that CUDA runs with float atomics in no fixed order (torch lists them as nondeterministic on CUDA)
_UNORDERED_FLOAT_SUMS = ("index_add", "scatter_add", "scatter_reduce", "index_reduce", "put")


@pytest.mark.parametrize("case", ["2bit-delta16-global", "column_mean"])
def test_quantized_means_are_summed_in_a_fixed_order(case: str) -> None:
    # the quantizer's float means go on the wire: summed with atomics, two runs (or the Triton and torch paths on
    # CUDA) would send different bytes for the same survivors; the ops are the same on every device, so CPU shows it
    from gradcomp_lab.opcount import count_ops

    seg = _layout()
    comp = GradientDropping(backend="torch", seed=3, **LAYER_CASES[case])
    comp.setup(0, RANKS, torch.device("cpu"))
    x = _gradient(seg, 0)
    comp.compress_flat(x, seg)  # the first step fills the global pool
    with count_ops() as counted:
        comp.compress_flat(x, seg)
    unordered = {op: n for op, n in counted.ops.items() if op.split(".")[0].rstrip("_") in _UNORDERED_FLOAT_SUMS}
    assert not unordered, unordered


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_batched_resumes_from_its_state_exactly(backend: Backend) -> None:
    # random samples and the global pool: a run restored from a checkpoint repeats the uninterrupted one
    seg = _layout()

    def make() -> GradientDropping:
        comp = GradientDropping(backend=backend, scope="global", drop_ratio=0.9, sample_fraction=0.05, min_sample=40)
        comp.setup(1, RANKS, torch.device("cpu"))
        return comp

    steps = [_gradient(seg, s) for s in range(4)]
    through = make()
    expected = [through.compress_flat(x, seg) for x in steps]
    first = make()
    for x in steps[:2]:
        first.compress_flat(x, seg)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for x, want in zip(steps[2:], expected[2:]):
        got = resumed.compress_flat(x, seg)
        assert torch.equal(got.payload, want.payload) and torch.equal(got.stats["threshold"], want.stats["threshold"])


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_torch_group_sample_draws_the_fused_kernels_positions(compiled: bool) -> None:
    # on x = each element's flat position, every sampled |x| is the position it was drawn at
    if compiled and not kernels.fused_available():
        pytest.skip("the compiled kernels do not load here")
    seg = _layout([(30, 40), (1,), (0,), (2500,), (17,), (700,), (50, 3)])
    comp = GradientDropping(backend="torch", sample="random", sample_fraction=0.05, min_sample=40, seed=7)
    comp.setup(2, RANKS, torch.device("cpu"))
    plan = comp._sample_plan(seg, torch.device("cpu"))
    assert plan.draws.numels == (60, 0, 0, 125, 0, 40, 40)  # the two tiny layers and the empty one are not drawn
    keys = CounterStreams(7)
    keys.reset(2)
    offsets, sizes, modes, _, _ = plan.kernel_args
    position = torch.arange(seg.total, dtype=torch.float32)
    for _ in range(2):  # the counters move on alike
        ours = gather_samples(position, plan, comp._keys.bits_flat(plan.draws, torch.device("cpu")))
        table = torch.tensor(keys.keys(plan.draws), dtype=torch.int64)
        if compiled:
            theirs = kernels.graddrop_group_sample(position, offsets, sizes, modes, table)
        else:
            with torch_ops():
                theirs = kernels.graddrop_group_sample(position, offsets, sizes, modes, table)
        assert torch.equal(ours, theirs)
        drawn = ours[plan.segments.offsets[0] : plan.segments.offsets[1]]
        assert drawn.min() >= 0 and drawn.max() < 1200 and drawn.unique().numel() > 40  # uniform over the layer
    assert comp._keys.counters == keys.counters == {n: 2 for n in ("layer0.weight", "layer3.weight", "layer5.weight",
                                                                    "layer6.weight")}


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_torch_and_fused_backends_select_the_same_random_samples(scope: Scope) -> None:
    # the same positions, so the same thresholds and survivors, per group as the oracle per layer; the same counters
    seg = _layout()

    def make(backend: Backend, oracle: bool = False) -> GradientDropping:
        comp = (LayerGradientDropping if oracle else GradientDropping)(
            backend=backend, scope=scope, drop_ratio=0.9, sample_fraction=0.05, min_sample=40)
        comp.setup(1, RANKS, torch.device("cpu"))
        return comp

    ref, fused, looped = make("torch"), make("fused"), make("torch", oracle=True)
    if not fused.batched:
        pytest.skip("the compiled kernels do not load here")
    for step in range(3):
        x = _gradient(seg, step)
        a, b = ref.compress_flat(x, seg), fused.compress_flat(x, seg)
        assert torch.equal(a.stats["threshold"], b.stats["threshold"]) and torch.equal(a.payload, b.payload)
        per_layer = torch.stack([per_tensor(looped).compress(x[o : o + n], name).stats["threshold"]
                                 for name, o, n in zip(seg.names, seg.offsets, seg.numels)])
        assert torch.equal(a.stats["threshold"], per_layer)
    assert ref.state_dict()["counters"] == fused.state_dict()["counters"] == looped.state_dict()["counters"]
    assert ref.state_dict()["counters"] == {f"layer{i}.weight": 3 for i in (0, 3, 4, 6)}  # the layers over 40


@pytest.mark.parametrize("sample", ["random", "strided", "exact"])
def test_threshold_of_one_tensor_equals_the_oracle(sample: Sample) -> None:
    # ``threshold(|x|, name)`` (benchmarks/graddrop_global_threshold.py's shadows): the group of one, pool included
    ours, oracle = (cls(scope="global", sample=sample, min_sample=20, max_sample=100)
                    for cls in (GradientDropping, LayerGradientDropping))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for name, shape in (("a", (30, 40)), ("b", (7,)), ("c", (500,))):
            magnitudes = torch.randn(shape, generator=gen).abs()
            assert torch.equal(ours.threshold(magnitudes, name), oracle.threshold(magnitudes.reshape(-1), name))
    assert ours._global_threshold is not None and _same_state(ours.state_dict(), oracle.state_dict())
