"""The kernel provider: which kernels run a compressor's group code, chosen once per device.

A compressor with kernels of its own (TernGrad, Gradient Dropping, AdaComp, top-k and DGC) declares, per family, one
small protocol with the operations its group step needs (encode, decode-and-average, ...) and one class per kernel
set that implements it: its torch ops, the compiled CPU kernels (``"fused"``, :mod:`lightning_gradcomp.kernels`), or
Triton's (CUDA). :func:`choose_kernels` is the one rule that picks the set for a device; the compressor makes its
provider once (:meth:`KernelBacked.kernels`: in ``setup``, or at the first call without ``setup``) and its call
sites call the provider's operations with no test of which set runs. A new kernel set is a new provider class.

A provider takes the tensors and settings it needs, never reaching into the compressor's private state beyond what
its family's group code hands it, so a compressor module imports its provider module and not the other way round.
"""

from collections.abc import Mapping
from typing import Any, Generic, Literal, Optional, Protocol, TypeVar

import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.kernels import triton_launch

Backend = Literal["auto", "torch", "fused"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "fused")

#: the kernel sets that run a compressor's group code: its torch ops, the compiled CPU kernels, or Triton's
Kernels = Literal["torch", "fused", "triton"]


class Provider(Protocol):
    """What every family's provider declares: the kernel set it runs."""

    @property
    def name(self) -> str:
        """``"torch"``, ``"fused"`` or ``"triton"``."""
        ...


P = TypeVar("P", bound=Provider)


def fused_enabled(backend: str, device: torch.device) -> bool:
    """Whether a compressor with this ``backend`` takes the fused path for tensors on ``device``.

    ``"auto"`` is fused on CPU when the compiled kernels load here; ``"fused"`` is fused everywhere (torch-ops
    kernels off CPU or without a compiler); ``"torch"`` never.
    """
    if backend != "auto":
        return backend == "fused"
    return device.type == "cpu" and kernels.fused_available()


def choose_kernels(backend: str, triton: Optional[bool], device: torch.device) -> Kernels:
    """The kernels that run a group on ``device``: Triton's where ``triton`` says so (``None``: CUDA with Triton
    importable), else the compiled ones where ``backend`` enables them (:func:`fused_enabled`), else the torch ops."""
    if triton_launch.usable(device) if triton is None else triton:
        return "triton"
    return "fused" if fused_enabled(backend, device) else "torch"


class KernelBacked(Compressor, Generic[P]):
    """A compressor whose group code runs on a provider of type ``P`` (see the module docstring).

    Subclasses set :attr:`providers` (one provider class per kernel set) and, with a ``backend=`` option,
    :attr:`backend`; their group methods call ``self.kernels(device).<operation>(...)``.
    """

    #: the provider class of each kernel set, made with the compressor as its one argument
    providers: Mapping[Kernels, Any]
    #: ``"auto"``, ``"torch"`` or ``"fused"`` (see :func:`fused_enabled`); read when the kernels are chosen. A
    #: compressor without compiled kernels keeps ``"torch"``
    backend: str = "torch"
    #: whether the Triton kernels run: ``None`` chooses by device (CUDA with Triton importable,
    #: :func:`~lightning_gradcomp.kernels.triton_launch.usable`); ``True`` forces them (on CPU tensors they need
    #: ``TRITON_INTERPRET=1``: the tests); ``False`` never. Read when the kernels are chosen
    triton: Optional[bool] = None
    _provider: Optional[P] = None

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._choose(device)

    def _choose(self, device: torch.device) -> P:
        name = choose_kernels(self.backend, self.triton, device)
        provider: P = self.providers[name](self._provider_input())
        self._provider = provider
        return provider

    def _provider_input(self) -> Any:
        """What a provider is made with: the compressor (a family may hand its group code instead)."""
        return self

    def kernels(self, device: torch.device) -> P:
        """The provider that runs the groups: chosen once in :meth:`setup` for its device, or at the first group call
        for ``device`` when this compressor is used without ``setup`` (then kept until ``setup``)."""
        provider = self._provider
        return self._choose(device) if provider is None else provider

    def _torch_ops_form(self) -> bool:
        """Whether the groups run in a form without the compiled kernels (torch ops or Triton): as chosen, or, before
        the choice, as the ``backend=`` option says."""
        provider = self._provider
        return self.backend == "torch" if provider is None else provider.name != "fused"

    @property
    def chosen_backend(self) -> Optional[Literal["torch", "fused"]]:
        """The ``backend=`` path chosen (``None`` until ``setup`` or the first call): ``"fused"`` when the compiled
        kernels run, else ``"torch"`` (torch ops or Triton's kernels)."""
        provider = self._provider
        if provider is None:
            return None
        return "fused" if provider.name == "fused" else "torch"


__all__ = ["BACKENDS", "Backend", "KernelBacked", "Kernels", "Provider", "choose_kernels", "fused_enabled"]
