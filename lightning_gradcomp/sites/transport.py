"""The sites as the ranks of an exchange: :class:`SiteLeadersTransport`, the carrier of WeightGrad's WAN round.

One of the carriers of the exchange's collectives (:class:`~lightning_gradcomp.exchange.transport.Transport`); it
lives with the sites, above the exchange, so that the exchange's own modules import nothing of the sites.
"""

from collections.abc import Sequence
from typing import Optional

from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.exchange import comm
from lightning_gradcomp.exchange.ledger import Ledger, tensor_bytes
from lightning_gradcomp.sites.layout import SiteGroups


class SiteLeadersTransport:
    """The sites as the ranks of an exchange: ``world_size`` is the number of sites, ``rank`` this rank's site.

    Every rank of a site holds the same data (the site's replicas), so one copy per site crosses the WAN: each
    collective runs among the site leaders (``groups.leader_group``), then each leader broadcasts the result inside
    its site (``groups.site_group``), and every rank of every site ends with the same bits. What a rank that is not
    a leader contributes is not read. Every call blocks (the futures returned are complete): the round runs between
    training steps, not inside DDP's backward.

    Args:
        groups: this rank's sites and groups.
        ledger: where the bytes a leader broadcasts inside its site are recorded (channel ``"lan"``), and those of
            :meth:`broadcast_from_first_site` between sites (channel ``"wan"``); ``None``: not recorded. The bytes of
            the exchange's collectives between sites are the exchange's own records.
    """

    def __init__(self, groups: SiteGroups, ledger: Optional[Ledger] = None) -> None:
        self.groups = groups
        self.ledger = ledger

    @property
    def world_size(self) -> int:
        return self.groups.layout.num_sites

    @property
    def rank(self) -> int:
        return self.groups.site

    def fan_out(self, tensor: Tensor) -> None:
        """The leader's ``tensor`` to every rank of its site, in place (the one in-site broadcast of the sites: the
        outer rounds' decoded mean and buffers go through it too); the leader's bytes are recorded on the ledger's
        ``"lan"`` channel."""
        g = self.groups
        if g.site_size > 1:
            comm.broadcast_(tensor, g.leader, g.site_group)
            if g.is_leader and self.ledger is not None:
                self.ledger.record_channel("lan", tensor_bytes(tensor))

    def broadcast_from_first_site(self, tensor: Tensor) -> None:
        """Site 0's ``tensor`` to every rank, in place: over the leaders, then :meth:`fan_out`; site 0's leader's
        bytes between sites are recorded on the ledger's ``"wan"`` channel."""
        g = self.groups
        if g.leader_group is not None:
            comm.broadcast_(tensor, g.layout.leaders[0], g.leader_group)
            if g.site == 0 and g.layout.num_sites > 1 and self.ledger is not None:
                self.ledger.record_channel("wan", tensor_bytes(tensor))
        self.fan_out(tensor)

    def max_(self, tensor: Tensor) -> None:
        if self.groups.leader_group is not None:
            comm.all_reduce_max_(tensor, self.groups.leader_group)
        self.fan_out(tensor)

    def sum(self, tensor: Tensor) -> Future:
        if self.groups.leader_group is not None:
            comm.all_reduce_sum(tensor, self.groups.leader_group).wait()
        self.fan_out(tensor)
        return comm.completed(tensor)

    def gather_sizes(self, sizes: Tensor) -> Tensor:
        leaders = self.groups.leader_group
        if leaders is not None:
            table = comm.all_gather_sizes(sizes, leaders, self.world_size)
        else:
            table = sizes.new_zeros((self.world_size, sizes.numel()))
        self.fan_out(table)
        return table

    def gather(self, tensor: Tensor, out: Tensor) -> tuple[Future, Tensor]:
        if self.groups.leader_group is not None:
            comm.all_gather(tensor, self.groups.leader_group, self.world_size, out=out)[0].wait()
        self.fan_out(out)
        return comm.completed(out), out.view(self.world_size, -1)

    def sum_to_owners(self, out: Tensor, tensor: Tensor) -> None:
        if self.groups.leader_group is not None:
            comm.sum_to_owners(out, tensor, self.groups.leader_group)
        self.fan_out(out)

    def scatter_to_owners(self, out: Tensor, tensor: Tensor, splits: Sequence[int]) -> None:
        if self.groups.leader_group is not None:
            comm.scatter_to_owners(out, tensor, list(splits), self.groups.leader_group)
        self.fan_out(out)

    def gather_from_owners(self, out: Tensor, mine: Tensor, splits: Sequence[int], repeated: Tensor) -> Future:
        if self.groups.leader_group is not None:
            comm.gather_from_owners(out, mine, list(splits), self.groups.leader_group, repeated).wait()
        self.fan_out(out)
        return comm.completed(out)
