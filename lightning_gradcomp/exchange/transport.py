"""How an exchange's collectives travel: one interface, four carriers.

The hook's exchange (:func:`lightning_gradcomp.exchange.hook.gradcomp_hook`) issues four kinds of collective, always from
its body and in one order on every rank: a blocking max (shared statistics, the non-finite flag, the planner's
agreement), a sum it waits for later (summable payloads), a blocking gather of small size tables, and a gather of
payload bytes it waits for later. 1-bit Adam's compressed all-reduce
(:class:`~lightning_gradcomp.onebit_adam.CompressedAllReduce`) adds the owners' pair: each rank's segment ``r`` to
its owner, rank ``r`` (:meth:`Transport.scatter_to_owners`), and every owner's segment to every rank
(:meth:`Transport.gather_from_owners`); the compressed reduce-scatter across nodes
(:class:`~lightning_gradcomp.strategies.fsdp_collectives.CompressedReduceScatter`) sends each piece to its owner,
summed on the way where the packets are summable (:meth:`Transport.sum_to_owners`), else as
:meth:`Transport.scatter_to_owners`. A :class:`Transport` carries them:

* :class:`ProcessGroupTransport`: torch.distributed over a process group (:mod:`lightning_gradcomp.exchange.comm`) — DDP's
  buckets, the hierarchical exchange's groups, the outer rounds' leaders;
* :class:`~lightning_gradcomp.sites.transport.SiteLeadersTransport`: the sites as the exchange's ranks, every rank of a site holding the same data — the
  leaders' collective over the WAN, then each leader's broadcast inside its site (WeightGrad's WAN round);
* :class:`WorkerTransport`: ``N`` workers emulated in one process (:class:`~lightning_gradcomp.strategies.towers.TowerStrategy`),
  each running the same exchange in its own thread; the workers meet at a barrier per collective and every worker
  combines the contributions in rank order, so all of them hold the same bits;
* :class:`LoopbackTransport`: one rank standing in for ``N`` identical ones (every rank's contribution is this
  rank's), so the codec measurement and the planner's probe time and count exactly the code that trains.

Only the carrier differs: the step that compresses, records and decodes is the same code on all three.
"""

import threading
from collections.abc import Sequence
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.exchange import comm


class Transport(Protocol):
    """The collectives of one exchange among ``world_size`` ranks, this one being ``rank``."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def max_(self, tensor: Tensor) -> None:
        """In-place element-wise max over ranks, waited for."""
        ...

    def sum(self, tensor: Tensor) -> Future:
        """Start an in-place sum over ranks; read ``tensor`` once the future completes."""
        ...

    def gather_sizes(self, sizes: Tensor) -> Tensor:
        """Every rank's small int64 vector, ``[world_size, k]``, waited for."""
        ...

    def gather(self, tensor: Tensor, out: Tensor) -> tuple[Future, Tensor]:
        """Start a gather of equal-size 1-D tensors into ``out`` (``world_size * n`` elements); returns the future
        and ``out`` as ``[world_size, n]``."""
        ...

    def sum_to_owners(self, out: Tensor, tensor: Tensor) -> None:
        """Segment ``j`` of the sum over ranks of ``tensor`` (``world_size`` equal segments) to rank ``j``, waited
        for: ``out`` (one segment) holds this rank's (a reduce-scatter of summable payloads)."""
        ...

    def scatter_to_owners(self, out: Tensor, tensor: Tensor, splits: Sequence[int]) -> None:
        """Segment ``j`` of ``tensor`` (``splits``: the segments' lengths, in rank order, the same on every rank) to
        rank ``j``, waited for: ``out`` (``world_size`` times this rank's segment) holds this rank's segment of every
        rank, in rank order."""
        ...

    def gather_from_owners(self, out: Tensor, mine: Tensor, splits: Sequence[int], repeated: Tensor) -> Future:
        """Start the owners' segments to every rank: ``out`` (``sum(splits)`` elements) receives every owner's
        ``mine`` in rank order (``splits``: their lengths); ``repeated`` is scratch of ``world_size`` times
        ``mine``'s size. Read ``out`` once the future completes."""
        ...


