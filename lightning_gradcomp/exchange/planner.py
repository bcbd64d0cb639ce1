"""Per-bucket choice of collective from the cost model: compress only where it pays on this link.

The hook consults a :class:`CollectivePlanner` at the top of each bucket. The first time a bucket (a tuple of
parameter names) is seen, the planner probes a copy of the compressor on the bucket's gradients, once per
collective variant the compressor declares (:meth:`~lightning_gradcomp.compressors.base.Compressor.collectives`;
the compressor as it is when it declares none): exact bytes on the wire and measured compress/decode seconds, or
the supplied per-element cost. It agrees the numbers with the other ranks (one small max all-reduce, issued
from the hook body like every collective), and asks :func:`lightning_gradcomp.exchange.costmodel.choose` for the fastest of:

* ``allreduce_fp32``: compression off for this bucket (plain all-reduce of the float gradient);
* ``allgather``: all-gather of packed payloads (gather-only compressors, TernGrad's packed form);
* ``allreduce_<dtype>``: all-reduce of summable payloads (TernGrad's int8 sums with a shared scaler, ...).

The planner returns its choice as a :class:`BucketPlan`; the hook sends the bucket's compressed layers through
:meth:`BucketPlan.compressor_for` (plain fp32, or the compressor travelling as the chosen variant). The planner
changes neither the compressor nor the hook's state.

The choice is cached per bucket, logged once at INFO and counted in ``GradCompState.ledger.collectives`` as
``plan_<choice>`` on every call. Every rank sees the same agreed numbers, so ranks given the same link make the
same choice; the choices are then agreed too (a second small all-reduce: a vote, where a split vote takes the
earliest chosen candidate in the shared order, plain fp32 whenever a rank chose it), so even ranks given
different links never diverge and their collectives always match.
"""

import copy
import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch
from torch import Tensor

from lightning_gradcomp.exchange.codec import measure_exchange
from lightning_gradcomp.compressors.base import Aggregation, CollectiveChoice, CollectiveVariant, Compressor
from lightning_gradcomp.exchange.ledger import Ledger
from lightning_gradcomp.exchange.transport import Transport
from lightning_gradcomp.exchange.costmodel import ALLREDUCE_FP32, Candidate, CollectivePlan, CompressionCost, Link, Network, choose

log = logging.getLogger(__name__)


class PlannedRouter(Protocol):
    """What the planner reads of the hook's router (:class:`~lightning_gradcomp.exchange.router.Router`): the
    compressor it probes."""

    @property
    def compressor(self) -> Compressor: ...


class PlannerContext(Protocol):
    """What the planner reads of the hook's state (:class:`~lightning_gradcomp.exchange.hook.GradCompState` is one), and
    the ledger it counts its own collectives in."""

    @property
    def router(self) -> PlannedRouter: ...

    @property
    def float_names(self) -> AbstractSet[str]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def transport(self) -> Transport: ...


@dataclass(frozen=True)
class BucketPlan:
    """What the planner decided for one bucket.

    Attributes:
        choice: the winning candidate: ``"allreduce_fp32"`` (compression off) or the compressed form's name.
        collective: the compressor's variant to travel as (a name from its ``collectives``); ``None`` when
            compression is off or the compressor declares no variants (it travels as it is).
        seconds: the cost model's estimate per candidate.
    """

    choice: str
    collective: Optional[str]
    seconds: dict[str, float]

    @property
    def plain(self) -> bool:
        """Whether the bucket's layers go uncompressed (compression would not pay)."""
        return self.choice == ALLREDUCE_FP32

    def compressor_for(self, compressor: Compressor, plain: Compressor) -> Compressor:
        """What the bucket's compressed layers use: ``plain`` (the fp32 identity) when compression is off, else
        ``compressor`` travelling as the chosen variant."""
        if self.plain:
            return plain
        if self.collective is None:
            return compressor
        assert isinstance(compressor, CollectiveChoice), "a variant is chosen only among a compressor's declared ones"
        variants = {v.name: v.compressor for v in compressor.collectives(compressor.world_size)}
        return variants[self.collective]


