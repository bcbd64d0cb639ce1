"""DGC's momentum correction (Lin et al., ICLR 2018) as a pipeline callback.

Per worker k and layer, inside the hook, before compression::

    u <- m * u + g          (Nesterov: u <- m * (u + g), and v accumulates u + g)
    v <- v + u              v is the compressor's error-feedback residual: the hook adds it, the
    send compress(v)        compressor sends part of it, and what was not sent stays in it
    u <- 0 where sent       momentum factor masking (on by default)

so that the sum of the sparse updates follows the same momentum as dense momentum SGD would. The optimizer's
own momentum must then be 0 (it would apply momentum twice): :class:`MomentumCorrection` checks that before
the first step and says how to configure it.

Masking clears u only where a sparsifying compressor sent values. A tensor sent whole (fp32 layers, dense
warm-up steps, quantizers that send every element) keeps its momentum, as DGC's code does for the tensors it
does not compress; so with compression off, ``MomentumCorrection(m)`` + ``SGD(momentum=0)`` is exactly
``SGD(momentum=m)``. (DGC's code at ratio 1 would clear u everywhere; that is not momentum any more.)

Weight decay stays out of the compressed gradient, as in DGC's ``DGCSGD``: after the exchange, every rank
adds ``buf <- m * buf + wd * p`` (its own momentum buffer, identical on every rank) to the averaged gradient.
"""

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.exchange.host import HookHost
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.validation import check_number


class MomentumCorrect(LayerTransform):
    """The per-layer momentum u of one worker, applied before compression and masked after it.

    Args:
        momentum: m.
        nesterov: DGC's Nesterov form (``u = m * (u + g)``, send ``u + g``).
        masking: clear u where a sparsifying compressor sent values.
    """

    applies_to_float = True

    def __init__(self, momentum: float, nesterov: bool = False, masking: bool = True) -> None:
        self.momentum = momentum
        self.nesterov = nesterov
        self.masking = masking
        #: per-layer momentum u of this rank, by parameter name
        self.u: dict[str, Tensor] = {}

    @override
    def before_compress(self, grad: Tensor, name: str) -> Tensor:
        u = self.u.get(name)
        if u is None:
            u = torch.zeros_like(grad)
        if self.nesterov:
            u = (u + grad) * self.momentum
            self.u[name] = u
            return u + grad
        u = u * self.momentum + grad
        self.u[name] = u
        return u.clone()  # the compressor's payload may alias its input; u is replaced after sending

    @override
    def after_compress(self, name: str, compressed_input: Tensor, sent: Tensor) -> None:
        if not self.masking:
            return
        sent_mask = (sent != 0) | (compressed_input == 0)
        # no host sync: keep u everywhere when the whole tensor went out, else keep it only where nothing was sent
        keep = ~sent_mask | sent_mask.all()
        self.u[name] = self.u[name] * keep

    @override
    def state_dict(self) -> dict[str, Any]:
        return {name: u.detach().cpu().clone() for name, u in self.u.items()}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.u = dict(state)


class MomentumCorrection(PipelineCallback):
    """Momentum correction and momentum factor masking (DGC) for any compressor of a ``GradCompStrategy``.

    Configure the optimizer without momentum and without weight decay; give both to this callback::

        Trainer(strategy="dgc", callbacks=[MomentumCorrection(momentum=0.9, weight_decay=1e-4)])
        # with configure_optimizers returning SGD(params, lr=..., momentum=0, weight_decay=0)

    Args:
        momentum: m (DGC: 0.9).
        nesterov: DGC's Nesterov momentum.
        masking: momentum factor masking (DGC's default: on).
        weight_decay: applied after the exchange on every rank with its own momentum buffer (DGC's ``DGCSGD``).
    """

    def __init__(self, momentum: float = 0.9, nesterov: bool = False, masking: bool = True,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        check_number("momentum", momentum, minimum=0.0, maximum=1.0, max_open=True, fix="use 0.9 (DGC)")
        check_number("weight_decay", weight_decay, minimum=0.0, fix="use 1e-4 (DGC's CIFAR/ImageNet) or 0")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.masking = bool(masking)
        self.weight_decay = float(weight_decay)
        self._decay_buffers: dict[torch.nn.Parameter, Tensor] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: dict[str, Tensor] = {}

    @override
    def make_transform(self, strategy: HookHost) -> LayerTransform:
        return MomentumCorrect(self.momentum, self.nesterov, self.masking)

    @staticmethod
    def check_optimizers(optimizers: list[torch.optim.Optimizer], momentum: float) -> None:
        """Raise ``ValueError`` if an optimizer applies momentum or weight decay of its own."""
        for optimizer in optimizers:
            for index, group in enumerate(optimizer.param_groups):
                own = group.get("momentum", 0.0)
                betas = tuple(group.get("betas") or ())  # Adam's (beta1, beta2); () for optimizers without
                if own or (betas and betas[0]):
                    value = f"momentum={own}" if own else f"betas={betas}"
                    raise ValueError(
                        f"Expected the optimizer's own momentum to be 0 with MomentumCorrection (it applies the "
                        f"momentum before compression, so a second one would apply it twice), but param group {index} "
                        f"of {type(optimizer).__name__} has {value}. Fix: configure "
                        f"`torch.optim.SGD(params, lr=..., momentum=0)` and `MomentumCorrection(momentum={own or momentum})`."
                    )
                if group.get("weight_decay", 0.0):
                    raise ValueError(
                        f"Expected the optimizer's `weight_decay` to be 0 with MomentumCorrection, but param group "
                        f"{index} of {type(optimizer).__name__} has weight_decay={group['weight_decay']}. Fix: pass it to "
                        f"`MomentumCorrection(weight_decay={group['weight_decay']})`, which applies it with its own "
                        f"momentum as DGC's optimizer does."
                    )

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.check_optimizers(trainer.optimizers, self.momentum)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.weight_decay:
            return
        self._optimizer = optimizer
        if self._pending:  # restored from a checkpoint: attach to this optimizer's parameters
            for key, (_, p) in self._indexed(optimizer).items():
                if key in self._pending:
                    self._decay_buffers[p] = self._pending[key].to(p.device)
            self._pending = {}
        # the parameters are identical on every rank, so are these buffers: replicas cannot diverge
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    buf = self._decay_buffers.get(p)
                    decay = p * self.weight_decay
                    buf = decay.clone() if buf is None else buf.mul_(self.momentum).add_(decay)
                    self._decay_buffers[p] = buf
                    p.grad.add_(decay + buf * self.momentum if self.nesterov else buf)

    @staticmethod
    def _indexed(optimizer: torch.optim.Optimizer) -> dict[str, tuple[int, torch.nn.Parameter]]:
        return {f"{g}.{i}": (g, p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}

    @override
    def state_dict(self) -> dict[str, Any]:
        # the weight-decay buffers depend only on the parameters, identical on every rank: rank 0's copy suffices
        if self._optimizer is None:
            return {"decay_buffers": dict(self._pending)}
        return {"decay_buffers": {key: self._decay_buffers[p].detach().cpu().clone()
                                  for key, (_, p) in self._indexed(self._optimizer).items() if p in self._decay_buffers}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = dict(state_dict.get("decay_buffers", {}))
        self._decay_buffers = {}
