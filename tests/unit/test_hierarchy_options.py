"""The hierarchical exchange's options and its split of parameters into shares (no process group)."""

import pytest
import torch

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.sites.hierarchy import HierarchySpec, hierarchy_spec, owned_names, share_bounds, share_plan
from lightning_gradcomp.weightgrad import WeightGradStrategy


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(hierarchy="rack"), ["`hierarchy`", "'rack'", "Fix:", "'node'"]),
        (dict(site_size=1), ["`site_size`", "1", "Fix:"]),
        (dict(site_size="2"), ["`site_size`", "'2'", "Fix:"]),
        (dict(site_sizes=[2, 1]), ["`site_sizes[1]`", "1", "Fix:"]),
        (dict(site_sizes="2,2"), ["`site_sizes`", "'2,2'", "Fix:"]),
        (dict(hierarchy="node", site_size=2), ["`hierarchy`", "`site_size`", "Fix:"]),
    ],
)
def test_bad_hierarchy_options_fail_at_construction(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        GradCompStrategy(compressor="terngrad", **kwargs)
    for word in words:
        assert word in str(info.value)


def test_weightgrad_refuses_the_hierarchy_option() -> None:
    with pytest.raises(ValueError, match=r"Expected `hierarchy` to be None for WeightGradStrategy.*Fix:"):
        WeightGradStrategy(hierarchy="node")


@pytest.mark.parametrize(
    ("spec", "world", "nodes", "words"),
    [
        (HierarchySpec(site_sizes=(2, 3)), 4, 1, ["`site_sizes`", "add up to the world size 4", "Fix:"]),
        (HierarchySpec(site_size=3), 4, 1, ["`site_size`", "divide the world size 4", "Fix:"]),
        (HierarchySpec(hierarchy="node"), 4, 1, ["`hierarchy`", "'node'", "at least 2 sites", "Fix:"]),
        (HierarchySpec(site_size=4), 4, 1, ["`site_size`", "at least 2 sites", "Fix:"]),
        (HierarchySpec(site_sizes=(3, 2)), 5, 1, ["`site_sizes`", "equal size", "[3, 2]", "Fix:"]),
        (HierarchySpec(hierarchy="node"), 4, 4, ["site sizes [1, 1, 1, 1]", "Fix:"]),
    ],
)
def test_layouts_that_cannot_work_are_refused(spec: HierarchySpec, world: int, nodes: int, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        spec.layout(world, nodes)
    for word in words:
        assert word in str(info.value)


def test_node_hierarchy_makes_one_site_per_node() -> None:
    assert HierarchySpec(hierarchy="node").layout(8, 2).sizes == (4, 4)
    assert hierarchy_spec(None, None, [2, 2]) == HierarchySpec(site_sizes=(2, 2))
    assert hierarchy_spec(None, None, None) is None


def test_shares_are_contiguous_byte_balanced_and_cover_every_parameter() -> None:
    sizes = [400, 100, 100, 200, 300, 100, 400, 100]
    for k in (1, 2, 3, 4):
        bounds = share_bounds(sizes, k)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        totals = [sum(sizes[s:e]) for s, e in bounds]
        # each share within the largest parameter of its fair part
        assert all(abs(t - sum(sizes) / k) <= max(sizes) for t in totals), (k, totals)
    assert [sum(sizes[s:e]) for s, e in share_bounds(sizes, 2)] == [800, 900]
    assert share_bounds([100], 2) == [(0, 0), (0, 1)]  # fewer parameters than shares: an empty share


def test_ownership_depends_on_sizes_only_and_splits_the_model() -> None:
    sizes = [("a", 300), ("b", 100), ("c", 200), ("d", 200)]
    shares = [owned_names(sizes, 2, j) for j in range(2)]
    assert shares == [frozenset({"a", "b"}), frozenset({"c", "d"})]
    assert owned_names(list(sizes), 2, 0) == shares[0]


def test_a_share_plan_packs_each_share_into_its_segment_and_unpacks_the_bucket_exactly() -> None:
    """Parameters in the bucket's order with shares [1, 1, 0, 0, 1] (DDP's order is not the model's): share 0 is
    one run, share 1 two; segments in share order, each with the flag slot last, no padding."""
    numels, shares = [3, 2, 4, 1, 5], [1, 1, 0, 0, 1]
    offsets = [0, 3, 5, 9, 10]
    plan = share_plan(shares, numels, offsets, 2)
    assert plan.lengths == (5, 10) and plan.splits == [6, 11]
    assert plan.runs == (((5, 0, 5),), ((0, 0, 5), (10, 5, 5)))
    assert plan.params == ((2, 3), (0, 1, 4)) and plan.offsets == ((0, 4), (0, 3, 5))
    bucket = torch.arange(1.0, 16.0)
    segments = torch.full((17,), -7.0)  # stale contents: every element must be written
    plan.pack(bucket, segments, torch.tensor(float("nan")))
    assert torch.equal(segments[:5], bucket[5:10]) and segments[5].isnan()
    assert torch.equal(segments[6:16], torch.cat([bucket[0:5], bucket[10:15]])) and segments[16].isnan()
    for j, (indices, at) in enumerate(zip(plan.params, plan.offsets)):  # each parameter where the plan says
        for i, o in zip(indices, at):
            assert torch.equal(plan.segment(j, segments)[o : o + numels[i]], bucket[offsets[i] : offsets[i] + numels[i]])
    restored = torch.zeros(15)
    plan.unpack(segments, restored)
    assert torch.equal(restored, bucket)


def test_the_performance_model_predicts_the_hierarchical_schedule() -> None:
    import math

    from gradcomp_lab.perfmodel import comm_seconds, hierarchical_comm_seconds
    from lightning_gradcomp.exchange.codec import Codec
    from lightning_gradcomp.compressors.base import Aggregation
    from lightning_gradcomp.exchange.costmodel import Link, Network, ring_allgather_seconds, ring_allreduce_seconds

    lan, wan = Link(math.inf, 0.0), Link(1e8, 1e-3)
    net = Network(lan, sites=2, wan=wan)
    dense = 4e6
    packed = Codec(dense / 16, Aggregation.GATHER, rounds=1)
    # unlimited LAN: only the WAN part remains, the whole step's payload among the 2 sites, plus one statistic round
    expected = ring_allgather_seconds(dense / 16, 2, Network(wan)) + ring_allreduce_seconds(4.0, 2, Network(wan))
    assert hierarchical_comm_seconds(packed, dense, 4, net) == pytest.approx(expected)
    # a slower LAN adds the dense reduce to the owners and the gather inside each site of 2: one all-reduce's time
    slow_lan = Network(Link(1e9, 0.0), sites=2, wan=wan)
    added = hierarchical_comm_seconds(packed, dense, 4, slow_lan) - expected
    assert added == pytest.approx(ring_allreduce_seconds(dense, 2, Network(Link(1e9, 0.0))))
    # the flat exchange's ring over 4 ranks crosses the WAN at every step: slower
    assert comm_seconds(packed, 4, net) > hierarchical_comm_seconds(packed, dense, 4, net)
    with pytest.raises(ValueError, match="at least 2 sites"):
        hierarchical_comm_seconds(packed, dense, 4, Network(lan))


def test_a_flat_gloo_all_reduce_over_sites_is_predicted_as_one_ring() -> None:
    import math

    from gradcomp_lab.perfmodel import comm_seconds, fp32_codec
    from lightning_gradcomp.exchange.costmodel import Link, Network, hierarchical_allreduce_seconds, ring_allreduce_seconds

    net = Network(Link(math.inf, 0.0), sites=2, wan=Link(1e8, 1e-3))
    numel = 1_000_000
    ring, two_level = ring_allreduce_seconds(4.0 * numel, 4, net), hierarchical_allreduce_seconds(4.0 * numel, 4, net)
    # 2 sites of 2: all 6 steps of the ring (a quarter each) cross the WAN; 2 steps of a half in the two-level one
    assert two_level < ring
    # Gloo: one ring over the 4 ranks, as the emulated cluster runs DDP; NCCL-like: the faster schedule
    assert comm_seconds(fp32_codec(numel), 4, net, two_level_allreduce=False) == pytest.approx(ring)
    assert comm_seconds(fp32_codec(numel), 4, net) == pytest.approx(two_level)


def test_gradcomp_perf_predicts_hierarchical_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from gradcomp_lab.perfmodel import main

    main(["predict", "--model", "alexnet", "--compressor", "terngrad", "--nproc", "8", "--link", "1gbit",
          "--gpus-per-node", "4", "--hierarchical"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 1 and "+hier" in rows[0]
    with pytest.raises(SystemExit):
        main(["predict", "--model", "alexnet", "--nproc", "8", "--hierarchical"])
