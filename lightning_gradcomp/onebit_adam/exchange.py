"""1-bit Adam's compressed all-reduce: worker and server compression, each with its own error compensation.

Tang et al. (2021), Section 4 / Algorithm 1: the flat vector (momentum for 1-bit Adam; gradient or accumulated
update for 0/1 Adam) is cut into one chunk per rank, rank ``r`` being the "server" of chunk ``r``:

Both compression stages are the hook's group step (:func:`~lightning_gradcomp.exchange.hook.group_step`: error
feedback, compression, residual update, the ledger's record), each over its own
:class:`~lightning_gradcomp.exchange.hook.GroupState` (its residuals and ledger), and both collectives travel on the
exchange's :class:`~lightning_gradcomp.exchange.transport.Transport`:

1. worker stage: each rank adds its worker error to the vector, compresses it to one bit per element
   (:class:`~lightning_gradcomp.compressors.OneBit`, one group per *piece*: the part of a tensor that falls in one
   chunk, with its own sign bits and two reconstruction values, so that layers of different scales never share a
   scale, as DeepSpeed compressed each tensor on its own), and keeps what the bits did not carry as its new worker
   error (:class:`~lightning_gradcomp.exchange.memory.ResidualMemory`, one residual per piece);
2. an all-to-all sends chunk ``r`` of every rank to rank ``r`` (``Transport.scatter_to_owners``);
3. server stage: rank ``r`` decodes the ``W`` packets of its chunk, averages them (in rank order), adds its server
   error, compresses the mean again (per piece) and keeps what those bits did not carry as its server error;
4. an all-gather of the servers' packets (``Transport.gather_from_owners``, unequal sizes); every
   rank decodes every chunk from the same bytes, so the result is bit-identical on every rank.

Bytes this rank contributes per exchange: its worker packet (every piece: ``ceil(n / 8) + 8`` bytes) plus its
server packet (the pieces of its chunk), about ``n (1 + 1 / W) / 8`` for ``n`` elements on ``W`` ranks:
``32 W / (W + 1)`` times less than fp32's ``4 n`` (21x on 2 ranks, 26x on 4), less 8 bytes per piece. An all-gather of the full 1-bit
vectors would put ``n / 8`` on the wire per rank and need no server stage, but deliver ``W n / 8`` to every rank;
this two-stage form delivers ``2 (W - 1) n / (8 W)``, whatever the number of ranks.
"""

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.onebit import OneBit
from lightning_gradcomp.exchange.groups import LayerGroup
from lightning_gradcomp.exchange.hook import GroupState, group_step
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.exchange.transport import ProcessGroupTransport, Transport
from lightning_gradcomp.validation import check_int


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """``numel`` elements cut into ``world_size`` consecutive chunks, the first ``numel % world_size`` one longer."""
    base, extra = divmod(numel, world_size)
    return [base + (r < extra) for r in range(world_size)]


