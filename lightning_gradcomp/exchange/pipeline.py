"""Per-layer transforms that run inside the communication hook, before compression.

Callbacks such as :class:`~lightning_gradcomp.callbacks.SigmaClipping` attach a :class:`LayerTransform` to
the strategy at setup. They must run inside the hook: Lightning's ``on_before_optimizer_step`` sees the
gradient only after DDP has already exchanged it.
"""

from typing import Any

from torch import Tensor


class LayerTransform:
    """A per-parameter step of the pipeline; subclasses override what they need.

    ``before_compress`` sees this rank's local gradient of one parameter (keyed by name) and returns what
    is handed to the compressor. ``after_compress`` sees what that rank's packet effectively sent, so
    stateful transforms (momentum correction) can clear what left.
    """

    #: whether the transform also runs on parameters the strategy keeps in fp32 (``exclude``/``min_numel``);
    #: clipping does not (TernGrad's code neither clips nor ternarizes those), momentum correction does
    applies_to_float: bool = False

    def setup(self, names: list[str], rank: int, world_size: int) -> None:
        """Called once with the names of all parameters that go through the hook."""

    def before_compress(self, grad: Tensor, name: str) -> Tensor:
        """Transform this rank's gradient of parameter ``name``; must not modify ``grad`` in place."""
        return grad

    def after_compress(self, name: str, compressed_input: Tensor, sent: Tensor) -> None:
        """Observe what was compressed and what the packet effectively sent (its local decode)."""

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
