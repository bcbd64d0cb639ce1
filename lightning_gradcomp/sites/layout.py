"""Sites (the paper's data centers): which ranks share a LAN, and the process groups that connect them.

A site is a contiguous block of global ranks. Its first rank is the site's *leader*: it plays the paper's
Local Parameter Server towards the other sites (the only rank that talks over the WAN). The leaders together
form the group that plays the Global Server (an all-gather among leaders, every leader averaging the same
bytes in the same order, replaces a separate server process).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_gradcomp.validation import check_int


@dataclass(frozen=True)
class SiteLayout:
    """The sizes of the sites, in global-rank order (site ``s`` holds ranks ``starts[s] .. starts[s]+sizes[s]-1``)."""

    sizes: tuple[int, ...]

    @property
    def num_sites(self) -> int:
        return len(self.sizes)

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    @property
    def starts(self) -> tuple[int, ...]:
        out, acc = [], 0
        for size in self.sizes:
            out.append(acc)
            acc += size
        return tuple(out)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The global rank of each site's leader (its first rank)."""
        return self.starts

    def ranks(self, site: int) -> list[int]:
        start = self.starts[site]
        return list(range(start, start + self.sizes[site]))

    def site_of(self, rank: int) -> int:
        for site, start in enumerate(self.starts):
            if start <= rank < start + self.sizes[site]:
                return site
        raise ValueError(f"Expected `rank` in [0, {self.world_size}), but got {rank}.")


def check_site_options(site_size: Any, site_sizes: Any) -> None:
    """Validate ``site_size`` / ``site_sizes`` as given to a strategy (before the world size is known).

    Raises:
        ValueError: both given, a size below 1, or ``site_sizes`` not a non-empty list.
    """
    if site_size is not None:
        check_int("site_size", site_size, minimum=1, fix="use the number of ranks per site, e.g. 2")
    if site_sizes is None:
        return
    if site_size is not None:
        raise ValueError(
            f"Expected one of `site_size` and `site_sizes`, but got both ({site_size!r}, {list(site_sizes)!r}). "
            f"Fix: pass `site_size` for equal sites or `site_sizes` for a list."
        )
    if isinstance(site_sizes, (str, bytes)) or not isinstance(site_sizes, Sequence) or len(site_sizes) == 0:
        raise ValueError(
            f"Expected `site_sizes` to be a non-empty list of ranks per site, but got {site_sizes!r}. "
            f"Fix: e.g. `site_sizes=[2, 2]` for two sites of two ranks, or None for the default layout."
        )
    for i, size in enumerate(site_sizes):
        check_int(f"site_sizes[{i}]", size, minimum=1, fix="every site needs at least one rank")


