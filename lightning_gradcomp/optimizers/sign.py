"""SignSGD: the sign update DeMo prescribes."""

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union, overload

import torch
from torch import Tensor

from lightning_gradcomp.validation import check_number


class SignSGD(torch.optim.Optimizer):
    """``p <- p * (1 - lr * weight_decay) - lr * sign(grad)``: DeMo's update (arXiv 2411.19870, Alg. 1).

    DeMo's reference optimizer applies decoupled weight decay, then SGD on the sign of the decoded,
    averaged momentum components; with :class:`~lightning_gradcomp.compressors.demo.DeMo` as the strategy's
    compressor this optimizer completes the method. torch has no sign-based optimizer, hence this one.

    Unlike :class:`~lightning_gradcomp.optimizers.OneBitAdam`, it needs no exchange of its own, so any strategy may
    step it: on the gradient another strategy averaged it is signSGD (Bernstein et al., 2018), a method of its own,
    and neither refused nor warned about. The pairing is checked from DeMo's side only: DeMo with another optimizer
    warns at setup (:meth:`~lightning_gradcomp.compressors.demo.DeMo.check_optimizers`).

    Args:
        params: parameters or parameter groups.
        lr: step size (each coordinate moves by exactly ``lr``).
        weight_decay: decoupled decay coefficient (multiplied by ``lr``, as AdamW's).
    """

    def __init__(self, params: Union[Iterable[Tensor], Iterable[dict[str, Any]]], lr: float = 1e-3,
                 weight_decay: float = 0.0) -> None:
        check_number("lr", lr, minimum=0.0, min_open=True)
        check_number("weight_decay", weight_decay, minimum=0.0)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["weight_decay"]:
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return loss