def chunk_pieces(tensors: Sequence[tuple[str, int]], world_size: int,
                 block_size: Optional[int] = None) -> list[list[tuple[str, int]]]:
    """Per chunk, its pieces ``(name, numel)``: the tensors laid out back to back, cut at the chunk boundaries; a
    tensor cut in several chunks is named ``"<name>:<chunk>"`` in each, a whole one keeps its name. With
    ``block_size``, each such piece is cut further into blocks of that many elements (the last one shorter), named
    ``"<piece>#<block>"``: each block gets its own reconstruction values."""
    sizes = chunk_sizes(sum(n for _, n in tensors), world_size)
    out: list[list[tuple[str, int]]] = [[] for _ in sizes]
    chunk, room = 0, sizes[0] if sizes else 0
    for name, numel in tensors:
        left, parts = numel, []
        while left:
            while room == 0:
                chunk += 1
                room = sizes[chunk]
            take = min(left, room)
            parts.append((chunk, take))
            left -= take
            room -= take
        for c, n in parts:
            out[c].append((name if len(parts) == 1 else f"{name}:{c}", n))
    if block_size is None:
        return out
    return [[(f"{name}#{i}", min(block_size, n - i * block_size)) for name, n in chunk
             for i in range(-(-n // block_size))] for chunk in out]


class CompressedAllReduce:
    """The two-stage 1-bit all-reduce with worker and server error compensation (see the module docstring).

    Args:
        tensors: the vector's tensors in order, ``(name, numel)`` (fixed for the run): each piece of a tensor gets its
            own reconstruction values.
        rank: this rank's index in ``group``.
        world_size: ranks in ``group``.
        group: the process group (``None``: the default group).
        block_size: cut every piece into blocks of this many elements, each with its own two reconstruction
            values (8 more bytes per block: ``block_size=64`` sends 2 bits per element instead of 1). ``None``
            (default): one pair per piece, as DeepSpeed's one scale per tensor. A piece mixes coordinates of very
            different scales where a tensor does (a fused query-key-value bias: the key bias has no gradient, since
            softmax ignores it); the per-piece values then give its coordinates of near-zero variance updates of
            ``m / sqrt(v)`` in the thousands, and training diverges (measured on the LM benchmark's GPT,
            ``docs/onebit_adam.md``).
        transport: what carries the two collectives (``None``: torch.distributed over ``group``); a
            :class:`~lightning_gradcomp.exchange.transport.LoopbackTransport` times the exchange alone.

    Attributes:
        worker_step: the worker stage's group-step state (its residuals, one per piece, and its ledger).
        server_step: the server stage's (the pieces of this rank's chunk).
        exchanges: exchanges since construction.
    """

    def __init__(self, tensors: Sequence[tuple[str, int]], rank: int, world_size: int,
                 group: Optional[dist.ProcessGroup] = None, block_size: Optional[int] = None,
                 transport: Optional[Transport] = None) -> None:
        if block_size is not None:
            check_int("block_size", block_size, minimum=1, fix="use e.g. 64, or None for one scale per piece")
        self.numel = sum(n for _, n in tensors)
        self.block_size = block_size
        self.rank = rank
        self._world_size = world_size
        self.group = group
        self.compressor = OneBit(granularity="tensor")
        self.sizes = chunk_sizes(self.numel, world_size)
        pieces = chunk_pieces(tensors, world_size, block_size)
        # every chunk's pieces, as each server compresses and every rank decodes them
        self._chunk = [Segments([n for n, _ in p], [torch.Size([k]) for _, k in p]) for p in pieces]
        self.worker_segments = Segments([n for p in pieces for n, _ in p], [torch.Size([k]) for p in pieces for _, k in p])
        self.server_segments = self._chunk[rank]
        # each chunk's pieces' packet sizes, for decoding its packets, and their sum, for the collectives' splits (a
        # chunk's worker and server packets have that size); fixed for the run
        self._chunk_nbytes = [tuple(self.compressor.payload_nbytes(k) for _, k in p) for p in pieces]
        self.server_nbytes = [sum(sizes) for sizes in self._chunk_nbytes]
        self.transport: Transport = ProcessGroupTransport(group, world_size) if transport is None else transport
        self.worker_step = GroupState(self.transport)
        self.server_step = GroupState(self.transport)
        self._worker_group = _whole(self.compressor, self.worker_segments)
        self._server_group = _whole(self.compressor, self.server_segments)
        self.exchanges = 0

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def worker(self) -> ResidualMemory:
        """The worker errors, one residual per piece."""
        return self.worker_step.memory

    @property
    def server(self) -> ResidualMemory:
        """The server errors of this rank's chunk, one residual per piece."""
        return self.server_step.memory

    @property
    def last_nbytes(self) -> int:
        """Bytes this rank contributed to the latest exchange, as its two stages' ledgers recorded them (0 before the
        first, and at one rank)."""
        return self.worker_step.ledger.last_step_bytes() + self.server_step.ledger.last_step_bytes()

    def average(self, flat: Tensor) -> Tensor:
        """The mean over ranks of ``flat`` (float32, ``numel`` elements) as compressed twice, identical on every rank.

        At one rank the vector is returned as is (nothing to exchange, nothing compressed)."""
        if flat.numel() != self.numel:
            raise ValueError(
                f"Expected a vector of the {self.numel} elements the exchange was built for, but got {flat.numel()}. "
                f"Fix: keep the optimizer's parameters fixed after setup."
            )
        if self._world_size == 1:
            return flat
        onebit = self.compressor
        # worker stage: the group step over every piece, with the worker errors
        packet = group_step(self.worker_step, self._worker_group, flat)
        mine = self.server_nbytes[self.rank]  # a chunk's worker packet has the size of its server packet
        received = torch.empty(self._world_size * mine, dtype=torch.uint8, device=flat.device)
        self.transport.scatter_to_owners(received, packet.payload, self.server_nbytes)
        self.worker_step.ledger.count("scatter_to_owners")
        # server stage: this rank's chunk from every worker, averaged in rank order, then the group step with the
        # server errors
        chunk = self._chunk[self.rank]
        sizes = self._chunk_nbytes[self.rank]
        packets = [FlatPacket(received[i * mine : (i + 1) * mine], chunk, torch.float32, sizes)
                   for i in range(self._world_size)]
        mean = onebit.decompress_flat_mean_into(packets, torch.empty(self.sizes[self.rank], device=flat.device))
        server_packet = group_step(self.server_step, self._server_group, mean)
        # every server's packet to every rank; all decode the same bytes
        gathered = torch.empty(sum(self.server_nbytes), dtype=torch.uint8, device=flat.device)
        repeated = torch.empty(self._world_size * server_packet.payload.numel(), dtype=torch.uint8, device=flat.device)
        self.transport.gather_from_owners(gathered, server_packet.payload, self.server_nbytes, repeated).wait()
        self.server_step.ledger.count("gather_from_owners")
        parts, offset = [], 0
        for r, size in enumerate(self.server_nbytes):
            raw = gathered[offset : offset + size]
            parts.append(onebit.decompress_flat(FlatPacket(raw, self._chunk[r], torch.float32,
                                                           self._chunk_nbytes[r])))
            offset += size
        self.exchanges += 1
        return torch.cat(parts)

    def expected_nbytes(self) -> int:
        """Bytes this rank contributes to one exchange: its worker packet (every chunk) and its server packet."""
        return 0 if self._world_size == 1 else sum(self.server_nbytes) + self.server_nbytes[self.rank]

    def reset_errors(self) -> None:
        """Zero both error buffers (0/1 Adam, when the variance freezes)."""
        self.worker_step.memory = ResidualMemory()
        self.server_step.memory = ResidualMemory()

    def error_norms(self) -> dict[str, Tensor]:
        """L2 norms of this rank's worker error (all chunks) and server error (0-d tensors)."""
        worker = torch.stack([self.worker.norm(n) for n in self.worker_segments.names])
        server = torch.stack([self.server.norm(n) for n in self.server_segments.names])
        return {"worker_error_norm": worker.norm(), "server_error_norm": server.norm()}

    def state_dict(self) -> dict[str, Any]:
        return {"pieces": list(self.worker_segments.names), "worker": self.worker.state_dict(), "server": self.server.state_dict(),
                "exchanges": self.exchanges}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        if list(state["pieces"]) != list(self.worker_segments.names):
            raise ValueError(
                f"Expected the exchange's {len(state['pieces'])} pieces of the checkpoint, but this run cuts "
                f"{len(self.worker_segments)} other ones. "
                f"Fix: resume with the world size and the optimizer's parameters that wrote it, or pass "
                f"`resume_compression='reset'`."
            )
        self.worker.load_state_dict(state["worker"], device)
        self.server.load_state_dict(state["server"], device)
        self.exchanges = state["exchanges"]


def _whole(compressor: OneBit, segments: Segments) -> LayerGroup:
    """A stage's pieces as one group of the group step, laid out back to back over its vector."""
    # a rank whose chunk is empty (fewer elements than ranks) still has a group, of no element
    return LayerGroup(compressor, segments, tuple(range(len(segments))), 0, segments.offsets[:-1] or (0,))
