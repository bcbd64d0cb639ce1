"""The alpha-beta model's maths and the boundaries of the collective choice."""

import math

import pytest

from lightning_gradcomp.exchange.costmodel import (
    ALLGATHER_PACKED,
    ALLREDUCE_FP32,
    ALLREDUCE_INT8,
    CompressionCost,
    Link,
    Network,
    broadcast_seconds,
    choose_collective,
    format_rate,
    hierarchical_allreduce_seconds,
    parse_rate,
    parse_time,
    ring_allgather_seconds,
    ring_allreduce_seconds,
)

GBIT = Network(Link(1e9, 0.0))
FREE = CompressionCost(0.0, 0.0)


def test_parsing_and_errors() -> None:
    assert parse_rate("100mbit") == 1e8 and parse_rate("2.5gbit") == 2.5e9 and math.isinf(parse_rate("inf"))
    assert parse_time("50us") == pytest.approx(50e-6) and parse_time("2ms") == pytest.approx(2e-3)
    assert Link.parse("1gbit@2ms") == Link(1e9, 2e-3)
    assert format_rate(1e9) == "1gbit" and format_rate(1e8) == "100mbit"
    with pytest.raises(ValueError, match="'1gbps'"):
        parse_rate("1gbps")
    with pytest.raises(ValueError, match="latency"):
        Link(1e9, -1.0)
    with pytest.raises(ValueError, match="wan"):
        Network(Link(1e9), sites=2)


def test_ring_formulas() -> None:
    # 2 ranks: each sends half the vector twice, i.e. the whole vector once: 125 MB at 1 Gbit/s = 1 s
    assert ring_allreduce_seconds(125e6, 2, GBIT) == pytest.approx(1.0)
    assert ring_allreduce_seconds(125e6, 4, GBIT) == pytest.approx(1.5)
    lat = Network(Link(1e9, 1e-3))
    assert ring_allreduce_seconds(0.0, 4, lat) == pytest.approx(6e-3)  # 2(N-1) latency-bound steps
    assert ring_allgather_seconds(1e6, 4, lat) == pytest.approx(3 * (1e-3 + 8e-3))
    assert broadcast_seconds(1e6, 8, lat) == pytest.approx(3 * (1e-3 + 8e-3))
    assert ring_allreduce_seconds(1e9, 1, GBIT) == 0.0 and ring_allgather_seconds(1e9, 1, GBIT) == 0.0


def test_two_level_topology() -> None:
    geo = Network(Link(10e9, 0.0), sites=2, wan=Link(100e6, 0.0))
    # a flat ring runs every step at the WAN's pace
    assert ring_allreduce_seconds(1e6, 8, geo) == pytest.approx(ring_allreduce_seconds(1e6, 8, Network(Link(100e6, 0.0))))
    # hierarchical: reduce in the site (fast), only 2(s-1)/s of the vector crosses the WAN
    hier = hierarchical_allreduce_seconds(1e6, 8, geo)
    assert hier == pytest.approx(ring_allreduce_seconds(1e6, 4, Network(Link(10e9, 0.0))) + 8e6 / 100e6)
    assert hier < ring_allreduce_seconds(1e6, 8, geo)
    assert hierarchical_allreduce_seconds(1e6, 8, GBIT) == pytest.approx(ring_allreduce_seconds(1e6, 8, GBIT))


@pytest.mark.parametrize(("world", "expected"), [(4, ALLGATHER_PACKED), (7, ALLGATHER_PACKED), (9, ALLREDUCE_INT8), (16, ALLREDUCE_INT8)])
def test_allgather_int8_crossover(world: int, expected: str) -> None:
    """2-bit packing: all-gather sends (N-1) n/4, an int8 all-reduce 2(N-1)/N n bytes: equal at N = 8."""
    n = 1_000_000
    plan = choose_collective(n, world, GBIT, packed_nbytes=n / 4, cost=FREE, int8=True, shared_statistic=False)
    assert plan.choice == expected
    at8 = choose_collective(n, 8, GBIT, packed_nbytes=n / 4, cost=FREE, int8=True, shared_statistic=False)
    assert at8.seconds[ALLGATHER_PACKED] == pytest.approx(at8.seconds[ALLREDUCE_INT8])


def test_int8_never_beyond_127_ranks() -> None:
    n = 1_000_000
    plan = choose_collective(n, 128, GBIT, packed_nbytes=n / 4, cost=FREE, int8=True)
    assert ALLREDUCE_INT8 not in plan.seconds
    assert plan.choice == ALLREDUCE_FP32  # 127 n/4 bytes gathered is more than 2 * 4n all-reduced


def test_compression_off_when_it_does_not_pay() -> None:
    """Break-even encode cost: fp32 all-reduce time minus the packed all-gather time, per element."""
    n, world = 10_000_000, 2
    fast = Network(Link(10e9, 0.0))
    saved = ring_allreduce_seconds(4 * n, world, fast) - ring_allgather_seconds(n / 4, world, fast)
    per_element = saved / n
    cheap = choose_collective(n, world, fast, packed_nbytes=n / 4, cost=CompressionCost(0.9 * per_element, 0.0), shared_statistic=False)
    dear = choose_collective(n, world, fast, packed_nbytes=n / 4, cost=CompressionCost(1.1 * per_element, 0.0), shared_statistic=False)
    assert cheap.choice == ALLGATHER_PACKED and dear.choice == ALLREDUCE_FP32
    # an unlimited link: nothing to save, any compute is a loss
    free_link = Network(Link(math.inf, 0.0))
    assert choose_collective(n, world, free_link, packed_nbytes=n / 4, cost=CompressionCost(1e-12, 0.0)).choice == ALLREDUCE_FP32
    # slow link: compression wins even at a high compute cost
    slow = Network(Link(100e6, 1e-4))
    assert choose_collective(n, world, slow, packed_nbytes=n / 4, cost=CompressionCost(1e-8, 1e-9)).choice == ALLGATHER_PACKED


def test_latency_bound_small_bucket_stays_fp32() -> None:
    """A shared scaler costs one more latency-bound round: for tiny buckets that outweighs the bytes saved."""
    net = Network(Link(1e9, 1e-3))
    plan = choose_collective(100, 4, net, packed_nbytes=25, cost=FREE, int8=True, shared_statistic=True)
    assert plan.choice == ALLREDUCE_FP32
    no_stat = choose_collective(100, 4, net, packed_nbytes=25, cost=FREE, shared_statistic=False)
    assert no_stat.choice == ALLGATHER_PACKED  # (N-1) latencies instead of 2(N-1)
