"""Which compressor each layer of a bucket uses this step: one decision per bucket, one owner.

Three things send a layer uncompressed (fp32 through the identity compressor): the user's exclusions (``exclude``,
``min_numel``: fixed at setup), the collective planner's choice for the bucket (compression would not pay on this
link), and a dense warm-up (:class:`~lightning_gradcomp.callbacks.CompressionSchedule`). The router holds all
three; the hook asks it once per bucket (:meth:`Router.route`) and uses the answer for every stage of that bucket.
"""

from collections.abc import Iterable, Sequence
from typing import Any, Optional

from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.identity import Identity


class Router:
    """Per layer: the configured compressor, or the identity (fp32) one.

    Args:
        compressor: compresses every layer not sent in fp32.
        float_names: layers always sent in fp32 (the strategy's ``exclude`` / ``min_numel``).
        identity: the fp32 compressor (WeightGrad's serial aggregation swaps in a gathered one).
        planner: a :class:`~lightning_gradcomp.planner.CollectivePlanner` consulted at the top of each bucket
            (``None``: always compress).
    """

    def __init__(
        self,
        compressor: Compressor,
        float_names: Iterable[str] = frozenset(),
        identity: Optional[Compressor] = None,
        planner: Optional[Any] = None,
    ) -> None:
        self.compressor = compressor
        self.float_names = frozenset(float_names)
        self.identity: Compressor = Identity() if identity is None else identity
        self.planner = planner
        self._plain: set[str] = set()  # the planner's: compression would not pay for these on this link
        self._dense = False

    @property
    def dense(self) -> bool:
        """Whether every layer is sent in fp32 this step (a dense warm-up)."""
        return self._dense

    def set_dense(self, dense: bool) -> None:
        """Send every layer in fp32 from the next bucket on; must be set identically on every rank before backward."""
        self._dense = bool(dense)

    def follow_plan(self, names: Iterable[str], plain: bool) -> None:
        """The planner's decision for a bucket's compressed layers: fp32 (``plain``) or the compressor."""
        compressed = [n for n in names if n not in self.float_names]
        if plain:
            self._plain.update(compressed)
        else:
            self._plain.difference_update(compressed)

    def is_float(self, name: str) -> bool:
        """Whether the user excluded ``name`` from compression (transforms may skip such layers)."""
        return name in self.float_names

    def compressor_for(self, name: str) -> Compressor:
        """The compressor ``name`` uses under the current decisions."""
        if self._dense or name in self.float_names or name in self._plain:
            return self.identity
        return self.compressor

    def route(self, state: Any, names: Sequence[str], grads: Sequence[Tensor]) -> list[Compressor]:
        """Each layer's compressor for this bucket, after the planner (first time: one small agreed all-reduce)."""
        if self.planner is not None:
            self.planner.apply(state, names, grads)
        return [self.compressor_for(n) for n in names]
