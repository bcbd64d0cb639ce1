"""Error feedback: what a compressor did not send is kept per rank, by parameter name, and added back.

One mechanism for every compressor with ``uses_memory``: before compression ``x = grad + residual``;
after it ``residual = x - sent``, where ``sent`` is this rank's own packet decoded. So
``grad + old residual == sent + new residual`` holds by construction (with a ``decay`` below 1:
``grad + decay * old residual == sent + new residual``).
"""

from collections.abc import Iterator, MutableMapping
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_gradcomp.flat import Segments


class ResidualMemory:
    """Per-rank residuals keyed by parameter name (never by bucket index: DDP rebuilds buckets).

    The hook's batched pipeline keeps the residuals of a group of layers in one flat tensor keyed by the names it
    holds (:meth:`compensate_flat`, :meth:`update_flat`): one add and one subtract per group, whatever the number of
    layers. When DDP rebuilds its buckets and a group's names change, the next :meth:`compensate_flat` lays the
    residuals out anew (values unchanged). Per name they are always reachable through :attr:`residuals`, and the
    checkpoint holds one tensor per name, whatever the layout.

    Args:
        storage: where residuals are kept (``None``: beside the gradient). ``torch.device("cpu")`` keeps them off
            the accelerator (DiLoCo's outer error feedback, which holds a full model's worth of values).
        decay: the factor on the residual added back (1: plain error feedback). Below 1 for pseudo-gradients
            (SparseLoCo's ``beta``): a site re-derives its unsent progress from the same anchor every round, so a
            residual that never fades counts that progress again and again.
    """

    def __init__(self, storage: Optional[torch.device] = None, decay: float = 1.0) -> None:
        self._single: dict[str, Tensor] = {}
        self._flat: dict[tuple[str, ...], tuple[Segments, Tensor]] = {}
        self._owner: dict[str, tuple[str, ...]] = {}
        self.storage = storage
        self.decay = decay
        # the step's transaction: what this step replaced (``None``: had none), by name or by a flat group's names,
        # for :meth:`rollback`; ``None`` when the step keeps no undo (a step that cannot be skipped)
        self._undo: Optional[dict[Union[str, tuple[str, ...]], Any]] = None

    @property
    def residuals(self) -> "MutableMapping[str, Tensor]":
        """Every residual by parameter name (a flat group's as views of its flat tensor); assigning one sets it."""
        return _ByName(self)

    def begin_step(self, keep_undo: bool = True) -> None:
        """Open a step: forget the previous step's undo; keep this step's if it may be rolled back."""
        self._undo = {} if keep_undo else None

    def rollback(self) -> None:
        """Put back every residual this step replaced (a step skipped on every rank), then close the step."""
        for key, old in (self._undo or {}).items():
            if isinstance(key, str):
                if old is None:
                    self._single.pop(key, None)
                else:
                    self._single[key] = old
            else:
                self._drop_flat(key)  # what the group holds now is this step's
                if old is not None:
                    self._flat[key] = old
                    for name in key:
                        self._owner[name] = key
        self._undo = None

    def _scaled(self, residual: Tensor, device: torch.device) -> Tensor:
        residual = residual.to(device, non_blocking=True)
        return residual if self.decay == 1.0 else self.decay * residual

    # -- one parameter -----------------------------------------------------------------------------------------
    def compensate(self, grad: Tensor, name: str) -> Tensor:
        """The gradient plus the residual left from earlier steps (a new tensor; ``grad`` is not modified)."""
        self._release(name)
        residual = self._single.get(name)
        if residual is None:
            return grad.clone()
        return grad + self._scaled(residual, grad.device)

    def update(self, name: str, compensated: Tensor, sent: Tensor) -> None:
        """Keep what ``sent`` did not carry of ``compensated``."""
        self._release(name)
        if self._undo is not None and name not in self._undo:
            self._undo[name] = self._single.get(name)
        residual = compensated - sent
        self._single[name] = residual if self.storage is None else residual.to(self.storage)

    # -- a group of layers in one flat tensor ------------------------------------------------------------------
    def compensate_flat(self, flat: Tensor, segments: Segments) -> Tensor:
        """:meth:`compensate` for a group laid out as ``segments`` in ``flat`` (a new flat tensor)."""
        key = segments.names
        if key not in self._flat:
            self._lay_out(segments, flat)
        entry = self._flat.get(key)
        if entry is None:
            return flat.clone()
        return flat + self._scaled(entry[1], flat.device)

    def update_flat(self, segments: Segments, compensated: Tensor, sent: Tensor) -> None:
        """:meth:`update` for a group: one flat residual ``compensated - sent``."""
        key = segments.names
        if key not in self._flat:
            self._lay_out(segments, compensated)
        if self._undo is not None and key not in self._undo:
            self._undo[key] = self._flat.get(key)
        residual = compensated - sent
        self._flat[key] = (segments, residual if self.storage is None else residual.to(self.storage))
        for name in key:
            self._owner[name] = key

    def _lay_out(self, segments: Segments, like: Tensor) -> None:
        """Gather the residuals of ``segments``' names, held singly or in other groups, into one flat tensor (no
        value changes: a new bucket layout). Nothing is made when none of them has a residual yet."""
        names = segments.names
        for name in names:
            self._release(name)
        if not any(n in self._single for n in names):
            return
        target = like.device if self.storage is None else self.storage
        flat = torch.zeros(segments.total, dtype=like.dtype, device=target)
        for name, view in segments.items(flat):
            old = self._single.pop(name, None)
            if old is not None:
                view.copy_(old.reshape(view.shape))
        self._flat[names] = (segments, flat)
        for name in names:
            self._owner[name] = names

    def _release(self, name: str) -> None:
        """Hold ``name``'s group's residuals singly again (as clones: the group's flat tensor is dropped)."""
        key = self._owner.get(name)
        if key is not None:
            segments, flat = self._flat[key]
            for n, view in segments.items(flat):
                self._single[n] = view.clone()
            self._drop_flat(key)

    def _drop_flat(self, key: tuple[str, ...]) -> None:
        self._flat.pop(key, None)
        for name in key:
            if self._owner.get(name) == key:
                del self._owner[name]

    def _get(self, name: str) -> Optional[Tensor]:
        key = self._owner.get(name)
        if key is None:
            return self._single.get(name)
        segments, flat = self._flat[key]
        i = segments.position[name]  # a dict: state_dict reads every name, a list search would be quadratic
        return flat[segments.offsets[i] : segments.offsets[i + 1]].view(segments.shapes[i])

    def _names(self) -> list[str]:
        return list(self._single) + list(self._owner)

    def norm(self, name: str) -> Tensor:
        """L2 norm of a residual (0 when none); a 0-d tensor, no host sync."""
        residual = self._get(name)
        return torch.zeros(()) if residual is None else residual.norm()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._names():
            residual = self._get(name)
            assert residual is not None
            out[name] = residual.detach().cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        target = device if self.storage is None else self.storage
        self._flat.clear()
        self._owner.clear()
        self._single = {name: r.to(target) for name, r in state.items()}


class _ByName(MutableMapping[str, Tensor]):
    """:attr:`ResidualMemory.residuals`: the residuals by name, whatever their layout."""

    def __init__(self, memory: ResidualMemory) -> None:
        self._memory = memory

    def __getitem__(self, name: str) -> Tensor:
        residual = self._memory._get(name)
        if residual is None:
            raise KeyError(name)
        return residual

    def __setitem__(self, name: str, residual: Tensor) -> None:
        self._memory._release(name)
        self._memory._single[name] = residual

    def __delitem__(self, name: str) -> None:
        self._memory._release(name)
        del self._memory._single[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._memory._names())

    def __len__(self) -> int:
        return len(self._memory._names())
