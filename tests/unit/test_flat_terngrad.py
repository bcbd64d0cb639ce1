"""TernGrad's group code (a whole group of layers per call) against its per-layer oracle.

The group code keys its counter-based draws per layer as the per-layer fused kernels do, so against the oracle
(:class:`~tests.oracles.terngrad.LayerTernGrad` with ``backend="fused"``, looping over the layers) it must give the
same statistic, payload bytes, decoded values, ``sent``, per-layer bytes and stats, bit for bit, for both collective
variants; and a number of dispatched ops that does not depend on the number of layers, with no host read. The
oracle's ``backend="torch"`` draws from ``torch.Generator`` layer by layer, so there the group code is checked for
the same statistics (scalers, unbiasedness) instead.
"""

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import pytest
import torch
from gradcomp_lab.opcount import count_ops

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.oracles.terngrad import LayerTernGrad

RANKS = 3
SHAPES = [(6, 5), (1,), (0,), (17,), (3, 2, 2), (4, 11), (9,)]
CONFIGS: dict[str, dict[str, Any]] = {
    "paper": {},
    "code": {"clip_mode": "code"},
    "noclip": {"clip_factor": 0.0},
    "buckets": {"bucket_size": 7},
    "per_worker": {"scaler_share": "per_worker", "bucket_size": 5},
    "per_worker-layer": {"scaler_share": "per_worker"},
    "base3": {"packing": "base3", "bucket_size": 8},
}
VARIANTS = ["allgather", "allreduce_int8"]
#: (config, variant): per-worker scalers travel gathered only (TernGrad declares no int8 variant for them)
CASES = [(c, v) for c in sorted(CONFIGS) for v in VARIANTS if not (v == "allreduce_int8" and "per_worker" in c)]
#: the batched path's two ways to run: torch ops (the CUDA path), and the compiled CPU kernels (one call per group)
PATHS: dict[str, Callable[[], AbstractContextManager[None]]] = {"torch-ops": kernels.torch_ops, "compiled": nullcontext}


@pytest.fixture(params=sorted(PATHS))
def path(request: pytest.FixtureRequest) -> Callable[[], AbstractContextManager[None]]:
    if request.param == "compiled" and not kernels.fused_available():
        pytest.skip(f"CPU kernels unavailable: {kernels._build.unavailable_reason}")
    return PATHS[request.param]


