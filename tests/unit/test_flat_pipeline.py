"""The batched pipeline's pieces: segment ops, flat residuals across bucket layouts, group records, bucket groups."""

import copy
import pickle

import pytest
import torch

from lightning_gradcomp import registry
from lightning_gradcomp.compressors.base import Aggregation, Compressor, GradientObserver
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.compressors.topk import TopK
from lightning_gradcomp.exchange.groups import Layouts
from lightning_gradcomp.exchange.ledger import GroupRecord, LayerRecord, Ledger
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.compressors.per_tensor import per_tensor
from gradcomp_lab.opcount import count_ops

SHAPES = [torch.Size([3, 4]), torch.Size([1]), torch.Size([0]), torch.Size([7]), torch.Size([2, 2, 2])]
NAMES = ["a", "b", "c", "d", "e"]


def _segments() -> Segments:
    return Segments(NAMES, SHAPES)


def test_a_segment_larger_than_a_chunk_reduces_in_two_stages_with_the_same_bits() -> None:
    # a layer of SPLIT + 5 elements (an embedding, scaled down): its max over many chunks (CUDA: many thread blocks),
    # bit for bit the per-layer reduction's; an empty layer still gives 0
    from lightning_gradcomp import flat as segments_module

    big = segments_module.SPLIT + 5
    seg = Segments(["emb", "empty", "bias", "w"], [torch.Size([big]), torch.Size([0]), torch.Size([3]),
                                                   torch.Size([2 * segments_module.SPLIT])])
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(1))
    x[7] = -9.0  # the first chunk's extreme
    x[big - 1] = 11.0  # the big layer's last chunk holds its max
    with count_ops() as counted:
        amax, amin = seg.reduce(x.abs(), "amax"), seg.reduce(x, "amin")
    assert counted.ops["segment_reduce"] == 4  # two stages each
    views = seg.views(x)
    assert amax.tolist() == [float(v.abs().max()) if v.numel() else 0.0 for v in views]
    assert amin.tolist() == [float(v.min()) if v.numel() else 0.0 for v in views]
    x[big + 1] = float("nan")
    assert seg.reduce(x, "amax").isnan().tolist() == [False, False, True, False]
    with count_ops() as counted:  # a sum on the CPU stays one stage in element order: its bits kept
        total = seg.reduce(x, "sum")
    assert counted.ops["segment_reduce"] == 1
    in_order = [torch.zeros(1).index_add_(0, torch.zeros(v.numel(), dtype=torch.int64), v)[0] for v in views]
    assert torch.equal(total[[0, 1, 3]], torch.stack([in_order[0], in_order[1], in_order[3]]))
    # the two-stage sum (the one off the CPU): within float32 rounding of the exact sum
    split = seg.split(x.device)
    assert split is not None
    chunks, per = split
    assert chunks.tolist() == [segments_module.SPLIT, 5, 0, 3, segments_module.SPLIT, segments_module.SPLIT]
    assert per.tolist() == [2, 1, 1, 2]
    y = x.nan_to_num()
    two = torch.segment_reduce(torch.segment_reduce(y, "sum", lengths=chunks), "sum", lengths=per)
    assert torch.allclose(two, torch.stack([v.double().sum() for v in seg.views(y)]).float(), rtol=1e-5, atol=1e-4)
    assert _segments().split(x.device) is None  # every layer fits one chunk: one stage, as before


def test_segment_reduce_expand_sort_and_firsts_match_per_layer_ops() -> None:
    seg = _segments()
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))
    views = seg.views(x)
    amax = seg.reduce(x.abs(), "amax")
    assert amax.tolist() == [float(v.abs().max()) if v.numel() else 0.0 for v in views]
    assert torch.equal(seg.expand(amax), torch.cat([torch.full((v.numel(),), float(m)) for v, m in zip(views, amax)]))
    ordered, index = seg.sort(x.abs(), descending=True)
    assert torch.equal(ordered, x.abs()[index])
    for view, got in zip(views, seg.views(ordered)):
        assert torch.equal(got.reshape(-1), view.abs().reshape(-1).sort(descending=True).values)
    top = seg.firsts([2, 1, 0, 3, 8], x.device)
    picked = index[top]
    expected = [o + i for o, v in zip(seg.offsets, views) for i in v.abs().reshape(-1).topk(min(2, v.numel())).indices.tolist()]
    assert picked[:2].tolist() == expected[:2]
    with pytest.raises(ValueError, match="Expected one count in"):
        seg.firsts([13, 1, 0, 0, 0], x.device)


