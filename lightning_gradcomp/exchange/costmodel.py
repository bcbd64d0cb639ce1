"""An alpha-beta cost model of the collectives, and the choice of collective for a bucket.

Pure Python (no torch): every function maps sizes and links to predicted seconds.

Model (Hockney's alpha-beta, ring algorithms as Gloo and NCCL run them):

* one message of ``b`` bytes over a link costs ``alpha + 8 b / B`` (latency ``alpha``, bandwidth ``B`` bit/s);
* ring all-reduce of ``S`` bytes on ``N`` ranks: ``2 (N-1)`` steps of ``S/N`` bytes;
* ring all-gather of ``s`` bytes per rank: ``N-1`` steps of ``s`` bytes;
* broadcast: a binomial tree, ``ceil(log2 N)`` rounds of the whole payload.

Every link is full duplex and each rank has its own (a switch or bridge in a star), so the ring steps of all
ranks run in parallel. With ``sites`` (two-level topology, WeightGrad's geo-distributed setting) ranks are split
into equal, contiguous groups joined by WAN links; a flat ring then crosses the WAN once in each direction per
step, so every step runs at the slowest link's pace. :func:`hierarchical_allreduce_seconds` is the two-level
alternative (reduce-scatter inside a site, all-reduce across sites, all-gather inside a site).
"""

import math
import re
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_gradcomp.validation import check_int, check_number