def _segments(shapes: Sequence[tuple[int, ...]] = SHAPES) -> Segments:
    return Segments([f"layer{i}.weight" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _grads(seg: Segments, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for r in range(RANKS):
        g = torch.randn(seg.total, generator=gen) * (r + 1)
        g[::13] *= 25  # outliers, so clipping matters
        grads.append(g)
    return grads


def _ranks(kwargs: dict[str, Any], variant: str, backend: str = "fused", oracle: bool = False,
           triton: Optional[bool] = None) -> list[Compressor]:
    """RANKS compressors (the oracle's when ``oracle``) travelling as ``variant`` (an explicit `collective` where
    TernGrad declares none); ``triton``: the option (``True`` forces Triton's kernels, on CPU tensors the
    interpreter), read when ``setup`` chooses the kernels, which the variants share."""
    comps: list[Compressor] = []
    for r in range(RANKS):
        auto = (LayerTernGrad if oracle else TernGrad)(seed=5, backend=backend, **kwargs)  # type: ignore[arg-type]
        auto.triton = triton
        auto.setup(r, RANKS, torch.device("cpu"))
        variants = {v.name: v.compressor for v in auto.collectives(RANKS)}
        comps.append(variants.get(variant, auto))
    return comps


def _exchange(comps: Sequence[Compressor], seg: Segments, grads: Sequence[torch.Tensor]) -> dict[str, Any]:
    """One simulated step of RANKS ranks as the hook runs it, through the compressors' group methods."""
    call = lambda name: getattr(type(comps[0]), name)  # noqa: E731
    stats = [call("flat_statistic")(c, g, seg) for c, g in zip(comps, grads)]
    shared = None
    if stats[0] is not None:
        shared = stats[0].with_values(torch.stack([s.values for s in stats]).amax(0))
    packets: list[FlatPacket] = [call("compress_flat")(c, g, seg, shared) for c, g in zip(comps, grads)]
    sent = [call("sent_flat")(c, g, p) for c, g, p in zip(comps, grads, packets)]
    own = packets[0]
    if comps[0].aggregation is Aggregation.SUM:
        summed = torch.stack([p.payload for p in packets]).sum(0, dtype=torch.int8)
        decoded = call("decompress_flat")(comps[0], own.with_payload(summed))
    else:
        received = [own.with_payload(p.payload, p.layer_nbytes) for p in packets]
        out = torch.full((seg.total,), float("nan"), device=own.payload.device)
        decoded = call("decompress_flat_mean_into")(comps[0], received, out)
    return {
        "statistic": None if shared is None else shared.values,
        "payloads": [p.payload for p in packets],
        "layer_nbytes": [p.layer_nbytes for p in packets],
        "stats": [p.stats if p.layers is None else _stacked(p) for p in packets],
        "sent": sent,
        "decoded": decoded,
        "counters": [c.state_dict()["counters"] for c in comps],
    }


def _stacked(packet: FlatPacket) -> dict[str, torch.Tensor]:
    assert packet.layers is not None
    return {k: torch.stack([p.stats[k] for p in packet.layers]) for k in packet.layers[0].stats}


def _assert_same(batched: dict[str, Any], looped: dict[str, Any]) -> None:
    assert batched.keys() == looped.keys()
    for key, value in batched.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, looped[key]), key
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(value, looped[key])), key
        elif isinstance(value, list) and value and isinstance(value[0], dict) and key == "stats":
            for a, b in zip(value, looped[key]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key
        else:
            assert value == looped[key], key


@pytest.mark.parametrize(("config", "variant"), CASES)
def test_batched_equals_the_fused_loop_bit_for_bit(
    config: str, variant: str, path: Callable[[], AbstractContextManager[None]]
) -> None:
    kwargs = CONFIGS[config]
    seg = _segments()
    grads = _grads(seg)
    looped = _exchange(_ranks(kwargs, variant, oracle=True), seg, grads)
    batched_comps = _ranks(kwargs, variant)
    with path():
        batched = _exchange(batched_comps, seg, grads)
    _assert_same(batched, looped)
    int8 = batched_comps[0].aggregation is Aggregation.SUM
    assert batched["payloads"][0].dtype == (torch.int8 if int8 else torch.uint8)
    assert batched["layer_nbytes"][0][SHAPES.index((0,))] == 0  # an empty layer puts nothing on the wire
    # a second step draws again (the per-name counters advanced) and still matches
    with path():
        again = _exchange(batched_comps, seg, grads)
    assert not torch.equal(again["payloads"][0], batched["payloads"][0])


def test_statistic_is_the_looping_layout_so_either_path_reads_the_other(
    path: Callable[[], AbstractContextManager[None]],
) -> None:
    seg = _segments()
    x = _grads(seg)[0]
    comp = TernGrad(bucket_size=7, backend="fused")
    with path():
        batched = comp.flat_statistic(x, seg)
    looped = LayerTernGrad(bucket_size=7, backend="fused").flat_statistic(x, seg)
    assert isinstance(batched, SharedStatistic) and isinstance(looped, SharedStatistic)
    assert batched.lengths == looped.lengths  # chunks per layer; 0 for the empty layer
    assert all(
        (a is None and b is None) or torch.equal(a, b)  # type: ignore[arg-type]
        for a, b in zip(batched.per_layer(), looped.per_layer())
    )
    assert TernGrad(scaler_share="per_worker").flat_statistic(x, seg) is None


def test_torch_ops_path_has_the_torch_backends_scalers_and_is_unbiased() -> None:
    """The group torch-ops path (``backend="torch"``, and what CUDA runs) draws from the counter-based stream, not
    ``torch.Generator``: the same scalers as the oracle's per-layer torch ops (up to float32 rounding of sigma) and
    the same expectation, E[decoded] = the gradient."""
    seg = _segments([(40, 25), (1,), (0,), (300,), (7, 7)])
    g = torch.randn(seg.total, generator=torch.Generator().manual_seed(1))
    comp = TernGrad(backend="fused", clip_factor=0.0)
    reference = LayerTernGrad(backend="torch", clip_factor=0.0)
    for c in (comp, reference):
        c.setup(0, 1, torch.device("cpu"))
    trials = 300
    mean = torch.zeros(seg.total)
    with kernels.torch_ops():
        shared = comp.flat_statistic(g, seg)
        assert shared is not None
        for _ in range(trials):
            mean += comp.decompress_flat(comp.compress_flat(g, seg, shared))
    per_layer = [per_tensor(reference).local_statistic(x, name) for name, x in seg.items(g)]
    assert torch.allclose(shared.values, torch.cat([s for s in per_layer if s is not None]), rtol=1e-6, atol=0.0)
    mean /= trials
    s = seg.expand(shared.values.index_select(0, torch.tensor([0, 1, 1, 2, 3])))  # no chunk for the empty layer
    stderr = (g.abs() * (s - g.abs())).clamp_min(0).sqrt() / trials**0.5
    assert ((mean - g).abs() <= 5 * stderr + 1e-4).float().mean() > 0.999  # 1e-4: rounding of the sum of 300
    assert (mean - g).mean().abs() < 0.01


def test_torch_backend_runs_the_group_code_with_the_fused_backends_bits() -> None:
    """``backend="torch"`` runs the same group code in torch ops on every device: the compiled kernels' bits, and
    a single tensor's per-layer call is the group of one (the same bytes as that layer in its group)."""
    seg = _segments()
    x = _grads(seg)[0]
    torch_ops, fused = TernGrad(seed=4, backend="torch"), TernGrad(seed=4, backend="fused")
    for c in (torch_ops, fused):
        c.setup(0, 2, torch.device("cpu"))
    assert torch_ops.batched and fused.batched and torch_ops.chosen_backend == "torch"
    packets = [c.compress_flat(x, seg, c.flat_statistic(x, seg)) for c in (torch_ops, fused)]
    assert packets[0].layers is None and torch.equal(packets[0].payload, packets[1].payload)
    alone = TernGrad(seed=4, backend="torch")
    alone.setup(0, 2, torch.device("cpu"))
    per_layer = [per_tensor(alone).compress(v, n, per_tensor(alone).local_statistic(v, n)).payload for n, v in seg.items(x)]
    assert torch.equal(torch.cat(per_layer), packets[0].payload)


def test_batched_draws_resume_exactly_from_a_state_dict(path: Callable[[], AbstractContextManager[None]]) -> None:
    seg = _segments()
    x = _grads(seg)[0]
    comp = TernGrad(seed=2, backend="fused")
    comp.setup(1, 2, torch.device("cpu"))
    with path():
        comp.compress_flat(x, seg, comp.flat_statistic(x, seg))
        state = comp.state_dict()
        first = comp.compress_flat(x, seg, comp.flat_statistic(x, seg)).payload
        resumed = TernGrad(seed=2, backend="fused")
        resumed.setup(1, 2, torch.device("cpu"))
        resumed.load_state_dict(state)
        assert torch.equal(resumed.compress_flat(x, seg, resumed.flat_statistic(x, seg)).payload, first)


def _step_ops(comp: Compressor, layers: int) -> tuple[int, int, int]:
    shapes = [(5, 3) if i % 3 else (1,) for i in range(layers)]
    seg = _segments(shapes)
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(layers))

    def step() -> None:
        shared = comp.flat_statistic(x, seg)
        packet = comp.compress_flat(x, seg, shared)
        comp.sent_flat(x, packet)
        if comp.aggregation is Aggregation.SUM:
            comp.decompress_flat(packet.with_payload(packet.payload * 2))
        else:
            comp.decompress_flat_mean_into([packet, packet.with_payload(packet.payload.clone())], torch.empty(seg.total))

    step()  # layouts and index tensors are built once per group
    with count_ops() as counted:
        step()
    return counted.total, counted.host_reads, counted.data_dependent


@pytest.mark.parametrize(("config", "variant"), [c for c in CASES if c[0] in ("paper", "per_worker", "buckets")])
def test_ops_do_not_grow_with_the_number_of_layers_and_nothing_is_read(
    config: str, variant: str, path: Callable[[], AbstractContextManager[None]]
) -> None:
    kwargs = CONFIGS[config]
    comp = _ranks(kwargs, variant, backend="fused")[0]
    assert isinstance(comp, TernGrad) and comp.batched
    with path():
        small, large = _step_ops(comp, 8), _step_ops(comp, 32)
    assert small == large
    assert small[1:] == (0, 0)  # no host read, no data-dependent size


@pytest.mark.parametrize("shapes", [[(0,)], [(0,), (0,)], [(1,)], [(0,), (3,), (0,)]], ids=["empty", "empties", "one", "mixed"])
def test_tiny_groups_and_a_half_precision_strided_out_match_the_loop(
    shapes: list[tuple[int, ...]], path: Callable[[], AbstractContextManager[None]]
) -> None:
    """Groups of only empty or one-element layers, fp16 gradients and an ``out`` the compiled decoder cannot write
    (fp16, strided): the same bytes and decoded values as the loop."""
    seg = _segments(shapes)
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(2)).half()
    batched, looped = TernGrad(seed=1, backend="fused"), LayerTernGrad(seed=1, backend="fused")
    for c in (batched, looped):
        c.setup(0, 2, torch.device("cpu"))
    with path():
        packet = batched.compress_flat(x, seg, batched.flat_statistic(x, seg))
        out = batched.decompress_flat_mean_into([packet, packet], torch.full((seg.total, 2), float("nan")).half()[:, 0])
    reference = looped.compress_flat(x, seg, looped.flat_statistic(x, seg))
    expected = looped.decompress_flat_mean_into([reference, reference], torch.empty(seg.total).half())
    assert torch.equal(packet.payload, reference.payload) and packet.layer_nbytes == reference.layer_nbytes
    assert out.dtype == torch.float16 and torch.equal(out, expected)
