"""Hierarchical exchange: dense inside a site (node), compressed between sites, for every compressor.

Per DDP bucket, identically on every rank:

1. the model's parameters are split into ``k`` contiguous (in the model's order), byte-balanced shares (whole
   parameters, so layer-wise scalers, thresholds and bins keep their meaning; the split depends on the parameter
   sizes only and holds for the whole run, see :func:`share_index`), one per local rank. A dense reduce inside the
   site (the LAN: :func:`lightning_gradcomp.exchange.comm.reduce_to_owners_`, each share's segment to its owner, summed
   there) leaves local rank ``j`` with the site's sum of share ``j`` of the bucket, divided by the site size: the
   site's mean gradient of that share;
2. local rank ``j`` runs the flat hook (:func:`lightning_gradcomp.exchange.hook.gradcomp_hook`: transforms, error
   feedback, shared statistics, compression, collectives, decode) on its share, with the *cross-site* group of
   the ranks with local index ``j`` in every site. So each local rank puts about ``1/k`` of a step's inter-site
   bytes on the link, and the compressor averages over sites;
3. a dense gather of the decoded shares inside the site (:func:`lightning_gradcomp.exchange.comm.gather_from_owners`),
   unpacked into DDP's bucket: every rank ends with the same averaged bucket.

Each rank sends the other shares once and its own share to the ``k - 1`` others: for ``k = 2`` the bucket once
per step, whatever the split (a DDP bucket often holds one share only: buckets and shares are both contiguous
in the model's order), half of what two all-reduces (the mean in, the decoded shares out) would send.

Everything the flat hook keeps per parameter (residuals, random streams, records) is then kept only by the
share's owner, keyed by parameter name as before; the checkpoint saves every rank's part, so resume is exact.

Non-finite guard: a rank sees only its share after the reduce, so each share's segment carries one more element,
the *flag slot*: every rank writes ``0`` there when its whole bucket is finite and NaN when not, and the reduce
sums the site's slots into every share. The flat hook's guard scans its share, slot included, so a
NaN on any rank of any site reaches every cross-site group and every rank skips the same steps. Every rank
checks the whole decoded bucket after the gather, so the decoded flags agree too.

Sites are contiguous blocks of global ranks (:mod:`lightning_gradcomp.sites.layout`); all sites must have the
same size so that every local index has one rank in every site.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.exchange import comm
from lightning_gradcomp.exchange.guard import observe_decoded
from lightning_gradcomp.exchange.groups import layer_offsets
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.sites.layout import SiteLayout, new_group, new_site_groups, site_layout
from lightning_gradcomp.validation import check_choice, check_int
from lightning_gradcomp.exchange.ledger import tensor_bytes


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


def share_index(sizes: Sequence[tuple[str, int]], shares: int) -> dict[str, int]:
    """Each parameter's share: ``sizes`` (name, bytes, in the model's order) split by :func:`share_bounds`.

    Ownership is fixed for the whole run rather than drawn per DDP bucket: DDP rebuilds its buckets after the first
    step (and again after a resume), so a per-bucket split would move a parameter's residual between ranks.
    """
    bounds = share_bounds([n for _, n in sizes], shares)
    return {name: j for j, (start, end) in enumerate(bounds) for name, _ in sizes[start:end]}


def owned_names(sizes: Sequence[tuple[str, int]], shares: int, share: int) -> frozenset[str]:
    """The parameters of ``share`` (:func:`share_index`)."""
    return frozenset(name for name, j in share_index(sizes, shares).items() if j == share)


@dataclass(frozen=True)
class SharePlan:
    """Where each share of one DDP bucket lies in the bucket and in the site's exchanges.

    Both dense exchanges carry the shares as *segments*, in share order: segment ``j`` is share ``j``'s parameters
    back to back (in the bucket's order) followed by the flag slot. The parameters are copied as *runs* (adjacent
    in the bucket and in the segment), so packing costs one copy per run, not per parameter: shares are contiguous
    in the model's order, so a bucket holds one or two runs per share.

    Attributes:
        runs: per share, ``(bucket offset, segment offset, elements)`` of each run.
        lengths: per share, its elements (its segment has one more: the flag slot).
        params: per share, the bucket's indices of its parameters.
        offsets: per share, those parameters' offsets in the segment.
    """

    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    lengths: tuple[int, ...]
    params: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    @property
    def splits(self) -> list[int]:
        """Each segment's elements, in share order."""
        return [n + 1 for n in self.lengths]

    def segment(self, j: int, segments: Tensor) -> Tensor:
        """Share ``j``'s segment (its flag slot last) in ``segments``, the segments back to back."""
        start = sum(self.lengths[:j]) + j
        return segments[start : start + self.lengths[j] + 1]

    def pack(self, buffer: Tensor, segments: Tensor, flag: Tensor) -> None:
        """Write every share of ``buffer`` into its segment of ``segments``, and ``flag`` into every flag slot."""
        for j, runs in enumerate(self.runs):
            segment = self.segment(j, segments)
            for at, to, n in runs:
                segment[to : to + n].copy_(buffer[at : at + n])
            segment[-1:].copy_(flag.reshape(1))

    def unpack(self, segments: Tensor, buffer: Tensor) -> None:
        """Write every share in ``segments`` back to its place in ``buffer``."""
        for j, runs in enumerate(self.runs):
            segment = self.segment(j, segments)
            for at, to, n in runs:
                buffer[at : at + n].copy_(segment[to : to + n])


