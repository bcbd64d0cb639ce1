"""What a compressor costs per step: its exact bytes on the wire, and its codec time.

Measured by running the hook's exchange itself (:func:`lightning_gradcomp.exchange.hook.gradcomp_hook`: the groups, error
feedback, the compressor's group methods, the shared statistics, decoding) on one bucket holding every tensor, over
a :class:`~lightning_gradcomp.exchange.transport.LoopbackTransport` (this rank stands in for every rank), and reading bytes
from its ledger: what is timed and counted is the code that trains. The strategy announces these bytes when
training starts; the collective planner probes each bucket with :func:`measure_exchange`; the performance model
(``gradcomp_lab.perfmodel``) adds the times and a cost model of the network to predict a step.
"""

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.exchange.groups import TensorBucket
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.exchange.transport import LoopbackTransport
from lightning_gradcomp.validation import check_int

#: (parameter name, shape) of every tensor a step sends
Shapes = list[tuple[str, tuple[int, ...]]]

#: timed exchanges (the median is reported), after one that warms up (plans, factors, a residual, the allocator):
#: one pass over a large model varies by 2x on a shared machine
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
        collective: the payload's collective, as the hook's ledger names it (``"allgather"``,
            ``"allreduce_<dtype>"``, ``"allreduce_round"`` for a multi-round compressor; ``""`` at one rank).
    """

    nbytes: float
    aggregation: Aggregation
    encode_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0
    shared_nbytes: float = 0.0
    collective: str = ""


def measure_codec(compressor: Compressor, shapes: Shapes, world_size: int, timed: bool = True) -> Codec:
    """Exchange random tensors of every shape with ``compressor`` (set up as rank 0 of ``world_size``).

    Bytes are exact; times are this machine's (``timed=False`` runs one exchange and reports 0 s).
    """
    check_int("world_size", world_size, minimum=1)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=gen) * 1e-3 for _, shape in shapes]
    compressor.setup(0, world_size, torch.device("cpu"))
    return measure_exchange(compressor, [name for name, _ in shapes], tensors, world_size, _REPEATS if timed else 0)


class _TimedLoopback(LoopbackTransport):
    """The loopback transport, marking when the last payload collective was launched (compression is over)."""

    launched: float = 0.0

    def sum(self, tensor: Tensor) -> Future:
        self.launched = time.perf_counter()
        return super().sum(tensor)

    def gather(self, tensor: Tensor, out: Tensor) -> tuple[Future, Tensor]:
        self.launched = time.perf_counter()
        return super().gather(tensor, out)


def measure_exchange(compressor: Compressor, names: list[str], tensors: list[Tensor], world_size: int,
                     repeats: int = _REPEATS, float_names: frozenset[str] = frozenset(),
                     layer_compressors: Optional[Mapping[str, Compressor]] = None) -> Codec:
    """One bucket of ``tensors`` (named ``names``) through the hook's exchange with ``compressor`` (already set up
    for ``world_size`` ranks), every rank's contribution being this rank's; the ``float_names`` among them are sent
    in fp32, as a strategy's ``exclude`` or a preset's embeddings are; ``layer_compressors`` (set up) compress the
    layers they name, as a preset's embedding rows are.

    The first exchange warms up and gives the bytes (from the ledger) and the collectives; ``repeats`` more are timed
    (medians): encoding until the last payload collective is launched, decoding after it. A multi-round compressor
    encodes and decodes between its rounds: its whole exchange is reported as encoding.
    """
    transport = _TimedLoopback(world_size, compressor.rank)
    state = GradCompState(compressor, {id(t): n for t, n in zip(tensors, names)}, float_names, world_size=world_size,
                          nonfinite="ignore", transport=transport, layer_compressors=layer_compressors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    buffer = torch.empty_like(flat)
    bucket = TensorBucket(buffer, tensors)
    multiround = isinstance(compressor, MultiRoundCompressor)
    encode: list[float] = []
    decode: list[float] = []
    for attempt in range(1 + repeats):
        buffer.copy_(flat)  # the hook writes the mean over the gradients
        transport.launched = 0.0
        start = time.perf_counter()
        gradcomp_hook(state, bucket).wait()
        end = time.perf_counter()
        if attempt:
            launched = end if multiround or not transport.launched else transport.launched
            encode.append(launched - start)
            decode.append(end - launched)
    ledger = state.ledger
    kinds = [k for k in ledger.collectives if k not in ("allreduce_max", "allgather_sizes")]
    return Codec(
        nbytes=float(ledger.payload_bytes_per_step()),
        aggregation=compressor.aggregation,
        encode_s=statistics.median(encode) if encode else 0.0,
        decode_s=statistics.median(decode) if decode else 0.0,
        rounds=1 if ledger.collectives["allreduce_max"] else 0,
        shared_nbytes=float(ledger.shared_bytes_per_step()),
        collective=kinds[-1] if kinds else "",
    )
