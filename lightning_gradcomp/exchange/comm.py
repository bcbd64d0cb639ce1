"""Collectives: torch.distributed calls and nothing about compression maths.

Every function here is issued from the hook body, in bucket order, identically on every rank. Nothing is
launched from a ``Future.then`` callback: on Gloo with two or more buckets that reorders collectives
across ranks and hangs (the reason torch's own PowerSGD hook hangs there).
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

ProcessGroup = Optional[dist.ProcessGroup]


def all_reduce_max_(tensor: Tensor, group: ProcessGroup) -> None:
    """In-place max over ranks, waited for: the result is needed before compression can start."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def all_reduce_sum(tensor: Tensor, group: ProcessGroup) -> Future:
    """Start an in-place sum over ranks; the result is read from ``tensor`` once the future completes."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()


def reduce_to_owners_(mine: Tensor, tensor: Tensor, splits: list[int], group: ProcessGroup, received: Tensor) -> None:
    """Each of the ``k`` ranks of ``group`` owns one segment of ``tensor`` (``splits``: the segments' lengths, in
    rank order); rank ``r`` ends with the sum over ranks of segment ``r`` in ``mine``.

    A reduce-scatter with unequal segments: an all-to-all (segment ``j`` to rank ``j``) into ``received`` (``k``
    times ``mine``'s size), then a local sum over the ``k`` received copies in rank order. Each segment is summed
    by its owner only, so the sum has the same bits wherever it is later gathered. Chosen over torch's
    reduce-scatter, which needs equal chunks (padding a share to the bucket's largest doubles the bytes when one
    tensor fills a bucket) and which on Gloo takes longer than an all-reduce of the whole tensor
    (``benchmarks/site_collectives.py``, 2 ranks over veths, 11.6 MB: 13.0 ms against 10.5 ms; this 8.3 ms).
    Waited for: the segment is compressed next.
    """
    k = len(splits)
    dist.all_to_all_single(received, tensor, output_split_sizes=[mine.numel()] * k, input_split_sizes=splits,
                           group=group)
    torch.sum(received.view(k, mine.numel()), dim=0, out=mine)


def sum_to_owners(out: Tensor, tensor: Tensor, group: ProcessGroup) -> None:
    """A reduce-scatter of equal segments: ``out`` (``tensor``'s size over the group's) receives the sum over ranks
    of this rank's segment. Torch's own (a ring on Gloo): with the identity compressor a reduce-scatter across nodes
    then sums in the order stock FSDP2 does. Waited for: the owner decodes next."""
    dist.reduce_scatter_single(out, tensor, op=dist.ReduceOp.SUM, group=group)


def scatter_to_owners(out: Tensor, tensor: Tensor, splits: list[int], group: ProcessGroup) -> None:
    """Segment ``j`` of ``tensor`` (``splits``: the segments' lengths, in rank order) to rank ``j``: ``out`` (``k`` times
    the length of this rank's own segment) receives this rank's segment from every rank, in rank order. The
    all-to-all of :func:`reduce_to_owners_` without the sum, for payloads that are decoded before they are summed
    (1-bit Adam's compressed all-reduce). Waited for: the owner decodes next."""
    k = len(splits)
    dist.all_to_all_single(out, tensor, output_split_sizes=[out.numel() // k] * k, input_split_sizes=splits,
                           group=group)


def gather_from_owners(out: Tensor, mine: Tensor, splits: list[int], group: ProcessGroup, repeated: Tensor) -> Future:
    """Start the inverse of :func:`reduce_to_owners_`: every rank ends with every owner's segment in ``out``
    (``splits``: the segments' lengths, in rank order). An all-gather with unequal segments: an all-to-all of
    ``k`` copies of ``mine`` (written to ``repeated``, a scratch tensor of ``k`` times its size); read ``out`` once
    the future completes."""
    k = len(splits)
    repeated.view(k, mine.numel()).copy_(mine.expand(k, -1))
    work = dist.all_to_all_single(out, repeated, output_split_sizes=splits, input_split_sizes=[mine.numel()] * k,
                                  group=group, async_op=True)
    return work.get_future()


def all_gather(
    tensor: Tensor, group: ProcessGroup, world_size: int, out: Optional[Tensor] = None
) -> tuple[Future, Tensor]:
    """Start an all-gather of equal-size 1-D tensors; returns the future and the ``[world_size, n]`` output.

    Read the output tensor, not the future's value: with Gloo the future holds per-rank chunks.

    Args:
        tensor: this rank's 1-D contribution.
        group: the process group.
        world_size: ranks in ``group``.
        out: a contiguous 1-D tensor of ``world_size * tensor.numel()`` elements to gather into (e.g. from
            :class:`Scratch`); ``None`` allocates one.
    """
    if out is None:
        out = tensor.new_empty(world_size * tensor.numel())  # Gloo wants the flat concatenated form
    work = dist.all_gather_single(out, tensor.reshape(-1), group=group, async_op=True)
    return work.get_future(), out.view(world_size, -1)


def all_gather_sizes(sizes: Tensor, group: ProcessGroup, world_size: int) -> Tensor:
    """All-gather a small int64 vector of payload sizes, waited for: payloads are sized from it."""
    out = sizes.new_empty(world_size * sizes.numel())
    dist.all_gather_single(out, sizes, group=group)
    return out.view(world_size, -1)


class Scratch:
    """Grow-only communication buffers reused from step to step, one per key (bucket, group, channel).

    A fresh large CPU allocation is page-faulted in again on every step: glibc maps blocks above 32 MiB
    afresh each time, and on the 2-core VM of docs/benchmarks.md writing a fresh 147 MB tensor took 3x as
    long as rewriting a reused one. The hook therefore concatenates payloads and gathers into these buffers.
    Reuse is safe because DDP waits for every bucket's future (and so every decode) before backward returns,
    and the next step's hook is the next writer. Costs the largest size seen per key, kept for the run.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[object, ...], Tensor] = {}

    def take(self, key: tuple[object, ...], numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous 1-D tensor of ``numel`` elements (contents undefined), reused under ``key``."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]


def completed(value: Tensor) -> Future:
    """An already completed future, for buckets that need no communication."""
    fut: Future = torch.futures.Future()
    fut.set_result(value)
    return fut


# -- two-level (site / leader) collectives -----------------------------------------------------------------------
# A site's ranks share a LAN (``site_group``); one leader per site talks over the WAN (``leader_group``, None
# on ranks that are not leaders). Every function is called by every rank of the world, in the same order, and
# waits: these run between training steps, not inside a DDP hook. The exchange's collectives over the sites are
# :class:`~lightning_gradcomp.sites.transport.SiteLeadersTransport`'s (the leaders' collective, then
# :func:`broadcast_` inside each site).


def broadcast_(tensor: Tensor, src: int, group: ProcessGroup) -> None:
    """In-place broadcast from global rank ``src`` over ``group``, waited for."""
    dist.broadcast(tensor, src=src, group=group)


