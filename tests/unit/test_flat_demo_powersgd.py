"""DeMo's batched flat pipeline and PowerSGD's shape-batched exchange against the layer-by-layer paths, and their op
counts: a fixed number of ops per distinct (chunk) shape, whatever the number of layers; no host read."""

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Optional, TypeVar, cast

import numpy as np
import pytest
import torch
from scipy.fft import dctn, idctn
from torch import Tensor

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp.compressors import DeMo, PowerSGD
from lightning_gradcomp.compressors.demo import ChunkedDCT
from lightning_gradcomp.compressors.multiround import AllReduce, FlatExchanged, MultiRoundCompressor
from lightning_gradcomp.exchange.groups import layer_offsets
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.compressors.powersgd import orthogonalize_
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.compressors.per_tensor import PerTensor, per_tensor

T = TypeVar("T")
CPU = torch.device("cpu")
RANKS = 3
#: mixed shapes: several chunk shapes (64x48, 26x35, 1x1 from a prime length, 16x27 from a 4-D kernel, 1x64), layers
#: sharing one (a product of another height than the layer's own: BLAS may round its last bit otherwise), 1-element
#: (0-d and 1-D) and 0-element layers
DEMO_SHAPES = [(64, 48), (130, 70), (97,), (), (1,), (0,), (16, 3, 3, 3), (3, 0), (128, 48), (64,), (128,)]


