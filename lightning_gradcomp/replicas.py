"""A cheap check that every rank still holds the same parameters, bit for bit.

Per parameter, two int64 checksums of its raw bits (a plain and a position-weighted sum, so a changed value
or two swapped values both show); one all-gather of the ``[2 * P]`` vector compares every rank with every
other. Every rank sees the same table and so raises the same error at the same step: nobody is left waiting
in a collective.
"""

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# weights 1..251 (a prime) along the tensor: a swap of two values changes the weighted sum
_PERIOD = 251


class ReplicaDivergenceError(RuntimeError):
    """Ranks hold different parameters: synchronous data parallelism is broken."""


def checksums(params: Sequence[Tensor]) -> Tensor:
    """``[2 * len(params)]`` int64 checksums of the parameters' bits (exact, order-independent of summation)."""
    out = []
    for p in params:
        bits = p.detach().reshape(-1).view(_INT_VIEW[p.element_size()]).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device) % _PERIOD + 1
        out.append(torch.stack((bits.sum(), (bits * weights).sum())))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def check_replicas(
    names: Sequence[str],
    params: Sequence[Tensor],
    world_size: int,
    step: int,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Compare the parameters of every rank of ``group`` (default: the default group); all its ranks must call it at
    the same point. ``world_size`` is the group's size; the ranks named in an error are ranks of the group.

    Raises:
        ReplicaDivergenceError: naming the first parameter (in ``names`` order) whose bits differ between ranks.
    """
    local = checksums(params)
    if world_size == 1:
        return
    table = local.new_empty(world_size * local.numel())
    dist.all_gather_single(table, local, group=group)
    table = table.view(world_size, -1, 2)
    differs = (table != table[0]).any(dim=2).any(dim=0)
    if bool(differs.any()):
        first = int(differs.nonzero()[0])
        ranks = [r for r in range(world_size) if not torch.equal(table[r, first], table[0, first])]
        raise ReplicaDivergenceError(
            f"Replicas diverged at step {step}: parameter `{names[first]}` on rank(s) {ranks} differs from rank 0 "
            f"({int(differs.sum())} of {len(names)} parameters differ). Every rank must apply the identical update; "
            f"a compressor or transform that decodes differently per rank, a rank-dependent optimizer or a hardware "
            f"fault can cause this. Fix: rerun with `GradCompStrategy(check_replicas_every=1)` to find the first "
            f"diverging step, and check that decoding uses only what every rank received."
        )