def test_padding_round_trips_and_aligns_every_segment() -> None:
    seg = _segments()
    x = torch.arange(1.0, seg.total + 1)
    padding = seg.padding(4)
    assert padding.numels == (12, 4, 0, 8, 8)
    padded = padding.pad(x, fill=-1.0)
    assert torch.equal(padding.unpad(padded), x)
    assert padded[padding.offsets[1] + 1 :][:3].tolist() == [-1.0, -1.0, -1.0]


def test_segment_ops_dispatch_the_same_ops_for_any_number_of_layers() -> None:
    def ops(layers: int) -> int:
        seg = Segments([f"w{i}" for i in range(layers)], [torch.Size([5])] * layers)
        x = torch.randn(seg.total)
        seg.sort(x), seg.padding(4).pad(x), seg.firsts([2] * layers, x.device)  # build the cached indices
        with count_ops() as counted:
            seg.expand(seg.reduce(x.abs(), "amax"))
            seg.sort(x)
            seg.padding(4).unpad(seg.padding(4).pad(x))
        assert counted.host_reads == 0 and counted.data_dependent == 0
        return counted.total

    assert ops(8) == ops(64)


def _invariant(memory: ResidualMemory, seg: Segments, grad: torch.Tensor, keep: float) -> torch.Tensor:
    """One error-feedback step through the flat path; returns ``sent`` (a fraction of the compensated input)."""
    x = memory.compensate_flat(grad, seg)
    sent = torch.where(torch.arange(seg.total) % 2 == 0, x * keep, torch.zeros_like(x))
    memory.update_flat(seg, x, sent)
    return sent


def test_flat_residuals_keep_the_invariant_across_a_bucket_rebuild_and_round_trip_by_name() -> None:
    gen = torch.Generator().manual_seed(1)
    memory = ResidualMemory()
    first = _segments()
    grads = torch.randn(first.total, generator=gen)
    old = {n: torch.zeros(s) for n, s in zip(NAMES, SHAPES)}
    memory.begin_step()
    sent = _invariant(memory, first, grads, 0.5)
    for (name, g), s in zip(first.items(grads), first.views(sent)):  # grad + old residual == sent + new residual
        assert torch.equal(g + old[name], s + memory.residuals[name])
    # DDP rebuilt its buckets: the same names in another order and split in two groups
    one, two = Segments(["d", "a"], [SHAPES[3], SHAPES[0]]), Segments(["e", "b", "c"], [SHAPES[4], SHAPES[1], SHAPES[2]])
    before = {n: memory.residuals[n].clone() for n in NAMES}
    g1 = torch.randn(one.total, generator=gen)
    x = memory.compensate_flat(g1, one)
    for (name, g), xi in zip(one.items(g1), one.views(x)):
        assert torch.equal(xi, g + before[name])
    assert torch.equal(memory.residuals["e"], before["e"])  # the names of the other group keep theirs
    state = memory.state_dict()
    assert set(state) == set(NAMES) and all(state[n].shape == s for n, s in zip(NAMES, SHAPES))
    restored = ResidualMemory()
    restored.load_state_dict(state, torch.device("cpu"))
    g2 = torch.randn(two.total, generator=gen)
    assert torch.equal(restored.compensate_flat(g2, two), memory.compensate_flat(g2, two))


def test_a_rolled_back_flat_step_restores_the_residuals_it_replaced() -> None:
    memory = ResidualMemory()
    seg = _segments()
    memory.begin_step()
    _invariant(memory, seg, torch.ones(seg.total), 0.25)
    kept = {n: memory.residuals[n].clone() for n in NAMES}
    memory.begin_step()
    _invariant(memory, seg, torch.full((seg.total,), 3.0), 0.25)
    assert not torch.equal(memory.residuals["a"], kept["a"])
    memory.rollback()
    assert all(torch.equal(memory.residuals[n], kept[n]) for n in NAMES)
    fresh = ResidualMemory()
    fresh.begin_step()
    _invariant(fresh, seg, torch.ones(seg.total), 0.25)
    fresh.rollback()  # a step that created the residuals leaves none
    assert len(fresh.residuals) == 0


