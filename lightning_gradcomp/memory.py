"""Error feedback: what a compressor did not send is kept per rank, by parameter name, and added back.

One mechanism for every compressor with ``uses_memory``: before compression ``x = grad + residual``;
after it ``residual = x - sent``, where ``sent`` is this rank's own packet decoded. So
``grad + old residual == sent + new residual`` holds by construction.
"""

from typing import Any

import torch
from torch import Tensor


class ResidualMemory:
    """Per-rank residuals keyed by parameter name (never by bucket index: DDP rebuilds buckets)."""

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, grad: Tensor, name: str) -> Tensor:
        """The gradient plus the residual left from earlier steps (a new tensor; ``grad`` is not modified)."""
        residual = self.residuals.get(name)
        if residual is None:
            return grad.clone()
        return grad + residual

    def update(self, name: str, compensated: Tensor, sent: Tensor) -> None:
        """Keep what ``sent`` did not carry of ``compensated``."""
        self.residuals[name] = compensated - sent

    def norm(self, name: str) -> Tensor:
        """L2 norm of a residual (0 when none); a 0-d tensor, no host sync."""
        residual = self.residuals.get(name)
        return torch.zeros(()) if residual is None else residual.norm()

    def state_dict(self) -> dict[str, Any]:
        return {name: r.detach().cpu().clone() for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.residuals = {name: r.to(device) for name, r in state.items()}