def share_plan(shares: Sequence[int], numels: Sequence[int], offsets: Sequence[int], k: int) -> SharePlan:
    """The plan of a bucket whose parameters (``numels`` at ``offsets``) belong to ``shares`` (of ``k``)."""
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(k)]
    params: list[list[int]] = [[] for _ in range(k)]
    segment_offsets: list[list[int]] = [[] for _ in range(k)]
    lengths = [0] * k
    for i in sorted(range(len(numels)), key=lambda i: offsets[i]):
        j, n, at = shares[i], numels[i], offsets[i]
        params[j].append(i)
        segment_offsets[j].append(lengths[j])
        last = runs[j][-1] if runs[j] else None
        if last is not None and last[0] + last[2] == at:  # adjacent in the bucket and in the segment: one copy
            runs[j][-1] = (last[0], last[1], last[2] + n)
        else:
            runs[j].append((at, lengths[j], n))
        lengths[j] += n
    return SharePlan(runs=tuple(tuple(r) for r in runs), lengths=tuple(lengths),
                     params=tuple(tuple(p) for p in params), offsets=tuple(tuple(o) for o in segment_offsets))


@dataclass
class SiteExchange:
    """This rank's place in the hierarchy and the groups it exchanges with.

    Attributes:
        layout: the sites.
        site: this rank's site.
        local_rank: this rank's index inside its site (which share of each bucket it owns).
        site_group: the ranks of this site (the fast link).
        cross_group: the ranks with this local index in every site (the slow link); the hook state's group.
        shares: every parameter's share (:func:`share_index`), by name.
        plans: the :class:`SharePlan` of each bucket, by bucket index and parameter names.
    """

    layout: SiteLayout
    site: int
    local_rank: int
    site_group: Optional[dist.ProcessGroup]
    cross_group: Optional[dist.ProcessGroup]
    shares: dict[str, int]
    plans: dict[tuple[int, tuple[str, ...]], SharePlan] = field(default_factory=dict)

    @property
    def site_size(self) -> int:
        return self.layout.sizes[self.site]

    @property
    def owned(self) -> frozenset[str]:
        """The names of the parameters whose share this rank compresses and exchanges between sites."""
        return frozenset(name for name, j in self.shares.items() if j == self.local_rank)

    def plan(self, bucket: dist.GradBucket, names: Sequence[str]) -> SharePlan:
        """The bucket's plan, made the first time its parameters are seen (DDP rebuilds buckets once)."""
        key = (bucket.index(), tuple(names))
        plan = self.plans.get(key)
        if plan is None:
            numels = [p.numel() for p in bucket.parameters()]
            plan = share_plan([self.shares[n] for n in names], numels, layer_offsets(bucket), self.site_size)
            self.plans[key] = plan
        return plan


def new_site_exchange(
    layout: SiteLayout, rank: int, sizes: Sequence[tuple[str, int]], timeout: Optional[timedelta] = None
) -> SiteExchange:
    """Create the site groups and the cross-site groups; every rank must call this, in the same order.

    Args:
        layout: the sites (equal sizes).
        rank: this rank's global rank.
        sizes: every parameter that goes through the hook, (name, bytes) in the model's order.
        timeout: every group's collective timeout (the strategy's ``timeout``, see :func:`~lightning_gradcomp.sites.layout.new_group`).
    """

    groups = new_site_groups(layout, rank, timeout)
    k = layout.sizes[0]
    cross: Optional[dist.ProcessGroup] = None
    for j in range(k):  # dist.new_group is collective over the default group: every rank creates every group
        group = new_group([start + j for start in layout.starts], timeout)
        if j == groups.site_rank:
            cross = group
    return SiteExchange(layout=layout, site=groups.site, local_rank=groups.site_rank, site_group=groups.site_group,
                        cross_group=cross, shares=share_index(sizes, k))


