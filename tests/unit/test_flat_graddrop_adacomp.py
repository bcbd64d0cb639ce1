"""AdaComp over a group of layers in one flat tensor: the batched torch path against its per-layer oracle
(:mod:`tests.oracles.adacomp`), bit for bit; both sparse compressors' op counts and group kernels. Gradient Dropping's
group code against its per-layer oracle: ``tests/unit/test_flat_graddrop.py``."""

from collections.abc import Callable
from typing import Any, Optional, cast

import pytest
import torch
from torch import Tensor

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.adacomp import Quantizer
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.base import Compressor, GradientObserver
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.kernels import torch_ops
from lightning_gradcomp.compressors.per_tensor import PerTensor
from tests.oracles.adacomp import LayerAdaComp

RANKS = 3
#: a 0-element and a 1-element layer, convolutions (AdaComp's L_T 50) and matrices (L_T 500), a partial last bin
SHAPES = [(30, 40), (1,), (0,), (8, 3, 3, 3), (2500,), (17,), (5, 4, 3)]


def _layout(shapes: list[tuple[int, ...]] = SHAPES) -> Segments:
    return Segments([f"layer{i}.weight" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _gradient(seg: Segments, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seg.total, generator=gen) * torch.rand(seg.total, generator=gen) ** 4
    x[seg.offsets[5] : seg.offsets[6]] = 0.25  # a layer of ties: nothing above its threshold
    x[seg.offsets[0] : seg.offsets[0] + 7] = 0.0
    return x


def _assert_same_stats(batched: FlatPacket, looped: FlatPacket) -> None:
    assert looped.layers is not None and batched.layers is None
    for key in looped.layers[0].stats:
        expected = torch.stack([p.stats[key].reshape(()) for p in looped.layers])
        assert torch.equal(batched.stats[key], expected), key
    assert set(batched.stats) == set(looped.layers[0].stats)


def _same_state(a: object, b: object) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


def _compare(
    make: Callable[[], Compressor], seg: Segments, residuals: bool = False,
    reference: Optional[Callable[[], Compressor]] = None,
) -> None:
    """Three ranks' steps, batched and looped (``reference``'s per-layer methods, else ``make``'s): packets, sizes,
    stats, sent and the gathered mean, bit for bit."""
    batched, looped = [], []
    for rank in range(RANKS):
        fast, slow = make(), (reference or make)()
        for c in (fast, slow):
            c.setup(rank, RANKS, torch.device("cpu"))
        if getattr(fast, "backend", "torch") == "fused" and not kernels.fused_available():
            pytest.skip("the compiled kernels do not load here (the fused backend then loops over the layers)")
        assert getattr(fast, "batched", False) and type(fast).compress_flat is not Compressor.compress_flat
        for step in range(2):  # twice: the random streams advance the same way
            grad = _gradient(seg, 10 * rank + step)
            x = grad * 1.5 if residuals else grad  # a compensated tensor differs from the fresh gradient
            if isinstance(fast, GradientObserver):
                fast.observe_gradient_flat(grad, seg)
            PerTensor(slow).observe_gradient_flat(grad, seg)
            a = fast.compress_flat(x, seg)
            b = PerTensor(slow).compress_flat(x, seg)
            assert a.payload.dtype == torch.uint8 and a.nbytes == b.nbytes
            if isinstance(fast, AdaComp):  # the layers' payloads back to back, byte for byte
                assert torch.equal(a.payload, b.payload)
            assert isinstance(a.layer_nbytes, Tensor) and a.layer_nbytes.tolist() == list(b.layer_nbytes)
            _assert_same_stats(a, b)
            sent = fast.sent_flat(x, a)
            assert torch.equal(sent, PerTensor(slow).sent_flat(x, b))
            assert torch.equal(fast.decompress_flat(a), PerTensor(slow).decompress_flat(b))
        # per-name state (random streams, counters) advanced as the loop advances it: a resumed run repeats
        assert _same_state(fast.state_dict(), slow.state_dict())
        batched.append((fast, a))
        looped.append((slow, b))
    # the hook hands remote sizes back as it exchanged them: a device tensor, or host integers
    received = [p.with_payload(p.payload.clone(), tuple(cast(Tensor, p.layer_nbytes).tolist()) if r == 1 else p.layer_nbytes)
                for r, (_, p) in enumerate(batched)]
    out = torch.full((seg.total,), float("nan"))
    batched[0][0].decompress_flat_mean_into(received, out)
    expected = torch.empty(seg.total)
    PerTensor(looped[0][0]).decompress_flat_mean_into([p for _, p in looped], expected)
    assert torch.equal(out, expected) and out.abs().sum() > 0


def _ops_per_step(make: Callable[[], Compressor], layers: int) -> tuple[int, int, int]:
    seg = _layout([(12, 10), (7,), (3, 2, 2, 2)] * (layers // 3) + [(1,)] * (layers % 3))
    comp = make()
    comp.setup(0, RANKS, torch.device("cpu"))
    grad = _gradient(_layout(SHAPES), 0)[: seg.total]

    def step() -> None:
        if isinstance(comp, GradientObserver):
            comp.observe_gradient_flat(grad, seg)
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


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("make", [lambda b: GradientDropping(backend=b, sample="strided", max_sample=20),
                                  lambda b: GradientDropping(backend=b, values="fp16"),
                                  lambda b: GradientDropping(backend=b, scope="global", sample="strided"),
                                  lambda b: GradientDropping(backend=b, sample="random", min_sample=40),
                                  lambda b: AdaComp(backend=b), lambda b: AdaComp(backend=b, bin_size_fc=3)],
                         ids=["graddrop_strided", "graddrop_fp16", "graddrop_global", "graddrop_random", "adacomp",
                              "adacomp_8bit"])
def test_batched_ops_do_not_grow_with_the_layers(make: Callable[[str], Compressor], backend: Backend) -> None:
    if not getattr(make(backend), "batched", False):
        pytest.skip("loops over the layers on this backend")
    few, many = _ops_per_step(lambda: make(backend), 8), _ops_per_step(lambda: make(backend), 32)
    assert few == many
    total, host_reads, data_dependent = many
    # the torch path's one data-dependent op per group: the survivors' nonzero, AdaComp's payload masked_select;
    # the fused kernels compact inside the one call
    assert host_reads == 0 and data_dependent == (1 if backend == "torch" else 0)


ADACOMP_CASES: dict[str, dict[str, Any]] = {
    "binary": dict(),
    "ternary": dict(quantizer="ternary"),
    "small_bins": dict(bin_size_fc=7, bin_size_conv=3, scale_factor=3.0),  # 8-bit words and many markers
    "long_bins": dict(bin_sizes={"layer4.*": 2000}, bin_size_conv=70),  # 16-bit words for convolutions too
}


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("case", ADACOMP_CASES)
def test_adacomp_batched_equals_the_layer_loop(case: str, backend: Backend) -> None:
    _compare(lambda: AdaComp(backend=backend, **ADACOMP_CASES[case]), _layout(), residuals=True,
             reference=lambda: LayerAdaComp(backend=backend, **ADACOMP_CASES[case]))


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_adacomp_markers_across_long_gaps_equal_the_loop(backend: Backend) -> None:
    # a layer whose non-empty bins lie more than one marker's reach (63 bins of 8-bit words) apart
    seg = _layout([(20_000,), (3,), (9_000,)])
    fast, slow = AdaComp(backend=backend, bin_size_fc=2), LayerAdaComp(backend=backend, bin_size_fc=2)
    dw = torch.zeros(seg.total)
    dw[[0, 1, 5, 300, 301, 19_999, 20_001, 20_003, 20_003 + 8_999]] = torch.tensor([1.0, -2, 3, -4, 5, 6, -7, 8, 9])
    if isinstance(fast, GradientObserver):
        fast.observe_gradient_flat(dw, seg)
    PerTensor(slow).observe_gradient_flat(dw, seg)
    a, b = fast.compress_flat(dw, seg), PerTensor(slow).compress_flat(dw, seg)
    assert torch.equal(a.payload, b.payload) and isinstance(a.layer_nbytes, Tensor)
    assert a.layer_nbytes.tolist() == list(b.layer_nbytes)
    assert torch.equal(fast.decompress_flat(a), PerTensor(slow).decompress_flat(b))


def test_adacomp_batched_needs_the_fresh_gradient() -> None:
    seg = _layout()
    with pytest.raises(RuntimeError, match="observe_gradient_flat"):
        AdaComp(backend="torch").compress_flat(_gradient(seg, 0), seg)


@pytest.mark.skipif(not kernels.fused_available(), reason="the compiled kernels do not load here")
def test_group_kernels_equal_their_torch_ops_fallbacks() -> None:
    seg = _layout()
    g, dw = _gradient(seg, 4), _gradient(seg, 5)
    offsets = torch.tensor(seg.offsets)
    sizes = torch.tensor([min(n, 300) for n in seg.numels])
    modes = torch.tensor([1, 2, 2, 0, 1, 2, 0])
    keys = torch.tensor([[5, 6]] * len(seg))
    counts = (sizes * 0.9).long()
    bins = torch.tensor([3, 500, 500, 50, 2000, 7, 64])
    samples = kernels.graddrop_group_sample(g, offsets, sizes, modes, keys)
    sample_offsets = torch.cat((torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)))
    thresholds = kernels.graddrop_group_kth(samples, sample_offsets, counts)
    compiled = kernels.graddrop_group_select(g, offsets, thresholds, True)
    encoded = kernels.adacomp_group_encode(g, g + dw, offsets, bins, False)
    with torch_ops():
        assert torch.equal(samples, kernels.graddrop_group_sample(g, offsets, sizes, modes, keys))
        assert torch.equal(thresholds, kernels.graddrop_group_kth(samples, sample_offsets, counts))
        assert all(map(torch.equal, compiled, kernels.graddrop_group_select(g, offsets, thresholds, True)))
        assert all(map(torch.equal, encoded, kernels.adacomp_group_encode(g, g + dw, offsets, bins, False)))
        fallback = kernels.adacomp_group_decode_sum([encoded[0]] * 2, [encoded[1]] * 2, offsets, bins)
    assert torch.equal(kernels.adacomp_group_decode_sum([encoded[0]] * 2, [encoded[1]] * 2, offsets, bins), fallback)
    assert int(compiled[2].sum()) > 0 and int(encoded[3].sum()) > 0


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("quantizer", ["binary", "ternary"])
def test_adacomp_batched_handles_nan_as_the_loop(backend: Backend, quantizer: Quantizer) -> None:
    # a NaN makes its bin's maximum and its layer's scale NaN: binary sends NaN values, ternary nothing of the layer
    seg = _layout()
    fast, slow = AdaComp(backend=backend, quantizer=quantizer), LayerAdaComp(backend=backend, quantizer=quantizer)
    x = _gradient(seg, 6)
    x[seg.offsets[3] + 5] = float("nan")
    if isinstance(fast, GradientObserver):
        fast.observe_gradient_flat(x, seg)
    PerTensor(slow).observe_gradient_flat(x, seg)
    a, b = fast.compress_flat(x, seg), PerTensor(slow).compress_flat(x, seg)
    assert torch.equal(a.payload, b.payload) and isinstance(a.layer_nbytes, Tensor)
    assert a.layer_nbytes.tolist() == list(b.layer_nbytes)
    sent = fast.sent_flat(x, a)
    torch.testing.assert_close(sent, PerTensor(slow).sent_flat(x, b), rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(sent).any()) == (quantizer == "binary")
