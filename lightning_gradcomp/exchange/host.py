"""What a callback needs of a strategy that runs the compression hook: :class:`HookHost`.

The callbacks (clipping, momentum correction, the schedule, the monitor) work on the strategy through this protocol,
never through the strategies' classes: the strategies add callbacks of their own (the monitor, the progress bar, the
schedule) and take pipeline callbacks as transforms under Fabric, so a callback importing a strategy would make the
two folders import each other. Every strategy that installs the hook (``GradCompStrategy``,
``GradCompFabricStrategy``, the sharded strategies, DiLoCo, WeightGrad, 1-bit Adam: the ones with
``strategies.wiring.HookWiring``) is one; ``TowerStrategy`` attaches no transform and is not.
"""

from collections.abc import Sequence
from typing import Optional, Protocol, runtime_checkable

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.hook import GradCompState
from lightning_gradcomp.exchange.ledger import ByteReport
from lightning_gradcomp.exchange.pipeline import LayerTransform


@runtime_checkable
class HookHost(ByteReport, Protocol):
    """A strategy that runs the compression hook: its compressor and options, the transforms the hook runs before
    compression and how a callback attaches one, the hook's state once the model is wrapped, and its bytes
    (:class:`~lightning_gradcomp.exchange.ledger.ByteReport`).

    ``isinstance(strategy, HookHost)`` is how a callback checks, at setup, that the Trainer's strategy is one.
    """

    @property
    def compressor(self) -> Compressor:
        """The compressor the hook runs (a callback may read and set its options, e.g. a scheduled ``ratio``)."""
        ...

    @property
    def exclude(self) -> Sequence[str]:
        """Patterns of the parameter names sent in fp32."""
        ...

    @property
    def min_numel(self) -> int:
        """Parameters with fewer elements are sent in fp32."""
        ...

    @property
    def comm_state(self) -> Optional[GradCompState]:
        """The hook's state (``None`` until the model is wrapped)."""
        ...

    @property
    def transforms(self) -> Sequence[LayerTransform]:
        """The per-layer transforms, in the order the hook runs them."""
        ...

    def add_transform(self, transform: LayerTransform) -> None:
        """Attach a per-layer transform, before the model is wrapped (from a callback's ``setup``)."""
        ...