def site_layout(
    world_size: int,
    num_nodes: int = 1,
    site_size: Optional[int] = None,
    site_sizes: Optional[Sequence[int]] = None,
    allow_single_rank_sites: bool = False,
) -> SiteLayout:
    """Split ``world_size`` ranks into sites and validate the split.

    Args:
        world_size: number of ranks.
        num_nodes: number of nodes in the cluster environment; with neither ``site_size`` nor ``site_sizes`` each
            node is a site (ranks are numbered node by node, as torchrun and Lightning do).
        site_size: ranks per site (all sites equal).
        site_sizes: an explicit size for each site, in rank order.
        allow_single_rank_sites: whether a site may hold a single rank (it then has no LAN exchange).

    Raises:
        ValueError: when the sizes do not add up to ``world_size``, or a site has one rank and that is not allowed.
    """
    check_int("world_size", world_size, minimum=1)
    if site_size is not None and site_sizes is not None:
        raise ValueError(
            f"Expected one of `site_size` and `site_sizes`, but got both ({site_size!r}, {list(site_sizes)!r}). "
            f"Fix: pass `site_size` for equal sites or `site_sizes` for a list."
        )
    if site_sizes is not None:
        sizes = tuple(site_sizes)
        if not sizes:
            raise ValueError("Expected `site_sizes` to list at least one site, but got []. Fix: e.g. `site_sizes=[2, 2]`.")
        for i, size in enumerate(sizes):
            check_int(f"site_sizes[{i}]", size, minimum=1, fix="every site needs at least one rank")
        if sum(sizes) != world_size:
            raise ValueError(
                f"Expected `site_sizes` to add up to the world size {world_size}, but got {list(sizes)} "
                f"(sum {sum(sizes)}). Fix: list one size per site so that every rank is in exactly one site."
            )
    elif site_size is not None:
        check_int("site_size", site_size, minimum=1, fix="use the number of ranks per site, e.g. 2")
        if world_size % site_size:
            raise ValueError(
                f"Expected `site_size` to divide the world size {world_size}, but got {site_size}. "
                f"Fix: use a divisor of {world_size}, or `site_sizes=[...]` for unequal sites."
            )
        sizes = (site_size,) * (world_size // site_size)
    else:
        check_int("num_nodes", num_nodes, minimum=1)
        if world_size % num_nodes:
            raise ValueError(
                f"Expected the world size {world_size} to be a multiple of the number of nodes {num_nodes} to make "
                f"one site per node. Fix: pass `site_size` or `site_sizes` explicitly."
            )
        sizes = (world_size // num_nodes,) * num_nodes
    if not allow_single_rank_sites and any(size == 1 for size in sizes) and world_size > 1:
        raise ValueError(
            f"Expected every site to hold at least 2 ranks, but got site sizes {list(sizes)}. A site of one rank has "
            f"no LAN exchange and its only rank also carries the WAN traffic. Fix: use larger sites, or pass "
            f"`allow_single_rank_sites=True` if that is what you want."
        )
    return SiteLayout(sizes)


@dataclass
class SiteGroups:
    """This rank's place in the site layout and the process groups it belongs to.

    Attributes:
        layout: the site layout.
        rank: this rank's global rank.
        site: this rank's site.
        site_group: the group of this rank's site (the LAN).
        leader_group: the group of all site leaders (the WAN); ``None`` on ranks that are not leaders.
    """

    layout: SiteLayout
    rank: int
    site: int
    site_group: Optional[dist.ProcessGroup]
    leader_group: Optional[dist.ProcessGroup]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def leader(self) -> int:
        """Global rank of this site's leader."""
        return self.layout.leaders[self.site]

    @property
    def site_rank(self) -> int:
        """This rank's index inside its site."""
        return self.rank - self.layout.starts[self.site]

    @property
    def site_size(self) -> int:
        return self.layout.sizes[self.site]


def new_group(ranks: Sequence[int], timeout: Optional[timedelta]) -> Optional[dist.ProcessGroup]:
    """A process group of ``ranks`` that waits ``timeout`` for a peer; every rank must call it, in the same order.

    Every group the library creates is made here, with the strategy's ``timeout``: ``dist.new_group`` does not
    inherit the default group's timeout but takes torch's default (30 minutes), so a peer that stops answering
    inside a site would hold the others that long instead of the user's ``timeout``.

    Args:
        ranks: the group's global ranks.
        timeout: how long a collective on the group waits for a peer (the strategy's ``timeout``); ``None``: torch's
            default for the backend.

    Returns:
        The group on its members (torch's placeholder on the other ranks).
    """
    return dist.new_group(list(ranks), timeout=timeout)


def new_site_groups(layout: SiteLayout, rank: int, timeout: Optional[timedelta] = None) -> SiteGroups:
    """Create the site groups and the leaders' group; every rank must call this, in the same order.

    ``dist.new_group`` is collective over the default group: each call is made on every rank, member or not,
    so the same sequence of calls runs everywhere.

    Args:
        layout: the sites.
        rank: this rank's global rank.
        timeout: every group's collective timeout (:func:`new_group`); strategies pass their own ``timeout``.
    """
    site = layout.site_of(rank)
    site_group: Optional[dist.ProcessGroup] = None
    for s in range(layout.num_sites):
        group = new_group(layout.ranks(s), timeout)
        if s == site:
            site_group = group
    leaders = new_group(layout.leaders, timeout)
    leader_group = leaders if rank in layout.leaders else None
    return SiteGroups(layout=layout, rank=rank, site=site, site_group=site_group, leader_group=leader_group)


def start_sites_from_rank0(module: "torch.nn.Module") -> None:
    """Copy global rank 0's parameters and buffers to every rank (collective over the default group).

    A site strategy wraps its model in DDP over the site's group, so DDP's own initial broadcast reaches the site
    only: without this, every site would start from its own leader's weights.
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