def _group(shapes: Sequence[tuple[int, ...]]) -> Segments:
    return Segments([f"layer{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _flat(seg: Segments, seed: int) -> Tensor:
    return torch.randn(seg.total, generator=torch.Generator().manual_seed(seed))


# -- DeMo -----------------------------------------------------------------------------------------------------------


def _chunks_per_layer(demo: DeMo, seg: Segments, payload: Tensor, batched: bool) -> list[tuple[Tensor, Tensor]]:
    """(values, in-chunk indices), each ``[chunks, k]``, of every layer from a group payload: the batched layout
    (chunk class after chunk class in order of first layer: the values of all its chunks, then their indices), or the
    layer-by-layer one (each layer's values, then its indices)."""
    members: dict[object, list[tuple[int, int, int]]] = {}
    for i, shape in enumerate(seg.shapes):
        t = ChunkedDCT(shape, demo.chunk, torch.float32, CPU)
        if t.chunks:
            members.setdefault((t.n1, t.n2) if batched else i, []).append((i, t.chunks, min(demo.topk, t.chunk_numel)))
    out: list[tuple[Tensor, Tensor]] = [(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.int64))] * len(seg)
    at = 0
    for layers in members.values():
        k, total = layers[0][2], sum(chunks for _, chunks, _ in layers)
        values = payload[at : at + 4 * total * k].clone().view(torch.float32)
        at += 4 * total * k
        indices = payload[at : at + 2 * total * k].clone().view(torch.int16).long()
        at += 2 * total * k
        first = 0
        for i, chunks, _ in layers:
            part = slice(first * k, (first + chunks) * k)
            out[i] = (values[part].view(chunks, k), indices[part].view(chunks, k))
            first += chunks
    assert at == payload.numel()
    return out


def _reference_sent(m: np.ndarray, topk: int, chunk: int) -> np.ndarray:
    """What DeMo sends of ``m``, written out with scipy: top-k orthonormal DCT coefficients of every chunk."""
    t = ChunkedDCT(torch.Size(m.shape), chunk, torch.float32, CPU)
    mat = m.reshape(t.rows, t.cols)
    out = np.zeros_like(mat)
    for i in range(0, t.rows, t.n1):
        for j in range(0, t.cols, t.n2):
            coeffs = dctn(mat[i : i + t.n1, j : j + t.n2], norm="ortho").reshape(-1)
            keep = np.argsort(-np.abs(coeffs), kind="stable")[: min(topk, coeffs.size)]
            sparse = np.zeros_like(coeffs)
            sparse[keep] = coeffs[keep]
            out[i : i + t.n1, j : j + t.n2] = idctn(sparse.reshape(t.n1, t.n2), norm="ortho")
    return out.reshape(m.shape)


def test_demo_batched_group_matches_the_layer_loop() -> None:
    seg = _group(DEMO_SHAPES)
    batched, looping = DeMo(topk=8), DeMo(topk=8)
    xs = [_flat(seg, r) for r in range(RANKS)]
    ours = [batched.compress_flat(x, seg) for x in xs]
    theirs = [PerTensor(looping).compress_flat(x, seg) for x in xs]
    assert batched.batched and ours[0].layers is None

    for x, mine, ref in zip(xs, ours, theirs):
        # wire bytes per layer and in all, as the layer-by-layer packets
        assert mine.layer_nbytes == ref.layer_nbytes == tuple(looping.packet_bytes(s) for s in seg.shapes)
        assert mine.nbytes == ref.nbytes == sum(ref.layer_nbytes) > 0
        # the same coefficients selected in every chunk, with the same values
        for (v, i), (rv, ri) in zip(_chunks_per_layer(batched, seg, mine.payload, True),
                                    _chunks_per_layer(looping, seg, ref.payload, False)):
            order, ref_order = i.argsort(dim=1), ri.argsort(dim=1)
            assert torch.equal(i.gather(1, order), ri.gather(1, ref_order))
            torch.testing.assert_close(v.gather(1, order), rv.gather(1, ref_order), rtol=1e-6, atol=1e-6)
        # per-layer statistics: the same keys, [layers] vectors
        assert ref.layers is not None
        for key in ("sparsity", "energy_kept"):
            expected = torch.stack([p.stats[key] for p in ref.layers])
            torch.testing.assert_close(mine.stats[key], expected, rtol=1e-6, atol=0)
        assert torch.equal(mine.stats["sparsity"], torch.stack([p.stats["sparsity"] for p in ref.layers]))
        # what this rank sent (error feedback), decoded from its own packet
        torch.testing.assert_close(batched.sent_flat(x, mine), PerTensor(looping).sent_flat(x, ref), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched.decompress_flat(mine), PerTensor(looping).decompress_flat(ref),
                                   rtol=1e-6, atol=1e-6)

    # GATHER: every rank's payload decoded with rank 0's context, summed in rank order, averaged
    gathered = [ours[0].with_payload(p.payload) for p in ours]
    gathered_ref = [theirs[0].with_payload(p.payload) for p in theirs]
    out = torch.full((seg.total,), float("nan"))
    assert batched.decompress_flat_mean_into(gathered, out) is out
    expected = PerTensor(looping).decompress_flat_mean_into(gathered_ref, torch.empty(seg.total))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_demo_group_decodes_to_the_method_written_out_with_scipy() -> None:
    seg = _group(DEMO_SHAPES)
    demo = DeMo(topk=8)
    x = _flat(seg, 7)
    decoded = demo.decompress_flat(demo.compress_flat(x, seg))
    for view, out, shape in zip(seg.views(x), seg.views(decoded), seg.shapes):
        expected = torch.from_numpy(_reference_sent(view.double().numpy(), 8, demo.chunk)).float().reshape(shape)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_demo_group_of_one_is_the_layer_api() -> None:
    """``compress`` is the batched path on a group of one layer: its packet is that group's."""
    demo = DeMo(topk=4)
    x = torch.randn(40, 30)
    packet = per_tensor(demo).compress(x, "w")
    group = demo.compress_flat(x.reshape(-1), _group([(40, 30)]))
    assert torch.equal(packet.payload, group.payload) and packet.nbytes == demo.packet_bytes(x.shape)
    assert torch.equal(per_tensor(demo).decompress(packet).reshape(-1), demo.decompress_flat(group))


def _demo_step(demo: DeMo, seg: Segments, xs: Sequence[Tensor]) -> None:
    packets = [demo.compress_flat(x, seg) for x in xs]
    demo.sent_flat(xs[0], packets[0])
    demo.decompress_flat_mean_into([packets[0].with_payload(p.payload) for p in packets], torch.empty(seg.total))


def test_demo_ops_per_group_do_not_grow_with_layers() -> None:
    """8 and 32 layers of the same three chunk shapes (64x48, 1x48, 16x27): the same ops, no host read, no op whose
    output size depends on the data."""
    shapes = [(64, 48), (48,), (16, 3, 3, 3)]
    counts = []
    for layers in (8, 32):
        seg = _group([shapes[i % 3] for i in range(layers)])
        demo = DeMo(topk=8)
        xs = [_flat(seg, r) for r in range(RANKS)]
        _demo_step(demo, seg, xs)  # the group's chunking is built on the first call, on the host
        with count_ops() as counted:
            _demo_step(demo, seg, xs)
        counts.append(counted)
    assert counts[0].ops == counts[1].ops
    assert counts[0].host_reads == counts[1].host_reads == 0
    assert counts[0].data_dependent == counts[1].data_dependent == 0
    # the classes are what grows: one more chunk shape, more ops
    seg = _group([shapes[i % 3] for i in range(8)] + [(24, 20)])
    demo = DeMo(topk=8)
    xs = [_flat(seg, r) for r in range(RANKS)]
    _demo_step(demo, seg, xs)
    with count_ops() as more:
        _demo_step(demo, seg, xs)
    assert more.total > counts[0].total


# -- PowerSGD -------------------------------------------------------------------------------------------------------

#: low-rank (two shapes of one, a 4-D kernel), dense (bias, a matrix too small to gain, 0-d, empty) layers
POWERSGD_SHAPES = [(32, 16), (16,), (16, 24), (32, 16), (8, 3, 3, 3), (), (16, 24), (3, 3), (0, 4), (32, 16), (20, 30)]


def _on_ranks(world: int, call: Callable[[int, Callable[[Tensor], Tensor]], T]) -> tuple[list[T], list[int]]:
    """``call(rank, all_reduce)`` for every rank on its own thread, ``all_reduce`` summing the ranks' tensors in rank
    order; returns every rank's result and the sizes of the all-reduce rounds (each rank's, asserted equal)."""
    barrier = threading.Barrier(world)
    slots: list[Tensor] = [torch.zeros(0)] * world
    rounds: list[list[int]] = [[] for _ in range(world)]
    results: list[Optional[T]] = [None] * world

    def all_reduce_of(rank: int) -> Callable[[Tensor], Tensor]:
        def all_reduce(t: Tensor) -> Tensor:
            rounds[rank].append(t.numel())
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0].clone()
            for other in slots[1:]:
                total += other
            barrier.wait()
            return t.copy_(total)
        return all_reduce

    def run(rank: int) -> None:
        results[rank] = call(rank, all_reduce_of(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r == rounds[0] for r in rounds), "a rank called all_reduce another number of times or sizes"
    assert all(r is not None for r in results), "a rank failed"
    return [r for r in results if r is not None], rounds[0]


def _ranks_exchange(compressors: Sequence[PowerSGD], inputs: Sequence[Sequence[Tensor]], names: Sequence[str]
                    ) -> tuple[list[list], int]:
    """Each rank's ``exchange``; returns every rank's results and the number of all-reduce rounds."""
    results, rounds = _on_ranks(len(compressors), lambda r, all_reduce: compressors[r].exchange(inputs[r], names, all_reduce))
    return results, len(rounds)


def _reference_powersgd(steps: Sequence[Sequence[Sequence[Tensor]]], rank: int, warm_start: bool) -> list[list[Tensor]]:
    """The per-tensor maths (torch's hook, layer by layer) over all ranks' inputs at once: the mean per step."""
    planner = PowerSGD(rank=rank)
    seeds = np.random.RandomState(0)
    memory: dict[int, Tensor] = {}
    means = []
    for per_rank in steps:
        world = len(per_rank)
        plans = [planner.plan(t.shape) for t in per_rank[0]]
        needs = [p is not None and (not warm_start or i not in memory) for i, p in enumerate(plans)]
        generator = torch.Generator().manual_seed(int(seeds.randint(1_000_000_000))) if any(needs) else None
        step_means: list[Tensor] = []
        for i, plan in enumerate(plans):
            if plan is None:
                step_means.append(cast(Tensor, sum(x[i] for x in per_rank)) / world)
                continue
            n, m, r = plan
            q = torch.randn(m, r, generator=generator) if needs[i] else memory[i]
            q = orthogonalize_(q.clone())
            matrices = [x[i].reshape(n, m) for x in per_rank]
            p = orthogonalize_(cast(Tensor, sum(mat @ q for mat in matrices)))
            q = cast(Tensor, sum(mat.t() @ p for mat in matrices)) / world
            memory[i] = q
            step_means.append((p @ q.t()).view(per_rank[0][i].shape))
        means.append(step_means)
    return means


@pytest.mark.parametrize(("rank", "warm_start"), [(1, True), (2, False), (4, True)], ids=["r1", "r2-cold", "r4-qr"])
def test_powersgd_batched_exchange_matches_the_per_tensor_maths(rank: int, warm_start: bool) -> None:
    names = [f"layer{i}" for i in range(len(POWERSGD_SHAPES))]
    compressors = [PowerSGD(rank=rank, warm_start=warm_start) for _ in range(RANKS)]
    for r, c in enumerate(compressors):
        c.setup(r, RANKS, CPU)
    steps = [[[torch.randn(s, generator=torch.Generator().manual_seed(100 * step + 10 * r + i))
               for i, s in enumerate(POWERSGD_SHAPES)] for r in range(RANKS)] for step in range(3)]
    expected = _reference_powersgd(steps, rank, warm_start)
    for step, inputs in enumerate(steps):
        results, rounds = _ranks_exchange(compressors, inputs, names)
        assert rounds == 2  # dense tensors and every P in one all-reduce, every Q in another: as before batching
        for r in range(RANKS):
            for i, (x, got, want) in enumerate(zip(inputs[r], results[r], expected[step])):
                plan = compressors[r].plan(x.shape)
                assert got.mean.shape == x.shape
                assert got.nbytes == (x.numel() * 4 if plan is None else (plan[0] + plan[1]) * plan[2] * 4)
                torch.testing.assert_close(got.mean, want, rtol=1e-5, atol=1e-5, msg=f"step {step}, layer {i}")
                assert got.sent is x if plan is None else torch.equal(got.sent, got.mean)
            # replicas: every rank's mean is bit-identical
            assert all(torch.equal(a.mean, b.mean) for a, b in zip(results[0], results[r]))


def _twice(calls: list[int]) -> Callable[[Tensor], Tensor]:
    """The all-reduce of a world of two identical ranks, noting each round's size in ``calls``."""
    def all_reduce(t: Tensor) -> Tensor:
        calls.append(t.numel())
        return t.mul_(2)
    return all_reduce


def test_powersgd_ops_per_exchange_do_not_grow_with_tensors() -> None:
    """8 and 32 layers of two low-rank shapes and a dense one, warm-started: the same ops, two all-reduce rounds,
    no host read, no op whose output size depends on the data."""
    shapes = [(32, 16), (16, 24), (16,)]
    counts, rounds = [], []
    for layers in (8, 32):
        names = [f"layer{i}" for i in range(layers)]
        xs = [torch.randn(shapes[i % 3], generator=torch.Generator().manual_seed(i)) for i in range(layers)]
        compressor = PowerSGD(rank=2)
        compressor.setup(0, 2, CPU)
        calls: list[int] = []
        all_reduce = _twice(calls)
        compressor.exchange(xs, names, all_reduce)  # the first exchange draws the random Qs, layer by layer
        calls.clear()
        with count_ops() as counted:
            results = compressor.exchange(xs, names, all_reduce)
        assert len(results) == layers
        counts.append(counted)
        rounds.append(len(calls))
    assert rounds == [2, 2]
    assert counts[0].ops == counts[1].ops
    assert counts[0].host_reads == counts[1].host_reads == 0
    assert counts[0].data_dependent == counts[1].data_dependent == 0


# -- PowerSGD on a flat group (the hook's entry point) ----------------------------------------------------------------


@pytest.mark.parametrize(("rank", "warm_start"), [(1, True), (2, False), (4, True)], ids=["r1", "r2-cold", "r4-qr"])
def test_powersgd_flat_exchange_is_the_layer_exchange_bit_for_bit(rank: int, warm_start: bool) -> None:
    """PowerSGD's ``exchange_flat`` (one gather per class) against the base class's (``exchange`` on the group's views,
    concatenated) on 3 ranks over 3 steps: the same rounds (number and sizes), bit-identical means, what was sent,
    per-layer bytes and warm-start factors."""
    seg = _group(POWERSGD_SHAPES)
    batched = [PowerSGD(rank=rank, warm_start=warm_start) for _ in range(RANKS)]
    looping = [PowerSGD(rank=rank, warm_start=warm_start) for _ in range(RANKS)]
    for r in range(RANKS):
        batched[r].setup(r, RANKS, CPU)
        looping[r].setup(r, RANKS, CPU)
    for step in range(3):
        xs = [_flat(seg, 10 * step + r) for r in range(RANKS)]

        def batched_on(r: int, all_reduce: AllReduce, xs: list[Tensor] = xs) -> FlatExchanged:
            return batched[r].exchange_flat(xs[r], seg, all_reduce)

        def looping_on(r: int, all_reduce: AllReduce, xs: list[Tensor] = xs) -> FlatExchanged:
            return MultiRoundCompressor.exchange_flat(looping[r], xs[r], seg, all_reduce)

        ours, our_rounds = _on_ranks(RANKS, batched_on)
        theirs, their_rounds = _on_ranks(RANKS, looping_on)
        assert our_rounds == their_rounds and len(our_rounds) == 2
        for r in range(RANKS):
            mine, ref = ours[r], theirs[r]
            assert torch.equal(mine.mean, ref.mean) and torch.equal(mine.sent, ref.sent), f"step {step}, rank {r}"
            assert mine.layer_nbytes == ref.layer_nbytes
            assert mine.stats == ref.stats == {}
            assert batched[r].q_memory.keys() == looping[r].q_memory.keys()
            assert all(torch.equal(q, looping[r].q_memory[n]) for n, q in batched[r].q_memory.items())
            # dense layers count as sent whole (no residual), low-rank ones as their approximation
            for x, sent, shape in zip(seg.views(xs[r]), seg.views(mine.sent), seg.shapes):
                if batched[r].plan(shape) is None:
                    assert torch.equal(sent, x)
        assert all(torch.equal(ours[0].mean, o.mean) for o in ours)  # replicas


def test_powersgd_flat_ops_do_not_grow_with_layers() -> None:
    """``exchange_flat`` on 8 and 32 layers of two low-rank shapes and a dense one, warm-started: the same ops, no
    host read, no op whose output size depends on the data."""
    shapes = [(32, 16), (16, 24), (16,)]
    counts = []
    for layers in (8, 32):
        seg = _group([shapes[i % 3] for i in range(layers)])
        x = _flat(seg, 0)
        compressor = PowerSGD(rank=2)
        compressor.setup(0, 2, CPU)
        calls: list[int] = []
        compressor.exchange_flat(x, seg, _twice(calls))  # draws the random Qs and builds the group's plan
        with count_ops() as counted:
            compressor.exchange_flat(x, seg, _twice(calls))
        assert len(calls) == 4
        counts.append(counted)
    assert counts[0].ops == counts[1].ops
    assert counts[0].host_reads == counts[1].host_reads == 0
    assert counts[0].data_dependent == counts[1].data_dependent == 0


class _Bucket:
    """A stand-in for DDP's ``GradBucket``: ``params``' gradients back to back in one buffer."""

    def __init__(self, params: Sequence[Tensor], buffer: Tensor) -> None:
        self._params, self._buffer = list(params), buffer

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> Sequence[Tensor]:
        return self._params

    def gradients(self) -> Sequence[Tensor]:
        return [self._buffer[o : o + p.numel()].view(p.shape) for o, p in zip(layer_offsets(self), self._params)]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _hook_setup(shapes: Sequence[tuple[int, ...]], excluded: Sequence[int]) -> tuple[GradCompState, list[Tensor]]:
    params = [torch.zeros(s) for s in shapes]
    names = {id(p): f"layer{i}" for i, p in enumerate(params)}
    state = GradCompState(PowerSGD(rank=2), names, float_names=frozenset(f"layer{i}" for i in excluded),
                          nonfinite="ignore")
    state.router.compressor.setup(0, 1, CPU)
    return state, params


def test_hook_runs_powersgd_on_the_buckets_groups() -> None:
    """The hook's multi-round path (world of one) against ``exchange`` layer by layer with error feedback by hand:
    excluded layers (between compressed ones: groups not adjacent in the bucket) pass unchanged in fp32, the others
    are PowerSGD's means, bit for bit; residuals by name, and each layer's bytes in the ledger."""
    excluded = (1, 4, 5)
    state, params = _hook_setup(POWERSGD_SHAPES, excluded)
    reference = PowerSGD(rank=2)
    reference.setup(0, 1, CPU)
    seg = _group(POWERSGD_SHAPES)
    residuals: dict[int, Tensor] = {}
    compressed = [i for i in range(len(POWERSGD_SHAPES)) if i not in excluded]
    for step in range(3):
        grads = _flat(seg, step)
        buffer = grads.clone()
        assert gradcomp_hook(state, _Bucket(params, buffer)).wait() is buffer
        xs = [v + residuals.get(i, 0) for i, v in enumerate(seg.views(grads))]
        results = reference.exchange([xs[i] for i in compressed], [seg.names[i] for i in compressed], lambda t: t)
        expected = list(seg.views(grads))
        for i, result in zip(compressed, results):
            expected[i] = result.mean
            residuals[i] = xs[i] - result.sent
        for i, (got, want) in enumerate(zip(seg.views(buffer), expected)):
            assert torch.equal(got, want), f"step {step}, layer {i}"
        for i in compressed:
            assert torch.equal(state.memory.residuals[seg.names[i]], residuals[i])
        records = state.ledger.records
        for i, result in zip(compressed, results):
            assert records[seg.names[i]].nbytes == result.nbytes
        for i in excluded:
            assert records[seg.names[i]].nbytes == 4 * seg.numels[i]
        assert state.last_step_bytes() == sum(r.nbytes for r in results) + 4 * sum(seg.numels[i] for i in excluded)


def test_hook_multiround_ops_do_not_grow_with_layers() -> None:
    """The hook's multi-round path on buckets of 8 and 32 layers of three shapes, every fourth layer excluded (an fp32
    group interleaved with the compressed one): the same ops, no host read, no data-dependent op."""
    shapes = [(32, 16), (16,), (16, 24), (16,)]
    counts = []
    for layers in (8, 32):
        layout = [shapes[i % 4] for i in range(layers)]
        state, params = _hook_setup(layout, excluded=range(3, layers, 4))
        seg = _group(layout)
        for step in range(3):
            buffer = _flat(seg, step)
            with count_ops() if step == 2 else contextlib.nullcontext() as counted:
                gradcomp_hook(state, _Bucket(params, buffer)).wait()
        assert counted is not None  # count_ops() on the last step
        counts.append(counted)
    assert counts[0].ops == counts[1].ops
    assert counts[0].host_reads == counts[1].host_reads == 0
    assert counts[0].data_dependent == counts[1].data_dependent == 0
