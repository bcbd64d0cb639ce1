"""The ``backend=`` option of the compressors with fused kernels (TernGrad, Gradient Dropping, AdaComp).

Such a compressor runs its own torch ops (the reference), a fused implementation built on
:mod:`lightning_gradcomp.kernels` (compiled on a CPU), or Triton's kernels (CUDA). It decides once which, in one
place (:meth:`~lightning_gradcomp.compressors.base.Compressor.kernels`), when it learns the device its gradients live
on: in :meth:`~lightning_gradcomp.compressors.base.Compressor.setup`, or at its first call when it is used without
``setup``. A fused implementation takes the tensors and settings it needs, never the compressor itself, so each
compressor module imports its fused module and not the other way round.
"""

from typing import Generic, Literal, Optional, TypeVar

import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Compressor, Kernels

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
    their methods then ask :meth:`_kernels` for it, which answers ``None`` when the torch ops or Triton's kernels run.
    """

    #: ``"auto"``, ``"torch"`` or ``"fused"`` (see :func:`fused_enabled`); read when the kernels are chosen
    backend: str

    def _offer_kernels(self, fused: F) -> None:
        self._fused_impl = fused

    def _choose_kernels(self, device: torch.device) -> Kernels:
        """Triton's kernels where they run (:attr:`triton`), else the fused implementation where :attr:`backend`
        enables it on ``device``, else the torch ops."""
        chosen = super()._choose_kernels(device)
        return "fused" if chosen == "torch" and fused_enabled(self.backend, device) else chosen

    def _torch_ops_form(self) -> bool:
        """Whether the groups run in a form without the compiled kernels (torch ops or Triton): as chosen, or, before
        the choice, as the ``backend=`` option says."""
        chosen = self._kernels_chosen
        return self.backend == "torch" if chosen is None else chosen != "fused"

    def _kernels(self, device: torch.device) -> Optional[F]:
        """The fused implementation when it runs the groups (:meth:`kernels`), else ``None``."""
        return self._fused_impl if self.kernels(device) == "fused" else None

    @property
    def chosen_backend(self) -> Optional[Literal["torch", "fused"]]:
        """The ``backend=`` path chosen (``None`` until ``setup`` or the first call): ``"fused"`` when the fused
        implementation runs, else ``"torch"`` (torch ops or Triton's kernels)."""
        if self._kernels_chosen is None:
            return None
        return "fused" if self._kernels_chosen == "fused" else "torch"


__all__ = ["BACKENDS", "Backend", "KernelBacked", "fused_enabled"]