class _ShareBucket:
    """One local rank's share of a DDP bucket, a :class:`~lightning_gradcomp.exchange.groups.HookBucket` for the flat hook.

    ``buffer()`` is the share's segment (after the reduce: the site's mean and the flag slot), or the whole
    bucket on a step already skipped; ``parameters()`` are the share's only, at ``layer_offsets()`` in it.
    """

    def __init__(self, bucket: dist.GradBucket, buffer: Tensor, indices: Sequence[int], offsets: Sequence[int]) -> None:
        self._bucket = bucket
        self._buffer = buffer
        params = bucket.parameters()
        self._params = [params[i] for i in indices]
        self._offsets = tuple(offsets)

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> list[Tensor]:
        return self._params

    def layer_offsets(self) -> tuple[int, ...]:
        return self._offsets


def hierarchical_hook(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook of the hierarchical exchange (``state.peers.hierarchy`` set, ``state.peers.process_group`` the
    cross-site group). Register with ``ddp_model.register_comm_hook(state, hierarchical_hook)``."""
    with torch.autocast(bucket.buffer().device.type, enabled=False):
        return _hierarchical_bucket(state, bucket)


def _flag_slot(state: GradCompState, buffer: Tensor) -> Tensor:
    """0 where this rank's bucket is finite, NaN where not (one element): what this rank adds to the flag slots.

    Exact without a bucket-sized temporary or a host read: min and max propagate NaN, and an infinite one times 0
    is NaN (a sum, the guard's cheap check, may overflow float32 on finite values)."""
    if state.guard.mode == "ignore":
        return buffer.new_zeros(())
    low, high = torch.aminmax(buffer)
    return low * 0 + high * 0


def _hierarchical_bucket(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    site = state.peers.hierarchy
    assert isinstance(site, SiteExchange), "hierarchical_hook needs a hook state built with `hierarchy=`"
    buffer = bucket.buffer()
    k, j, index = site.site_size, site.local_rank, bucket.index()
    plan = site.plan(bucket, [state.names[id(p)] for p in bucket.parameters()])
    if state.guard.step_nonfinite and index != 0:
        # decided on every rank alike: no collective; the flat hook (which counts the call) fills the bucket
        state.ledger.record_lan(index, 0)
        positions = layer_offsets(bucket)
        gradcomp_hook(state, _ShareBucket(bucket, buffer, plan.params[j], [positions[i] for i in plan.params[j]]))
        return comm.completed(buffer)

    splits, size = plan.splits, plan.lengths[j] + 1
    segments = state.scratch.take(("site", index, "segments"), sum(splits), buffer.dtype, buffer.device)
    plan.pack(buffer, segments, _flag_slot(state, buffer))
    mine = state.scratch.take(("site", index, "mine"), size, buffer.dtype, buffer.device)
    copies = state.scratch.take(("site", index, "copies"), k * size, buffer.dtype, buffer.device)
    with state.observer.blocking():
        comm.reduce_to_owners_(mine, segments, splits, site.site_group, copies)
    state.ledger.count("site_reduce")
    mine.div_(k)
    sent = tensor_bytes(buffer, sum(splits) - size)
    # the flat hook on this rank's share, with the cross-site group; its collectives are waited for here so the
    # exchange of the decoded shares is issued from the hook body (never from a `.then`, see comm)
    gradcomp_hook(state, _ShareBucket(bucket, mine, plan.params[j], plan.offsets[j])).wait()
    if state.guard.step_nonfinite:  # every cross-site group saw the flag slots: the same decision on every rank
        state.ledger.record_lan(index, sent)
        return comm.completed(buffer.fill_(float("nan")))
    future = comm.gather_from_owners(segments, mine, splits, site.site_group, copies)
    state.ledger.count("site_gather")
    # over the fast link: the other shares' segments to their owners, then this rank's segment to the k - 1 others
    state.ledger.record_lan(index, sent + tensor_bytes(buffer, (k - 1) * size))

    def done(_: object) -> Tensor:
        plan.unpack(segments, buffer)
        observe_decoded(state, buffer)  # the whole bucket, so every rank keeps the same flags
        return buffer

    return future.then(done)
