"""Which compressor each layer of a bucket uses this step: one decision per bucket, one owner.

A layer may have a compressor of its own (``layer_compressors``: a preset's embedding rows); every other layer has
the configured one. Three things send a layer uncompressed (fp32 through the identity compressor): the user's exclusions (``exclude``,
``min_numel``: fixed at setup), the collective planner's choice for the bucket (compression would not pay on this
link), and a dense warm-up (:class:`~lightning_gradcomp.callbacks.CompressionSchedule`). The router holds all
three; the hook asks it once per bucket (:meth:`Router.route`) and uses the answer for every stage of that bucket.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Protocol

from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.identity import Identity


class Plan(Protocol):
    """A planner's decision for one bucket (:class:`~lightning_gradcomp.exchange.planner.BucketPlan`)."""

    def compressor_for(self, compressor: Compressor, plain: Compressor) -> Compressor: ...


class Planner(Protocol):
    """What the router asks of a planner (:class:`~lightning_gradcomp.exchange.planner.CollectivePlanner`; a protocol,
    because the planner probes compressors through the hook's exchange, which routes through this module)."""

    def plan(self, state: Any, names: Sequence[str], grads: Sequence[Tensor]) -> Optional[Plan]: ...


class Router:
    """Per layer: the configured compressor, or the identity (fp32) one.

    Args:
        compressor: compresses every layer not sent in fp32.
        float_names: layers always sent in fp32 (the strategy's ``exclude`` / ``min_numel``).
        identity: the fp32 compressor (WeightGrad's serial aggregation swaps in a gathered one).
        planner: a :class:`~lightning_gradcomp.exchange.planner.CollectivePlanner` consulted at the top of each bucket
            (``None``: always compress).
        layer_compressors: layers with a compressor of their own (already set up), by name; the planner's choice
            does not apply to them, an fp32 exclusion and a dense warm-up do.
    """

    def __init__(
        self,
        compressor: Compressor,
        float_names: Iterable[str] = frozenset(),
        identity: Optional[Compressor] = None,
        planner: Optional[Planner] = None,
        layer_compressors: Optional[Mapping[str, Compressor]] = None,
    ) -> None:
        self.compressor = compressor
        self.layer_compressors: Mapping[str, Compressor] = dict(layer_compressors or {})
        self.float_names = frozenset(float_names)
        self.identity: Compressor = Identity() if identity is None else identity
        self.planner = planner
        self._dense = False

    @property
    def dense(self) -> bool:
        """Whether every layer is sent in fp32 this step (a dense warm-up)."""
        return self._dense

    def set_dense(self, dense: bool) -> None:
        """Send every layer in fp32 from the next bucket on; must be set identically on every rank before backward."""
        self._dense = bool(dense)

    def is_float(self, name: str) -> bool:
        """Whether the user excluded ``name`` from compression (transforms may skip such layers)."""
        return name in self.float_names

    def route(self, state: Any, names: Sequence[str], grads: Sequence[Tensor]) -> list[Compressor]:
        """Each layer's compressor for this bucket, after the planner (first time: one small agreed all-reduce)."""
        plan = None if self.planner is None else self.planner.plan(state, names, grads)
        return self.route_with(plan, names)

    def route_with(self, plan: Optional[Plan], names: Sequence[str]) -> list[Compressor]:
        """Each layer's compressor under ``plan`` (``None``: no planner): fp32 for exclusions and a dense warm-up,
        else what the plan chose for the bucket (the identity where compression would not pay, or the compressor
        travelling as the chosen collective variant)."""
        bucket = self.compressor if plan is None else plan.compressor_for(self.compressor, self.identity)
        own = self.layer_compressors
        return [self.identity if self._dense or n in self.float_names else own.get(n, bucket) for n in names]
