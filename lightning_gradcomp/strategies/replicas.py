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
    rank_sets: Optional[Sequence[Sequence[int]]] = None,
    scope: str = "every rank must hold the same parameters",
) -> None:
    """Compare the parameters of the ranks of the default group; all ranks must call it at the same point.

    Every rank gathers the whole table and checks every set, so all of them raise together, also where a set
    that disagrees is not their own (nobody is left waiting in the next collective).

    Args:
        names: the parameters' names, for the message.
        params: the tensors to compare.
        world_size: ranks in the default group.
        step: the step the message names.
        rank_sets: the sets of global ranks that must agree with each other (default: all ranks), e.g. the
            ranks of each site where sites differ by design between rounds.
        scope: what must be equal, and when, for the message.

    Raises:
        ReplicaDivergenceError: naming the first parameter (in ``names`` order) whose bits differ inside a set.
    """
    local = checksums(params)
    if world_size == 1:
        return
    table = local.new_empty(world_size * local.numel())
    dist.all_gather_single(table, local)
    table = table.view(world_size, -1, 2)
    for ranks in rank_sets or [range(world_size)]:
        ranks = list(ranks)
        rows = table[ranks]
        differs = (rows != rows[0]).any(dim=2).any(dim=0)
        if not bool(differs.any()):
            continue
        first = int(differs.nonzero()[0])
        other = [r for r in ranks if not torch.equal(table[r, first], table[ranks[0], first])]
        raise ReplicaDivergenceError(
            f"Replicas diverged at step {step}: parameter `{names[first]}` on rank(s) {other} differs from rank "
            f"{ranks[0]} ({int(differs.sum())} of {len(names)} parameters differ; {scope}). Every rank must apply "
            f"the identical update; a compressor or transform that decodes differently per rank, a rank-dependent "
            f"optimizer or a hardware fault can cause this. Fix: rerun with `check_replicas_every=1` to find the "
            f"first diverging step, and check that decoding uses only what every rank received."
        )
