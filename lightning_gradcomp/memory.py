"""Error feedback: what a compressor did not send is kept per rank, by parameter name, and added back.

One mechanism for every compressor with ``uses_memory``: before compression ``x = grad + residual``;
after it ``residual = x - sent``, where ``sent`` is this rank's own packet decoded. So
``grad + old residual == sent + new residual`` holds by construction (with a ``decay`` below 1:
``grad + decay * old residual == sent + new residual``).
"""

from typing import Any, Optional

import torch
from torch import Tensor


class ResidualMemory:
    """Per-rank residuals keyed by parameter name (never by bucket index: DDP rebuilds buckets).

    Args:
        storage: where residuals are kept (``None``: beside the gradient). ``torch.device("cpu")`` keeps them off
            the accelerator (DiLoCo's outer error feedback, which holds a full model's worth of values).
        decay: the factor on the residual added back (1: plain error feedback). Below 1 for pseudo-gradients
            (SparseLoCo's ``beta``): a site re-derives its unsent progress from the same anchor every round, so a
            residual that never fades counts that progress again and again.
    """

    def __init__(self, storage: Optional[torch.device] = None, decay: float = 1.0) -> None:
        self.residuals: dict[str, Tensor] = {}
        self.storage = storage
        self.decay = decay
        # the step's transaction: the residuals this step replaced (``None``: had none), for :meth:`rollback`;
        # ``None`` when the step keeps no undo (a step that cannot be skipped)
        self._undo: Optional[dict[str, Optional[Tensor]]] = None

    def begin_step(self, keep_undo: bool = True) -> None:
        """Open a step: forget the previous step's undo; keep this step's if it may be rolled back."""
        self._undo = {} if keep_undo else None

    def rollback(self) -> None:
        """Put back every residual this step replaced (a step skipped on every rank), then close the step."""
        for name, old in (self._undo or {}).items():
            if old is None:
                self.residuals.pop(name, None)
            else:
                self.residuals[name] = old
        self._undo = None

    def compensate(self, grad: Tensor, name: str) -> Tensor:
        """The gradient plus the residual left from earlier steps (a new tensor; ``grad`` is not modified)."""
        residual = self.residuals.get(name)
        if residual is None:
            return grad.clone()
        residual = residual.to(grad.device, non_blocking=True)
        return grad + residual if self.decay == 1.0 else grad + self.decay * residual

    def update(self, name: str, compensated: Tensor, sent: Tensor) -> None:
        """Keep what ``sent`` did not carry of ``compensated``."""
        if self._undo is not None and name not in self._undo:
            self._undo[name] = self.residuals.get(name)
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