class ProcessGroupTransport:
    """torch.distributed collectives over ``process_group`` (``None``: the default group).

    The rank is looked up when first asked (a hook state can be made before the process group exists).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup], world_size: int) -> None:
        self.process_group = process_group
        self.world_size = world_size

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self.world_size > 1 else 0

    def max_(self, tensor: Tensor) -> None:
        comm.all_reduce_max_(tensor, self.process_group)

    def sum(self, tensor: Tensor) -> Future:
        return comm.all_reduce_sum(tensor, self.process_group)

    def gather_sizes(self, sizes: Tensor) -> Tensor:
        return comm.all_gather_sizes(sizes, self.process_group, self.world_size)

    def gather(self, tensor: Tensor, out: Tensor) -> tuple[Future, Tensor]:
        return comm.all_gather(tensor, self.process_group, self.world_size, out=out)

    def sum_to_owners(self, out: Tensor, tensor: Tensor) -> None:
        comm.sum_to_owners(out, tensor, self.process_group)

    def scatter_to_owners(self, out: Tensor, tensor: Tensor, splits: Sequence[int]) -> None:
        comm.scatter_to_owners(out, tensor, list(splits), self.process_group)

    def gather_from_owners(self, out: Tensor, mine: Tensor, splits: Sequence[int], repeated: Tensor) -> Future:
        return comm.gather_from_owners(out, mine, list(splits), self.process_group, repeated)


class LoopbackTransport:
    """``world_size`` ranks whose contributions are all this rank's: a max or a sum leaves the tensor as it is (a
    sum's value is never what a measurement reads), a gather repeats it ``world_size`` times."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size = world_size
        self.rank = rank

    def max_(self, tensor: Tensor) -> None:
        pass

    def sum(self, tensor: Tensor) -> Future:
        return comm.completed(tensor)

    def gather_sizes(self, sizes: Tensor) -> Tensor:
        return sizes.reshape(1, -1).repeat(self.world_size, 1)

    def gather(self, tensor: Tensor, out: Tensor) -> tuple[Future, Tensor]:
        rows = out.view(self.world_size, -1)
        rows.copy_(tensor.reshape(1, -1).expand_as(rows))
        return comm.completed(out), rows

    def sum_to_owners(self, out: Tensor, tensor: Tensor) -> None:
        # as :meth:`sum`, the value is this rank's own segment
        out.copy_(tensor.reshape(self.world_size, -1)[self.rank])

    def scatter_to_owners(self, out: Tensor, tensor: Tensor, splits: Sequence[int]) -> None:
        start = sum(splits[: self.rank])
        rows = out.view(self.world_size, -1)
        rows.copy_(tensor[start : start + splits[self.rank]].reshape(1, -1).expand_as(rows))

    def gather_from_owners(self, out: Tensor, mine: Tensor, splits: Sequence[int], repeated: Tensor) -> Future:
        # every owner's segment is this rank's, cut or repeated to the owner's length (the bytes a real gather
        # moves, whatever they encode)
        flat, offset = mine.reshape(-1), 0
        for n in splits:
            if flat.numel():
                out[offset : offset + n].copy_(flat.repeat(-(-n // flat.numel()))[:n])
            else:
                out[offset : offset + n].zero_()
            offset += n
        return comm.completed(out)


class Workers:
    """The meeting point of ``world_size`` workers emulated in one process, one thread each.

    Args:
        world_size: the number of workers.
        timeout: seconds a worker waits for the others at a collective before every worker fails (a worker that
            raised breaks the barrier at once, so the others fail instead of waiting).
    """

    def __init__(self, world_size: int, timeout: float = 600.0) -> None:
        self.world_size = world_size
        self._slots: list[Optional[Tensor]] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout)

    def transport(self, rank: int) -> "WorkerTransport":
        """Worker ``rank``'s carrier."""
        return WorkerTransport(self, rank)

    def abort(self) -> None:
        """Release every waiting worker with an error (a worker failed)."""
        self._barrier.abort()

    def contributions(self, rank: int, tensor: Tensor) -> list[Tensor]:
        """Every worker's ``tensor``, in rank order (every worker calls this with its own, in the same order)."""
        self._slots[rank] = tensor
        self._barrier.wait()
        return [t for t in self._slots if t is not None]

    def done_reading(self) -> None:
        """Every worker has read the contributions: each may now write its own tensor."""
        self._barrier.wait()


class WorkerTransport:
    """Worker ``rank``'s collectives among the emulated :class:`Workers`: each combines every worker's contribution
    in rank order, as a single reduction would, so every worker ends with the same bits. Completed futures: the
    collective is over when the call returns."""

    def __init__(self, workers: Workers, rank: int) -> None:
        self.workers = workers
        self.rank = rank

    @property
    def world_size(self) -> int:
        return self.workers.world_size

    def _combine_(self, tensor: Tensor, combined: Tensor) -> None:
        self.workers.done_reading()
        tensor.copy_(combined)

    def max_(self, tensor: Tensor) -> None:
        parts = self.workers.contributions(self.rank, tensor)
        self._combine_(tensor, torch.stack(parts).amax(dim=0))

    def sum(self, tensor: Tensor) -> Future:
        parts = self.workers.contributions(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        self._combine_(tensor, total)
        return comm.completed(tensor)

    def gather_sizes(self, sizes: Tensor) -> Tensor:
        parts = self.workers.contributions(self.rank, sizes)
        table = torch.stack(parts)
        self.workers.done_reading()
        return table

    def gather(self, tensor: Tensor, out: Tensor) -> tuple[Future, Tensor]:
        parts = self.workers.contributions(self.rank, tensor.reshape(-1))
        rows = out.view(self.world_size, -1)
        for row, part in zip(rows, parts):
            row.copy_(part)
        self.workers.done_reading()
        return comm.completed(out), rows

    def sum_to_owners(self, out: Tensor, tensor: Tensor) -> None:
        parts = [p.view(self.world_size, -1)[self.rank] for p in self.workers.contributions(self.rank, tensor.reshape(-1))]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        out.copy_(total)
        self.workers.done_reading()

    def scatter_to_owners(self, out: Tensor, tensor: Tensor, splits: Sequence[int]) -> None:
        parts = self.workers.contributions(self.rank, tensor.reshape(-1))
        start = sum(splits[: self.rank])
        for row, part in zip(out.view(self.world_size, -1), parts):
            row.copy_(part[start : start + splits[self.rank]])
        self.workers.done_reading()

    def gather_from_owners(self, out: Tensor, mine: Tensor, splits: Sequence[int], repeated: Tensor) -> Future:
        parts = self.workers.contributions(self.rank, mine.reshape(-1))
        torch.cat(parts, out=out)
        self.workers.done_reading()
        return comm.completed(out)
