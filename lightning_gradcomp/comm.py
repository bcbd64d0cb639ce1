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


def all_gather(tensor: Tensor, group: ProcessGroup, world_size: int) -> tuple[Future, Tensor]:
    """Start an all-gather of equal-size 1-D tensors; returns the future and the ``[world_size, n]`` output.

    Read the output tensor, not the future's value: with Gloo the future holds per-rank chunks.
    """
    out = tensor.new_empty(world_size * tensor.numel())  # Gloo wants the flat concatenated form
    work = dist.all_gather_single(out, tensor.reshape(-1), group=group, async_op=True)
    return work.get_future(), out.view(world_size, -1)


def all_gather_sizes(sizes: Tensor, group: ProcessGroup, world_size: int) -> Tensor:
    """All-gather a small int64 vector of payload sizes, waited for: payloads are sized from it."""
    out = sizes.new_empty(world_size * sizes.numel())
    dist.all_gather_single(out, sizes, group=group)
    return out.view(world_size, -1)


def completed(value: Tensor) -> Future:
    """An already completed future, for buckets that need no communication."""
    fut: Future = torch.futures.Future()
    fut.set_result(value)
    return fut
