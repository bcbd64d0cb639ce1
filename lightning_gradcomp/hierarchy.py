"""Hierarchical exchange: dense inside a site (node), compressed between sites, for every compressor.

Per DDP bucket, identically on every rank:

1. a dense sum of the bucket inside the site (the LAN), divided by the site size: every rank of a site then holds
   the site's mean gradient;
2. the model's parameters are split into ``k`` contiguous (in the model's order), byte-balanced shares (whole
   parameters, so layer-wise scalers, thresholds and bins keep their meaning; the split depends on the parameter
   sizes only and holds for the whole run, see :func:`owned_names`), one per local rank; per bucket, local rank
   ``j`` runs the flat hook (:func:`lightning_gradcomp.hook._exchange_bucket`: transforms, error
   feedback, shared statistics, compression, collectives, decode) on share ``j`` only, with the *cross-site*
   group of the ranks with local index ``j`` in every site, on the parameters of share ``j`` in the bucket. So each
   local rank puts about ``1/k`` of a step's inter-site bytes on the link, and the compressor averages over sites;
3. a dense exchange of the decoded shares inside the site (each rank zeroes what it does not own, then a sum), so
   every rank ends with the same averaged bucket.

Everything the flat hook keeps per parameter (residuals, random streams, records) is then kept only by the
share's owner, keyed by parameter name as before; the checkpoint saves every rank's part, so resume is exact.
The non-finite guard sees the whole site-summed bucket (a NaN on any rank of any site reaches every cross-site
group) and every rank checks the whole decoded bucket, so every rank skips the same steps.

Sites are contiguous blocks of global ranks (:mod:`lightning_gradcomp.sites`); all sites must have the
same size so that every local index has one rank in every site.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp import comm
from lightning_gradcomp.guard import observe_decoded
from lightning_gradcomp.groups import layer_offsets
from lightning_gradcomp.hook import GradCompState, _exchange_bucket
from lightning_gradcomp.sites import SiteLayout, new_site_groups, site_layout
from lightning_gradcomp.validation import check_choice, check_int


Hierarchy = Literal["node"]
HIERARCHIES = ("node",)


@dataclass(frozen=True)
class HierarchySpec:
    """The user's choice of sites: one site per node (``hierarchy="node"``), ``site_size`` ranks each, or explicit
    ``site_sizes``. Validated at construction; resolved against the world size by :meth:`layout`."""

    hierarchy: Optional[str] = None
    site_size: Optional[int] = None
    site_sizes: Optional[tuple[int, ...]] = None

    def layout(self, world_size: int, num_nodes: int) -> SiteLayout:
        """The site layout for this run.

        Raises:
            ValueError: the sizes do not add up to the world size, a site holds one rank, there is one site only,
                or the sites differ in size.
        """

        layout = site_layout(world_size, num_nodes, self.site_size, self.site_sizes)
        arg, value = self.argument()
        if layout.num_sites < 2:
            raise ValueError(
                f"Expected `{arg}` to make at least 2 sites of the {world_size} ranks, but got {value!r} (one site: "
                f"nothing crosses a slow link, so the hierarchy would be a dense all-reduce). Fix: use the flat "
                f"exchange (no `hierarchy`/`site_size`/`site_sizes`), or split the ranks, e.g. `site_sizes=[2, 2]`."
            )
        if len(set(layout.sizes)) > 1:
            raise ValueError(
                f"Expected `{arg}` to make sites of equal size (local rank j of every site exchanges with local "
                f"rank j of the others), but got {value!r} (sizes {list(layout.sizes)}). Fix: use equal sites, "
                f"e.g. `site_size={world_size // layout.num_sites}` if it divides the world size."
            )
        return layout

    def argument(self) -> tuple[str, Any]:
        if self.site_sizes is not None:
            return "site_sizes", list(self.site_sizes)
        if self.site_size is not None:
            return "site_size", self.site_size
        return "hierarchy", self.hierarchy


def hierarchy_spec(
    hierarchy: Optional[str], site_size: Optional[int], site_sizes: Optional[Sequence[int]]
) -> Optional[HierarchySpec]:
    """Validate the strategy's hierarchy options; ``None`` when the exchange is flat.

    Raises:
        ValueError: an unknown ``hierarchy``, a ``site_size`` below 2, ``site_sizes`` that are not a list of
            integers >= 2, or more than one of the three options.
    """
    given = [n for n, v in (("hierarchy", hierarchy), ("site_size", site_size), ("site_sizes", site_sizes)) if v is not None]
    if len(given) > 1:
        raise ValueError(
            f"Expected at most one of `hierarchy`, `site_size` and `site_sizes`, but got {given}. Fix: pass "
            f"`hierarchy='node'` for one site per node, `site_size=k` for sites of k ranks, or `site_sizes=[...]`."
        )
    if hierarchy is not None:
        check_choice("hierarchy", hierarchy, HIERARCHIES, fix="use 'node' (one site per node), or None for the flat exchange")
    if site_size is not None:
        check_int("site_size", site_size, minimum=2, fix="use the number of ranks per site (at least 2; 1 is the flat exchange)")
    sizes: Optional[tuple[int, ...]] = None
    if site_sizes is not None:
        if isinstance(site_sizes, (str, bytes)) or not isinstance(site_sizes, Sequence):
            raise ValueError(
                f"Expected `site_sizes` to be a list of ranks per site, but got {site_sizes!r}. Fix: e.g. "
                f"`site_sizes=[2, 2]` for 2 sites of 2 ranks."
            )
        for i, size in enumerate(site_sizes):
            check_int(f"site_sizes[{i}]", size, minimum=2, fix="every site needs at least 2 ranks (1 is the flat exchange)")
        sizes = tuple(site_sizes)
    if not given:
        return None
    return HierarchySpec(hierarchy=hierarchy, site_size=site_size, site_sizes=sizes)


def share_bounds(nbytes: Sequence[int], shares: int) -> list[tuple[int, int]]:
    """Split consecutive parameters (their byte sizes) into ``shares`` contiguous ranges of about equal bytes.

    Share ``j`` ends at the parameter boundary closest to ``(j + 1) / shares`` of the total (never before the
    previous boundary); a parameter is never split, so a share may be empty when a bucket has fewer parameters
    than shares. Depends only on the sizes, so every rank computes the same split.
    """
    prefix = [0]
    for n in nbytes:
        prefix.append(prefix[-1] + n)
    total, bounds, start = prefix[-1], [], 0
    for j in range(shares):
        if j == shares - 1:
            end = len(nbytes)
        else:
            target = total * (j + 1) / shares
            end = min(range(start, len(nbytes) + 1), key=lambda i: (abs(prefix[i] - target), i))
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class SiteExchange:
    """This rank's place in the hierarchy and the groups it exchanges with.

    Attributes:
        layout: the sites.
        site: this rank's site.
        local_rank: this rank's index inside its site (which share of each bucket it owns).
        site_group: the ranks of this site (the fast link).
        cross_group: the ranks with this local index in every site (the slow link); the hook state's group.
        owned: the names of the parameters whose share this rank compresses and exchanges between sites.
        lan_bytes: per bucket index, the bytes this rank put on the fast link in the latest step (both dense
            exchanges, counted as the tensor each all-reduce takes).
    """

    layout: SiteLayout
    site: int
    local_rank: int
    site_group: Optional[dist.ProcessGroup]
    cross_group: Optional[dist.ProcessGroup]
    owned: frozenset[str]
    lan_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def site_size(self) -> int:
        return self.layout.sizes[self.site]

    def lan_bytes_per_step(self) -> int:
        return sum(self.lan_bytes.values())


def owned_names(sizes: Sequence[tuple[str, int]], shares: int, share: int) -> frozenset[str]:
    """The parameters of ``share``: ``sizes`` (name, bytes, in the model's order) split by :func:`share_bounds`.

    Ownership is fixed for the whole run rather than drawn per DDP bucket: DDP rebuilds its buckets after the first
    step (and again after a resume), so a per-bucket split would move a parameter's residual between ranks.
    """
    start, end = share_bounds([n for _, n in sizes], shares)[share]
    return frozenset(name for name, _ in sizes[start:end])


def new_site_exchange(layout: SiteLayout, rank: int, sizes: Sequence[tuple[str, int]]) -> SiteExchange:
    """Create the site groups and the cross-site groups; every rank must call this, in the same order.

    ``sizes``: every parameter that goes through the hook, (name, bytes) in the model's order.
    """

    groups = new_site_groups(layout, rank)
    k = layout.sizes[0]
    cross: Optional[dist.ProcessGroup] = None
    for j in range(k):  # dist.new_group is collective over the default group: every rank creates every group
        group = dist.new_group([start + j for start in layout.starts])
        if j == groups.site_rank:
            cross = group
    return SiteExchange(layout=layout, site=groups.site, local_rank=groups.site_rank, site_group=groups.site_group,
                        cross_group=cross, owned=owned_names(sizes, k, groups.site_rank))


class _ShareBucket:
    """The part of a DDP bucket one local rank owns, a :class:`~lightning_gradcomp.groups.HookBucket` for the flat hook.

    ``buffer()`` is the whole (site-averaged) bucket: the guard checks all of it, so every cross-site group takes
    the same decision; ``parameters()`` are the share's only, at ``layer_offsets()`` in the buffer.
    """

    def __init__(self, bucket: dist.GradBucket, indices: Sequence[int]) -> None:
        self._bucket = bucket
        params = bucket.parameters()
        starts = layer_offsets(bucket)
        self._params = [params[i] for i in indices]
        self._offsets = tuple(starts[i] for i in indices)

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def buffer(self) -> Tensor:
        return self._bucket.buffer()

    def parameters(self) -> list[Tensor]:
        return self._params

    def layer_offsets(self) -> tuple[int, ...]:
        return self._offsets


def hierarchical_hook(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook of the hierarchical exchange (``state.hierarchy`` set, ``state.process_group`` the
    cross-site group). Register with ``ddp_model.register_comm_hook(state, hierarchical_hook)``."""
    with torch.autocast(bucket.buffer().device.type, enabled=False):
        return _hierarchical_bucket(state, bucket)


def _hierarchical_bucket(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    site = state.hierarchy
    assert isinstance(site, SiteExchange), "hierarchical_hook needs a hook state built with `hierarchy=`"
    buffer = bucket.buffer()
    k = site.site_size
    skipping = state.step_nonfinite and bucket.index() != 0  # decided on every rank alike: no collective needed
    if not skipping:
        with state.observer.blocking():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=site.site_group)
        state.ledger.count("site_allreduce")
        buffer.div_(k)
    params = bucket.parameters()
    owned = [i for i, p in enumerate(params) if state.names[id(p)] in site.owned]
    share = _ShareBucket(bucket, owned)
    # the flat hook on this rank's share, with the cross-site group; its collectives are waited for here so the
    # dense exchange of the decoded shares is issued from the hook body (never from a `.then`, see comm)
    _exchange_bucket(state, share).wait()
    if state.step_nonfinite:  # the guard filled the bucket with NaN on every rank
        site.lan_bytes[bucket.index()] = 0 if skipping else buffer.numel() * buffer.element_size()
        return comm.completed(buffer)
    # the others' shares come from them: zero theirs here (one op for all of them, the groups' cached index)
    mine = set(owned)
    others = [i for i in range(len(params)) if i not in mine]
    if others:
        positions = layer_offsets(bucket)
        for group in state.layouts.groups([state.names[id(params[i])] for i in others], [params[i].shape for i in others],
                                          [positions[i] for i in others], [state.router.identity] * len(others),
                                          buffer.element_size(), None):
            group.fill(buffer, 0.0)
    future = comm.all_reduce_sum(buffer, site.site_group)
    state.ledger.count("site_allreduce")
    site.lan_bytes[bucket.index()] = 2 * buffer.numel() * buffer.element_size()

    def done(_: object) -> Tensor:
        observe_decoded(state, buffer)  # the whole bucket, so every rank keeps the same flags
        return buffer

    return future.then(done)