def test_a_per_name_update_takes_its_layer_out_of_a_flat_group() -> None:
    memory = ResidualMemory()
    seg = _segments()
    _invariant(memory, seg, torch.ones(seg.total), 0.0)
    memory.update("a", torch.full(SHAPES[0], 2.0), torch.zeros(SHAPES[0]))
    assert torch.equal(memory.residuals["a"], torch.full(SHAPES[0], 2.0))
    assert torch.equal(memory.residuals["d"], torch.ones(SHAPES[3]))
    memory.residuals["b"] = torch.full((1,), 5.0)
    assert float(memory.residuals["b"]) == 5.0 and len(memory.residuals) == len(NAMES)


def test_group_records_read_as_layer_records_and_replace_a_stale_layout() -> None:
    ledger = Ledger()
    seg = _segments()
    sizes = torch.tensor([8, 4, 0, 16, 8])
    ledger.record_group(GroupRecord(seg, sizes, Aggregation.GATHER, {"density": torch.arange(5.0)}))
    assert ledger.last_step_bytes() == 36 and ledger.dense_bytes_per_step() == 4 * seg.total
    record = ledger.records["d"]
    assert (record.nbytes, record.numel, float(record.stats["density"])) == (16, 7, 3.0)
    # a rebuilt bucket regroups "a" and "b": the old group's other names keep their latest records
    ledger.record_group(GroupRecord(Segments(["a", "b"], SHAPES[:2]), (4, 4), Aggregation.SUM, {}))
    assert ledger.records["a"].nbytes == 4 and ledger.records["e"].nbytes == 8
    ledger.record("e", LayerRecord(1, 8, Aggregation.SUM, {}))
    assert ledger.last_step_bytes() == 4 + 4 + 0 + 16 + 1


def test_groups_take_and_put_non_adjacent_layers_of_a_bucket() -> None:
    dense, sparse = Identity(), TopK(ratio=0.5)
    route = [dense, sparse, dense, sparse]
    shapes = [torch.Size([2]), torch.Size([3]), torch.Size([1]), torch.Size([2, 2])]
    groups = Layouts().groups(["w0", "w1", "w2", "w3"], shapes, [0, 2, 5, 6], route, 4, None)
    assert [(g.compressor, g.members, g.span) for g in groups] == [(dense, (0, 2), None), (sparse, (1, 3), None)]
    buffer = torch.arange(10.0)
    assert groups[0].take(buffer).tolist() == [0.0, 1.0, 5.0]
    groups[1].put(buffer, -groups[1].take(buffer))
    assert buffer.tolist() == [0, 1, -2, -3, -4, 5, -6, -7, -8, -9]
    adjacent = Layouts().groups(["w0", "w1"], shapes[:2], [0, 2], [dense, dense], 4, 8)
    assert [(g.members, g.chunk, g.span) for g in adjacent] == [((0,), 0, (0, 2)), ((1,), 1, (2, 5))]


def test_the_looping_flat_packet_splits_a_remote_payload_by_that_ranks_sizes() -> None:
    # a compressor written per layer (here TopK's oracle) travels as the base class's looping group packet
    from tests.oracles.topk import LayerTopK

    seg = Segments(["a", "b"], [torch.Size([6]), torch.Size([4])])
    topk = LayerTopK(ratio=0.5)
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(3))
    packet = topk.compress_flat(x, seg)
    assert isinstance(packet, FlatPacket) and packet.layers is not None
    assert packet.layer_nbytes == tuple(p.nbytes for p in packet.layers)
    remote = packet.with_payload(packet.payload.view(torch.uint8).clone(), layer_nbytes=packet.layer_nbytes)
    assert torch.equal(topk.decompress_flat(remote), topk.decompress_flat(packet))


