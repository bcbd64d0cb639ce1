"""What a compressor costs per step: its exact bytes on the wire, and its codec time, on random tensors.

The strategy announces these bytes when training starts; the performance model (``gradcomp_lab.perfmodel``) adds
the times and a cost model of the network to predict a step.
"""

import time
from dataclasses import dataclass

import torch

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.validation import check_int

#: (parameter name, shape) of every tensor a step sends
Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Codec:
    """What a compressor puts on the wire per step and what it costs to compute, for one world size.

    Attributes:
        nbytes: bytes per rank per step (exact: the compressor's own packets for every parameter shape).
        aggregation: how the packets travel.
        encode_s: compression seconds per step (measured here, or from a device model).
        decode_s: decoding seconds per step (all N packets for an all-gather, one for an all-reduce).
        rounds: small blocking all-reduces per bucket before the payload (shared scalers).
    """

    nbytes: float
    aggregation: Aggregation
    encode_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0


def measure_codec(compressor: Compressor, shapes: Shapes, world_size: int, timed: bool = True) -> Codec:
    """Compress random tensors of every shape with ``compressor`` (set up as rank 0 of ``world_size``).

    Bytes are exact; times are this machine's (``timed=False`` skips decoding and reports 0 s).
    """
    check_int("world_size", world_size, minimum=1)
    compressor.setup(0, world_size, torch.device("cpu"))
    aggregation = compressor.aggregation_for(world_size)
    gen = torch.Generator().manual_seed(0)
    grads = [(name, torch.randn(*shape, generator=gen) * 1e-3) for name, shape in shapes]
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
    rounds = 1 if compressor.local_statistic(grads[0][1], grads[0][0]) is not None else 0
    return Codec(float(sum(p.nbytes for p in packets)), aggregation, encode if timed else 0.0, decode, rounds)
