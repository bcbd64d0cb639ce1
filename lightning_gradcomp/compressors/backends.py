"""The ``backend=`` option of the compressors with fused kernels (TernGrad, Gradient Dropping, AdaComp).

Such a compressor runs either its own torch ops (the reference) or a fused implementation built on
:mod:`lightning_gradcomp.kernels`. It decides once which, when it learns the device its gradients live on: in
:meth:`~lightning_gradcomp.compressors.base.Compressor.setup`, or at its first call when it is used without
``setup``. A fused implementation takes the tensors and settings it needs, never the compressor itself, so each
compressor module imports its fused module and not the other way round.
"""

from typing import Generic, Literal, Optional, TypeVar

import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Compressor

Backend = Literal["auto", "torch", "fused"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "fused")

F = TypeVar("F")


def fused_enabled(backend: str, device: torch.device) -> bool:
    """Whether a compressor with this ``backend`` takes the fused path for tensors on ``device``.

    ``"auto"`` is fused on CPU when the compiled kernels load here; ``"fused"`` is fused everywhere (torch-ops
    kernels off CPU or without a compiler); ``"torch"`` never.
    """
    if backend != "auto":
        return backend == "fused"
    return device.type == "cpu" and kernels.fused_available()


class KernelBacked(Compressor, Generic[F]):
    """A compressor with a ``backend=`` option: a fused implementation of type ``F`` or its own torch ops.

    Subclasses set :attr:`backend` and call :meth:`_offer_kernels` in ``__init__`` with their fused implementation;
    their methods then ask :meth:`_kernels` for it, which answers ``None`` when the torch ops run.
    """

    #: ``"auto"``, ``"torch"`` or ``"fused"`` (see :func:`fused_enabled`); read when the backend is chosen
    backend: str

    def _offer_kernels(self, fused: F) -> None:
        self._fused_impl = fused
        self._chosen: Optional[bool] = None

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._chosen = fused_enabled(self.backend, device)

    def _kernels(self, device: torch.device) -> Optional[F]:
        """The fused implementation, or ``None`` for torch ops: as chosen in ``setup``, or chosen now for
        ``device`` when this compressor is used without ``setup`` (then kept for every later call)."""
        if self._chosen is None:
            self._chosen = fused_enabled(self.backend, device)
        return self._fused_impl if self._chosen else None

    @property
    def chosen_backend(self) -> Optional[Literal["torch", "fused"]]:
        """The code path chosen (``None`` until ``setup`` or the first call)."""
        if self._chosen is None:
            return None
        return "fused" if self._chosen else "torch"


__all__ = ["BACKENDS", "Backend", "KernelBacked", "fused_enabled"]
