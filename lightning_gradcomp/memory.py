"""Error feedback: what a compressor did not send is kept per rank, by parameter name, and added back.

One mechanism for every compressor with ``uses_memory``: before compression ``x = grad + residual``;
after it ``residual = x - sent``, where ``sent`` is this rank's own packet decoded. So
``grad + old residual == sent + new residual`` holds by construction.
"""

from typing import Any, Optional

import torch
from torch import Tensor


class ResidualMemory:
    """Per-rank residuals keyed by parameter name (never by bucket index: DDP rebuilds buckets).

    Args:
        storage: where residuals are kept (``None``: beside the gradient). ``torch.device("cpu")`` keeps them off
            the accelerator (DiLoCo's outer error feedback, which holds a full model's worth of values).
    """

    def __init__(self, storage: Optional[torch.device] = None) -> None:
        self.residuals: dict[str, Tensor] = {}
        self.storage = storage

    def compensate(self, grad: Tensor, name: str) -> Tensor:
        """The gradient plus the residual left from earlier steps (a new tensor; ``grad`` is not modified)."""
        residual = self.residuals.get(name)
        if residual is None:
            return grad.clone()
        return grad + residual.to(grad.device, non_blocking=True)

    def update(self, name: str, compensated: Tensor, sent: Tensor) -> None:
        """Keep what ``sent`` did not carry of ``compensated``."""
        residual = compensated - sent
        self.residuals[name] = residual if self.storage is None else residual.to(self.storage)

    def norm(self, name: str) -> Tensor:
        """L2 norm of a residual (0 when none); a 0-d tensor, no host sync."""
        residual = self.residuals.get(name)
        return torch.zeros(()) if residual is None else residual.norm()

    def state_dict(self) -> dict[str, Any]:
        return {name: r.detach().cpu().clone() for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        target = device if self.storage is None else self.storage
        self.residuals = {name: r.to(target) for name, r in state.items()}