#: per-message latency assumed when a link spec gives none (Gloo over TCP on a veth pair, measured on the
#: emulated cluster: see docs/benchmarks.md)
DEFAULT_LATENCY = 100e-6

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(spec: str) -> float:
    """Bits per second from a ``tc``-style rate: ``"100mbit"``, ``"1gbit"``, ``"2.5gbit"``; ``"inf"`` is unlimited."""
    text = spec.strip().lower()
    if text in ("inf", "none", "unlimited"):
        return math.inf
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(bit|kbit|mbit|gbit|tbit)", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"Expected a rate such as '100mbit', '1gbit' or 'inf', but got {spec!r}. Fix: a positive number followed "
            f"by one of {sorted(_RATE_UNITS)}."
        )
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_time(spec: str) -> float:
    """Seconds from ``"50us"``, ``"2ms"``, ``"0.1s"``."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us|ns)", spec.strip().lower())
    if not m:
        raise ValueError(f"Expected a duration such as '50us' or '2ms', but got {spec!r}. Fix: a number and one of s, ms, us, ns.")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def format_rate(bits_per_second: float) -> str:
    """The inverse of :func:`parse_rate`, for logs and tables."""
    if math.isinf(bits_per_second):
        return "inf"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


@dataclass(frozen=True)
class Link:
    """One full-duplex link: ``bandwidth`` in bit/s (``math.inf``: unlimited) and per-message ``latency`` in s."""

    bandwidth: float
    latency: float = DEFAULT_LATENCY

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise ValueError(f"Expected `bandwidth` to be a positive number of bit/s, but got {self.bandwidth!r}.")
        check_number("latency", self.latency, minimum=0.0, fix="give seconds, e.g. 50e-6")

    @classmethod
    def parse(cls, spec: str) -> "Link":
        """``"1gbit"`` or ``"1gbit@50us"`` (rate, optionally ``@`` latency)."""
        rate, _, latency = spec.partition("@")
        return cls(parse_rate(rate), parse_time(latency) if latency else DEFAULT_LATENCY)

    def seconds(self, nbytes: float) -> float:
        """One message of ``nbytes``."""
        return self.latency + 8.0 * nbytes / self.bandwidth

    def __str__(self) -> str:
        return f"{format_rate(self.bandwidth)}@{self.latency * 1e6:g}us"


@dataclass(frozen=True)
class Network:
    """Where the ranks sit: one link per rank into a switch, optionally ``sites`` switches joined by ``wan`` links.

    Ranks are split into ``sites`` equal, contiguous groups (rank r is in site ``r // (N / sites)``).
    """

    link: Link
    sites: int = 1
    wan: Optional[Link] = None

    def __post_init__(self) -> None:
        check_int("sites", self.sites, minimum=1)
        if self.sites > 1 and self.wan is None:
            raise ValueError(f"Expected `wan` (the link between sites) with `sites={self.sites}`, but got None.")

    @classmethod
    def parse(cls, spec: Union[str, Link, "Network"]) -> "Network":
        """A ``Network`` from itself, a :class:`Link`, or a link spec string (``"1gbit@50us"``)."""
        if isinstance(spec, Network):
            return spec
        if isinstance(spec, Link):
            return cls(spec)
        fix = (
            f"a rate such as '1gbit' or '100mbit@2ms' (a positive number, one of {sorted(_RATE_UNITS)}, optionally "
            f"'@' and a latency), a Link or a Network"
        )
        if isinstance(spec, str):
            try:
                return cls(Link.parse(spec))
            except ValueError as exc:
                raise ValueError(f"Expected `link` to be a link spec, but got {spec!r}. Fix: pass {fix}.") from exc
        raise ValueError(f"Expected `link` to be a rate string, a Link or a Network, but got {spec!r}. Fix: pass {fix}.")

    def ring_link(self, world_size: int) -> Link:
        """The link a flat ring over ``world_size`` ranks runs at: the slowest it crosses."""
        if self.sites == 1 or world_size <= 1 or self.wan is None:
            return self.link
        return Link(min(self.link.bandwidth, self.wan.bandwidth), max(self.link.latency, self.wan.latency))

    def __str__(self) -> str:
        return str(self.link) if self.sites == 1 else f"{self.link} x {self.sites} sites, wan {self.wan}"


# -- collectives ------------------------------------------------------------------------------------------
def ring_allreduce_seconds(nbytes: float, world_size: int, network: Network) -> float:
    """Ring all-reduce (reduce-scatter + all-gather) of ``nbytes`` per rank."""
    if world_size <= 1:
        return 0.0
    link = network.ring_link(world_size)
    n = world_size
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * 8.0 * nbytes / link.bandwidth


def ring_allgather_seconds(nbytes_per_rank: float, world_size: int, network: Network) -> float:
    """Ring all-gather: every rank ends with every rank's ``nbytes_per_rank``."""
    if world_size <= 1:
        return 0.0
    link = network.ring_link(world_size)
    return (world_size - 1) * link.seconds(nbytes_per_rank)


def broadcast_seconds(nbytes: float, world_size: int, network: Network) -> float:
    """Binomial-tree broadcast of ``nbytes`` from one rank."""
    if world_size <= 1:
        return 0.0
    return math.ceil(math.log2(world_size)) * network.ring_link(world_size).seconds(nbytes)


def hierarchical_allreduce_seconds(nbytes: float, world_size: int, network: Network) -> float:
    """Two-level all-reduce: reduce-scatter in each site, all-reduce across sites, all-gather in each site.

    The ``m = N / sites`` ranks of a site each all-reduce ``nbytes / m`` across sites, sharing their site's
    WAN link; equal to :func:`ring_allreduce_seconds` with one site.
    """
    if network.sites == 1 or world_size <= network.sites:
        return ring_allreduce_seconds(nbytes, world_size, Network(network.ring_link(world_size)))
    assert network.wan is not None
    m = world_size // network.sites
    inside = Network(network.link)
    # reduce-scatter + all-gather inside the site: the two halves of a ring all-reduce
    local = ring_allreduce_seconds(nbytes, m, inside)
    # m concurrent cross-site all-reduces of nbytes/m each share one WAN link: together nbytes over it
    s = network.sites
    wan = 2 * (s - 1) * network.wan.latency + 2 * (s - 1) / s * 8.0 * nbytes / network.wan.bandwidth
    return local + wan


# -- the choice of collective -----------------------------------------------------------------------------
#: the collectives a bucket can travel by
ALLREDUCE_FP32 = "allreduce_fp32"
ALLGATHER_PACKED = "allgather_packed"
ALLREDUCE_INT8 = "allreduce_int8"


@dataclass(frozen=True)
class Candidate:
    """One way to exchange a bucket: the collective, its bytes per rank, and the local compute it costs.

    Attributes:
        name: :data:`ALLREDUCE_FP32`, :data:`ALLGATHER_PACKED`, :data:`ALLREDUCE_INT8` (or any label).
        collective: ``"allreduce"`` or ``"allgather"``.
        nbytes: bytes this rank contributes (all-reduce: the whole vector; all-gather: its own payload).
        compute_seconds: compression plus decoding on this rank (0 for plain fp32).
        rounds: extra small blocking all-reduces before the payload (TernGrad's shared-scaler max: 1).
    """

    name: str
    collective: str
    nbytes: float
    compute_seconds: float = 0.0
    rounds: int = 0


def candidate_seconds(candidate: Candidate, world_size: int, network: Network) -> float:
    """Predicted seconds of one candidate: compute, small statistic rounds, the payload's collective."""
    if candidate.collective == "allreduce":
        comm = ring_allreduce_seconds(candidate.nbytes, world_size, network)
    elif candidate.collective == "allgather":
        comm = ring_allgather_seconds(candidate.nbytes, world_size, network)
    else:
        raise ValueError(f"Expected `collective` to be 'allreduce' or 'allgather', but got {candidate.collective!r}.")
    # a statistic round is a tiny all-reduce: latency-bound
    stat = candidate.rounds * ring_allreduce_seconds(4.0, world_size, network)
    return candidate.compute_seconds + stat + comm


@dataclass(frozen=True)
class CompressionCost:
    """Local compute of a compressor, in seconds per element of the gradient.

    Attributes:
        encode: compress one element (statistics, rounding, packing).
        decode: decode one element of one packet and add it to the sum (an all-gather decodes N packets,
            an all-reduce of summable values one).
    """

    encode: float
    decode: float

    def __post_init__(self) -> None:
        check_number("encode", self.encode, minimum=0.0, fix="give seconds per element, e.g. 5e-9")
        check_number("decode", self.decode, minimum=0.0, fix="give seconds per element, e.g. 2e-9")


@dataclass(frozen=True)
class CollectivePlan:
    """The chosen collective for a bucket and the predicted seconds of every candidate."""

    choice: str
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        others = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        return f"{self.choice} (predicted: {others})"


def choose(candidates: list[Candidate], world_size: int, network: Network) -> CollectivePlan:
    """The fastest candidate; ties go to the earlier one (list plain fp32 first to prefer it)."""
    if not candidates:
        raise ValueError("Expected at least one candidate collective, but got none.")
    seconds = {c.name: candidate_seconds(c, world_size, network) for c in candidates}
    best = min(candidates, key=lambda c: seconds[c.name])
    return CollectivePlan(best.name, seconds)


def choose_collective(
    numel: int,
    world_size: int,
    network: Network,
    *,
    packed_nbytes: Optional[float],
    cost: CompressionCost,
    int8: bool = False,
    shared_statistic: bool = True,
    allow_fp32: bool = True,
) -> CollectivePlan:
    """Pick, for a bucket of ``numel`` gradient elements, how it should travel on this network.

    Args:
        numel: gradient elements in the bucket.
        world_size: ranks exchanging it.
        network: links between the ranks.
        packed_nbytes: bytes of this rank's packed payload (all-gather); ``None`` when the compressor cannot
            be all-gathered.
        cost: the compressor's compute per element.
        int8: whether an int8 all-reduce of summable values (TernGrad with a shared scaler) is possible.
        shared_statistic: whether compression needs a blocking max all-reduce first (a shared scaler).
        allow_fp32: whether plain fp32 all-reduce (compression off) is a candidate.

    Returns:
        the plan: :data:`ALLREDUCE_FP32`, :data:`ALLGATHER_PACKED` or :data:`ALLREDUCE_INT8`, with every
        candidate's predicted seconds.
    """
    check_int("numel", numel, minimum=0)
    check_int("world_size", world_size, minimum=1)
    rounds = 1 if shared_statistic else 0
    encode = cost.encode * numel
    candidates = []
    if allow_fp32:
        candidates.append(Candidate(ALLREDUCE_FP32, "allreduce", 4.0 * numel))
    if packed_nbytes is not None:
        decode = cost.decode * numel * world_size
        candidates.append(Candidate(ALLGATHER_PACKED, "allgather", packed_nbytes, encode + decode, rounds))
    if int8 and world_size <= 127:  # int8 sums of N ternaries overflow beyond 127 ranks
        candidates.append(Candidate(ALLREDUCE_INT8, "allreduce", float(numel), encode + cost.decode * numel, rounds))
    return choose(candidates, world_size, network)