def test_the_default_gathered_mean_of_batched_packets_sums_in_rank_order_like_each_layer() -> None:
    # WeightGrad gathers fp32 (GatheredFP32): a batched compressor without its own gathered decoder
    from lightning_gradcomp.weightgrad.strategy import GatheredFP32

    seg = _segments()
    gen = torch.Generator().manual_seed(5)
    compressor = GatheredFP32()
    xs = [torch.randn(seg.total, generator=gen) * 10 ** r for r in range(3)]
    packets = [compressor.compress_flat(x, seg) for x in xs]
    assert packets[0].layers is None
    got = compressor.decompress_flat_mean_into(packets, torch.empty(seg.total))
    for i, view in enumerate(seg.views(got)):
        per_layer = [per_tensor(compressor).compress(seg.views(x)[i], NAMES[i]) for x in xs]
        assert torch.equal(view, per_tensor(compressor).decompress_mean_into(per_layer, torch.empty(SHAPES[i])))


@pytest.mark.parametrize("name", registry.compressor_names())
def test_a_compressor_that_compressed_a_group_still_pickles_and_deep_copies(name: str) -> None:
    # spawned ranks receive the strategy's compressor pickled; TowerStrategy deep-copies one per worker: the group
    # caches (weakly keyed by this process's layouts) must not stop either
    compressor = registry.COMPRESSORS[name][0]()
    compressor.setup(0, 1, torch.device("cpu"))
    seg = Segments(["a", "b"], [torch.Size([300]), torch.Size([5, 7])])
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))
    if isinstance(compressor, GradientObserver):
        compressor.observe_gradient_flat(x, seg)
    if not isinstance(compressor, MultiRoundCompressor):  # a multi-round one exchanges through the hook only
        compressor.compress_flat(x, seg, compressor.flat_statistic(x, seg))
    assert type(pickle.loads(pickle.dumps(compressor))) is type(compressor)
    assert type(copy.deepcopy(compressor)) is type(compressor)


@pytest.mark.parametrize("name", [n for n in registry.compressor_names() if n != "powersgd"])
def test_every_registered_compressor_makes_one_group_packet(name: str) -> None:
    """Every registered compressor compresses a group into one packet, on a CPU as on a GPU: none falls back to the
    base class's loop over its layers (per-layer packets in ``packet.layers``)."""
    seg = _segments()
    comp = registry.make_compressor(name)
    comp.setup(0, 2, torch.device("cpu"))
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(1))
    if isinstance(comp, GradientObserver):
        comp.observe_gradient_flat(x, seg)
    packet = comp.compress_flat(x, seg, comp.flat_statistic(x, seg))
    assert packet.layers is None and type(comp).compress_flat is not Compressor.compress_flat, name


def test_a_compressor_written_per_group_is_its_own_per_layer_api_on_a_group_of_one() -> None:
    """TernGrad implements only the group methods: ``compress``/``decompress``/``sent``/``local_statistic`` of one tensor
    are the group methods on a group of one (same bytes, decode, statistic, stats as 0-d tensors); a compressor with
    neither side says what to override."""
    from lightning_gradcomp.compressors import TernGrad
    from lightning_gradcomp.compressors.base import Compressor, SharedStatistic

    g = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    alone, grouped = TernGrad(seed=1, bucket_size=8), TernGrad(seed=1, bucket_size=8)
    for c in (alone, grouped):
        c.setup(0, 2, torch.device("cpu"))
    seg = Segments(["w"], [g.shape])
    statistic = per_tensor(alone).local_statistic(g, "w")
    group_statistic = grouped.flat_statistic(g.reshape(-1), seg)
    assert statistic is not None and isinstance(group_statistic, SharedStatistic)
    assert torch.equal(statistic, group_statistic.values)
    packet = per_tensor(alone).compress(g, "w", statistic)
    group = grouped.compress_flat(g.reshape(-1), seg, group_statistic)
    assert torch.equal(packet.payload, group.payload) and packet.nbytes == group.layer_nbytes[0]
    assert all(v.dim() == 0 and torch.equal(v, group.stats[k][0]) for k, v in packet.stats.items())
    decoded = per_tensor(alone).decompress(packet)
    assert decoded.shape == g.shape and torch.equal(decoded.reshape(-1), grouped.decompress_flat(group))
    assert torch.equal(per_tensor(alone).sent(g, packet), decoded)

    class Neither(Compressor):
        pass

    with pytest.raises(NotImplementedError, match="Expected Neither to implement `compress_flat`.*Fix: implement them"):
        per_tensor(Neither()).compress(g, "w")
