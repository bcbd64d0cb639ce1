"""What a compressor costs per step: its exact bytes on the wire, and its codec time, on random tensors.

The strategy announces these bytes when training starts; the performance model (``gradcomp_lab.perfmodel``) adds
the times and a cost model of the network to predict a step.
"""

import statistics
import time
from dataclasses import dataclass

import torch

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.compressors.multiround import FlatExchanged, MultiRoundCompressor
from lightning_gradcomp.memory import ResidualMemory
from lightning_gradcomp.segments import Segments
from lightning_gradcomp.validation import check_int

#: (parameter name, shape) of every tensor a step sends
Shapes = list[tuple[str, tuple[int, ...]]]

#: timed exchanges of a multi-round compressor (the median is reported): one pass over a large model varies by 2x
#: on a shared machine
_REPEATS = 3


@dataclass(frozen=True)
class Codec:
    """What a compressor puts on the wire per step and what it costs to compute, for one world size.

    Attributes:
        nbytes: bytes per rank per step (exact: the compressor's own packets for every parameter shape).
        aggregation: how the packets travel.
        encode_s: compression seconds per step (measured here, or from a device model).
        decode_s: decoding seconds per step (all N packets for an all-gather, one for an all-reduce).
        rounds: small blocking all-reduces per bucket before the payload (shared scalers).
        shared_nbytes: bytes per rank per step of those all-reduces (float32 statistics, as the hook sends them).
    """

    nbytes: float
    aggregation: Aggregation
    encode_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0
    shared_nbytes: float = 0.0


def measure_codec(compressor: Compressor, shapes: Shapes, world_size: int, timed: bool = True) -> Codec:
    """Compress random tensors of every shape with ``compressor`` (set up as rank 0 of ``world_size``).

    Bytes are exact; times are this machine's (``timed=False`` skips decoding and reports 0 s).
    """
    check_int("world_size", world_size, minimum=1)
    compressor.setup(0, world_size, torch.device("cpu"))
    aggregation = compressor.aggregation_for(world_size)
    gen = torch.Generator().manual_seed(0)
    grads = [(name, torch.randn(*shape, generator=gen) * 1e-3) for name, shape in shapes]
    if isinstance(compressor, MultiRoundCompressor):
        return _measure_rounds(compressor, grads, aggregation, timed)
    for name, g in grads:  # as the hook does before compressing (AdaComp keeps the step's gradient apart)
        compressor.observe_gradient(g, name)
    start = time.perf_counter()
    packets = [compressor.compress(g, name, None) for name, g in grads]
    encode = time.perf_counter() - start
    decode = 0.0
    if timed:
        start = time.perf_counter()
        for p in packets:
            if aggregation is Aggregation.GATHER:
                compressor.decompress_sum([p] * world_size)
            else:
                compressor.decompress(p)
        decode = time.perf_counter() - start
    statistics = [compressor.local_statistic(g, name) for name, g in grads]
    rounds = 1 if statistics[0] is not None else 0
    shared = float(sum(4 * s.numel() for s in statistics if s is not None))  # the hook all-reduces them as float32
    return Codec(float(sum(p.nbytes for p in packets)), aggregation, encode if timed else 0.0, decode, rounds, shared)


def _measure_rounds(compressor: MultiRoundCompressor, grads: list[tuple[str, torch.Tensor]], aggregation: Aggregation,
                    timed: bool) -> Codec:
    """A multi-round compressor's codec is its exchange (the hook encodes and decodes between its rounds), timed as
    the hook runs it on one group holding every tensor: error feedback added, :meth:`~lightning_gradcomp.
    compressors.multiround.MultiRoundCompressor.exchange_flat` with the rounds as identities, the new residual, the
    mean written back. Its per-layer ``compress`` runs other products (one matrix at a time) and none of the flat
    path's gathers and scatters, so it under-predicted the hook (``docs/benchmarks.md``, section 7)."""
    segments = Segments([n for n, _ in grads], [g.shape for _, g in grads])
    flat = torch.cat([g.reshape(-1) for _, g in grads])
    memory, buffer = ResidualMemory(), torch.empty_like(flat)

    def step() -> FlatExchanged:  # the hook's multi-round group step, with the rounds as identities
        compensated = memory.compensate_flat(flat, segments)
        result = compressor.exchange_flat(compensated, segments, lambda t: t)
        memory.update_flat(segments, compensated, result.sent)
        buffer.copy_(result.mean)
        return result

    result = step()  # also the warm start: plans, factors, a residual
    times: list[float] = []
    for _ in range(_REPEATS if timed else 0):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return Codec(float(sum(result.layer_nbytes)), aggregation, statistics.median(times) if times else 0.0, 0.0, 0)