class CollectivePlanner:
    """Chooses per bucket between plain fp32 all-reduce and the compressor's collectives.

    Args:
        network: the links between ranks: a :class:`~lightning_gradcomp.exchange.costmodel.Network`, a
            :class:`~lightning_gradcomp.exchange.costmodel.Link`, or a spec such as ``"1gbit"`` / ``"100mbit@2ms"``.
        cost: compress/decode seconds per element; ``None`` measures them on the first step (each bucket's
            compression is timed once on a copy of the compressor, the max over ranks is used).
    """

    def __init__(self, network: Union[str, Link, Network], cost: Optional[CompressionCost] = None) -> None:
        self.network = Network.parse(network)
        if cost is not None and not isinstance(cost, CompressionCost):
            raise ValueError(f"Expected `cost` to be a CompressionCost or None, but got {cost!r}.")
        self.cost = cost
        self.plans: dict[tuple[str, ...], BucketPlan] = {}

    def plan(self, state: PlannerContext, names: Sequence[str], grads: Sequence[Tensor]) -> Optional[BucketPlan]:
        """The plan of the bucket holding ``names``: decided the first time, then cached; ``None`` when every
        layer of the bucket is kept in fp32 anyway. Counts ``plan_<choice>`` in ``state.ledger``.

        Called from the hook body, before anything else, identically on every rank.
        """
        key = tuple(names)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._decide(state, names, grads)
            if plan is None:
                return None
            self.plans[key] = plan
        state.ledger.count(f"plan_{plan.choice}")
        return plan

    # -- decision -------------------------------------------------------------------------------------
    def _probe(
        self, state: PlannerContext, variant: Optional[CollectiveVariant], inputs: Sequence[Tensor], names: Sequence[str]
    ) -> tuple[str, str, float, float, float, int]:
        """One variant on a copy of the compressor, through the hook's own exchange
        (:func:`~lightning_gradcomp.exchange.codec.measure_exchange`): (name, collective, bytes, encode s, decode s, rounds)."""
        try:
            probe = copy.deepcopy(state.router.compressor)
        except Exception:  # a compressor holding something uncopyable: a fresh set-up copy is equivalent
            probe = copy.copy(state.router.compressor)
        probe.setup(state.router.compressor.rank, state.world_size, inputs[0].device)
        if variant is not None:
            assert isinstance(probe, CollectiveChoice)  # the variant was declared by this compressor's class
            probe = next(v.compressor for v in probe.collectives(state.world_size) if v.name == variant.name)
        codec = measure_exchange(probe, list(names), [x.detach() for x in inputs], state.world_size, repeats=1)
        gather = codec.aggregation is Aggregation.GATHER
        collective = "allgather" if gather else "allreduce"
        label = variant.name if variant is not None else (codec.collective or collective)
        return label, collective, codec.nbytes, codec.encode_s, codec.decode_s, codec.rounds

    def _decide(self, state: PlannerContext, names: Sequence[str], grads: Sequence[Tensor]) -> Optional[BucketPlan]:
        idx = [i for i, n in enumerate(names) if n not in state.float_names]
        if not idx:
            return None
        inputs = [grads[i].detach() for i in idx]
        sub_names = [names[i] for i in idx]
        numel = sum(x.numel() for x in inputs)
        # the declared variants, or the compressor as it is
        declared = state.router.compressor.collectives(state.world_size) if isinstance(state.router.compressor, CollectiveChoice) else ()
        variants: list[Optional[CollectiveVariant]] = list(declared) or [None]
        probes = [self._probe(state, v, inputs, sub_names) for v in variants]
        numbers = []
        for _label, collective, nbytes, encode, decode, _ in probes:
            if self.cost is not None:
                encode = self.cost.encode * numel
                decode = self.cost.decode * numel * (state.world_size if collective == "allgather" else 1)
            numbers += [nbytes, encode + decode]
        agreed = torch.tensor(numbers, dtype=torch.float64)
        if state.world_size > 1:
            # timings (and data-dependent sizes) differ per rank: decide on the max so every rank agrees
            state.transport.max_(agreed)
            state.ledger.count("allreduce_max")
        values = agreed.tolist()
        candidates = [Candidate(ALLREDUCE_FP32, "allreduce", 4.0 * numel)]
        for k, (label, collective, _, _, _, rounds) in enumerate(probes):
            candidates.append(Candidate(label, collective, values[2 * k], values[2 * k + 1], rounds))
        plan = choose(candidates, state.world_size, self.network)
        if state.world_size > 1:
            plan = self._agree(state, plan, [c.name for c in candidates])
        chosen = None
        if plan.choice != ALLREDUCE_FP32:
            variant = variants[[p[0] for p in probes].index(plan.choice)]
            chosen = None if variant is None else variant.name
        log.info(
            "gradcomp: bucket of %d tensors (%d elements) on %s, %d ranks -> %s",
            len(sub_names),
            numel,
            self.network,
            state.world_size,
            plan.describe(),
        )
        return BucketPlan(plan.choice, chosen, plan.seconds)

    def _agree(self, state: PlannerContext, plan: CollectivePlan, names: list[str]) -> CollectivePlan:
        """Every rank's choice, made the same: the ranks vote, and a split vote takes the earliest chosen candidate.

        The agreed numbers make the choice identical when every rank is given the same link; a rank given
        another link (a per-rank measured bandwidth, a per-node config) would otherwise pick another collective
        and the ranks' collectives would stop matching. Candidates are listed in the same order on every rank,
        plain fp32 first, so a split vote in which any rank chose plain fp32 falls back to it (the choice that
        compresses nothing); a split between compressed forms takes the one listed first.
        """
        vote = torch.zeros(len(names), dtype=torch.float64)
        vote[names.index(plan.choice)] = 1.0
        state.transport.max_(vote)
        state.ledger.count("allreduce_max")
        chosen = [name for name, v in zip(names, vote.tolist()) if v > 0]
        if len(chosen) == 1:
            return plan
        log.warning(
            "gradcomp: ranks chose different collectives for a bucket (%s; this rank: %s on %s): they were given "
            "different links. Using %s on every rank. Fix: pass the same `link` to GradCompStrategy on every rank.",
            ", ".join(chosen), plan.choice, self.network, chosen[0],
        )
        return CollectivePlan(chosen[0], plan.seconds)

    def describe(self) -> dict[str, Any]:
        """Settings, for logs and the run config."""
        return {"network": str(self.network), "cost": None if self.cost is None else vars(self.cost)}
