"""1-bit Adam (Tang et al., ICML 2021, arXiv 2102.02888, Algorithm 1) and 0/1 Adam (Lu et al., arXiv 2202.06009).

Both rest on one observation: Adam's variance ``v`` stabilises early in training, so once it is frozen Adam is a
momentum SGD with a fixed per-coordinate preconditioner, and what the workers must agree on is linear in the
gradients: the momentum (1-bit Adam) or the accumulated update (0/1 Adam). A linear quantity tolerates a 1-bit
compressor with error feedback. The optimizers here hold the method's arithmetic; the compressed exchange is
injected (:meth:`FrozenVarianceAdam.bind`): under ``Trainer(strategy="onebit_adam")`` /
``"zero_one_adam"`` the strategy binds the two-stage compressed all-reduce of
:mod:`lightning_gradcomp.onebit_adam` and averages the gradients densely exactly on the steps
:meth:`FrozenVarianceAdam.dense_gradients` asks for. Unbound in one process (no process group), the exchange is
the identity; unbound in a distributed run (any other strategy), the first step is refused.

By default both optimizers apply Adam's bias correction, so the variance frozen after a short warm-up has Adam's
scale; where the 1-bit values divide by the frozen variance, a coordinate whose variance is below
:data:`VARIANCE_FLOOR` of its tensor's mean is raised to it (a bias that gets no gradient would otherwise turn the
reconstruction error into steps of thousands of learning rates); and the warm-up is a fraction of the run
(:data:`DEFAULT_WARMUP`, resolved at setup from the Trainer's steps). ``deepspeed_compat=True`` gives the papers'
Algorithm 1 and DeepSpeed's arithmetic instead: no bias correction, no floor (and, under the strategy, one
reconstruction scale per tensor piece). Weight decay is added to the update
(``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``, decoupled as AdamW's).
"""

import math

from collections.abc import Callable, Iterable
from typing import Any, Optional, Protocol, Union, overload

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.validation import check_bool, check_dense_steps, check_int, check_number, fraction_of_run

#: the optimizer ``state_dict`` key of the method's counters (phase, intervals)
COUNTERS_KEY = "frozen_adam"
#: the default warm-up (``freeze_step`` / ``var_freeze_step``): this fraction of the run's optimizer steps (the 1-bit
#: Adam paper warms up for 15-25 % of BERT's steps)
DEFAULT_WARMUP = 0.15
#: outside ``deepspeed_compat``, the frozen variance of a coordinate is at least this fraction of its tensor's mean
#: (a coordinate without gradient then steps at most about ``lr / sqrt(VARIANCE_FLOOR)`` = 10 ``lr`` per 1-bit value)
VARIANCE_FLOOR = 1e-2
#: the share of its scale the uncorrected variance must hold when it freezes (``1 - beta2 ** updates``)
HALF_SCALE = 0.5

#: a warm-up: a number of optimizer steps (``int``, at least 1) or a fraction of the run (``float`` in (0, 1))
Warmup = Union[int, float]


def check_warmup(name: str, value: Any) -> None:
    """Refuse a warm-up that is neither a number of steps (int >= 1) nor a fraction of the run (float in (0, 1)):
    :func:`~lightning_gradcomp.validation.check_dense_steps`, the warm-up's steps being dense ones."""
    check_dense_steps(name, value, minimum=1, fix=f"e.g. {name}={DEFAULT_WARMUP} (15 % of the run) or {name}=300 (300 "
                      f"dense steps: the variance must see a gradient before it is frozen)")


def half_scale_updates(beta2: float) -> int:
    """The fewest variance updates after which the uncorrected variance holds :data:`HALF_SCALE` of its scale."""
    if beta2 == 0.0:
        return 1
    return max(1, math.ceil(math.log(1 - HALF_SCALE) / math.log(beta2)))


class MomentumExchange(Protocol):
    """What the optimizers need of the compressed exchange (:class:`~lightning_gradcomp.onebit_adam.CompressedAllReduce`)."""

    @property
    def world_size(self) -> int: ...

    def average(self, flat: Tensor) -> Tensor:
        """The mean over ranks of ``flat`` as compressed (with error compensation), identical on every rank."""
        ...

    def reset_errors(self) -> None:
        """Zero every error-compensation buffer."""
        ...


class _Alone:
    """One process: nothing to exchange (the identity)."""

    world_size = 1

    def average(self, flat: Tensor) -> Tensor:
        return flat

    def reset_errors(self) -> None:
        pass


class FrozenVarianceAdam(torch.optim.Optimizer):
    """Shared mechanics of :class:`OneBitAdam` and :class:`ZeroOneAdam` (not used directly).

    Per parameter the state holds ``exp_avg`` (momentum ``m``) and ``exp_avg_sq`` (variance ``v``); the
    method's counters live in :attr:`counters` and travel in ``state_dict()[COUNTERS_KEY]``. A step in which no
    parameter has a gradient (the strategy dropped a non-finite step on every rank) changes nothing and
    exchanges nothing.

    In a distributed run (a process group exists) the first step refuses, before it runs anything, an optimizer
    that no exchange was bound to (:meth:`bind`): only its paired strategy (:attr:`paired_strategy`) binds one and
    averages the gradients densely exactly on the steps it asks for. Under any other strategy it would step without
    its 1-bit exchange (stock DDP: fp32 every step) or on gradients a compressor already changed (diverges).
    """

    #: the ``Trainer(strategy=...)`` whose exchange this optimizer steps with
    paired_strategy = ""

    def __init__(
        self,
        params: Union[Iterable[Tensor], Iterable[dict[str, Any]]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: Optional[bool] = None,
        deepspeed_compat: bool = False,
    ) -> None:
        check_number("lr", lr, minimum=0.0, min_open=True)
        check_bool("deepspeed_compat", deepspeed_compat)
        if bias_correction is not None:
            check_bool("bias_correction", bias_correction)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"Expected `betas` to be a pair (beta1, beta2) but got {betas!r}. Fix: e.g. betas=(0.9, 0.999).")
        for index, beta in enumerate(betas):
            # as torch's Adam: at 1 a moment never leaves its initial zero (beta1: the parameters never move)
            check_number(f"betas[{index}]", beta, minimum=0.0, maximum=1.0, max_open=True,
                         fix=f"use a decay in [0, 1), e.g. betas=(0.9, 0.999) (got betas={tuple(betas)!r})")
        check_number("eps", eps, minimum=0.0, min_open=True)
        check_number("weight_decay", weight_decay, minimum=0.0)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        #: DeepSpeed's arithmetic: no bias correction by default, no variance floor (the strategy: one scale per piece)
        self.deepspeed_compat = deepspeed_compat
        self.bias_correction = not deepspeed_compat if bias_correction is None else bias_correction
        self.exchange: MomentumExchange = _Alone()
        self._bound = False
        self.counters: dict[str, Any] = self._initial_counters()
        #: whether the latest step ran the compressed exchange (the strategy accounts its bytes)
        self.exchanged = False

    def _initial_counters(self) -> dict[str, Any]:
        return {"step": 0}

    def bind(self, exchange: MomentumExchange) -> None:
        """Exchange through ``exchange`` from now on (the strategy binds its compressed all-reduce at setup)."""
        self.exchange = exchange
        self._bound = True

    def _check_bound(self) -> None:
        """Refuse a step in a distributed run without a bound exchange (see the class docstring): the same on every
        rank, and before the closure, so no rank enters a collective the others skip."""
        if self._bound or not (dist.is_available() and dist.is_initialized()):
            return
        raise ValueError(
            f"Expected {type(self).__name__} to step under Trainer(strategy={self.paired_strategy!r}), which binds "
            f"its compressed exchange and averages the gradients on the steps it asks for, but got it unbound in a "
            f"distributed run of {dist.get_world_size()} rank(s) (another strategy: 'ddp', a GradCompStrategy, "
            f"the sharded engine, DiLoCo or Fabric). There it would send fp32 gradients every step, or step on "
            f"gradients a compressor already changed and diverge. Fix: use Trainer(strategy="
            f"{self.paired_strategy!r}) with {type(self).__name__}, or torch.optim.AdamW with this strategy."
        )

    def dense_gradients(self) -> bool:
        """Whether the next step needs the gradients averaged over ranks densely (else each rank's own)."""
        raise NotImplementedError

    @property
    def phase(self) -> str:
        """The method's phase at the next step (for logs and the monitor)."""
        raise NotImplementedError

    # -- the warm-up -----------------------------------------------------------------------------------------
    #: the name of the option that sets the warm-up (``freeze_step`` / ``var_freeze_step``)
    warmup_option = ""

    def _set_warmup(self, value: Warmup) -> None:
        check_warmup(self.warmup_option, value)
        #: the warm-up as given: a fraction of the run is kept here until :meth:`resolve_warmup`
        self.warmup_fraction: Optional[float] = value if isinstance(value, float) else None
        self._warmup: Optional[int] = value if isinstance(value, int) else None

    @property
    def warmup(self) -> int:
        """The warm-up in optimizer steps (``freeze_step`` / ``var_freeze_step``), once resolved."""
        if self._warmup is None:
            raise ValueError(
                f"Expected `{self.warmup_option}` in steps but got the fraction {self.warmup_fraction} of a run whose "
                f"length is not known. Fix: train under Trainer(strategy=...) with max_steps (or max_epochs), which "
                f"resolves it at setup, call `resolve_warmup(total_steps)`, or give `{self.warmup_option}` in steps."
            )
        return self._warmup

    def resolve_warmup(self, total_steps: int) -> int:
        """Turn a warm-up given as a fraction into steps of a run of ``total_steps`` optimizer steps (at least 1);
        a warm-up given in steps stays. Returns it."""
        if self.warmup_fraction is not None:
            self._warmup = fraction_of_run(self.warmup_fraction, total_steps)
        return self.warmup

    def variance_updates(self, total_steps: int) -> int:
        """The variance updates before the variance freezes in a run of ``total_steps`` steps."""
        raise NotImplementedError

    def compressed_steps(self, total_steps: int) -> int:
        """Steps of a run of ``total_steps`` that exchange through the 1-bit all-reduce."""
        raise NotImplementedError

    def warmup_warnings(self, total_steps: int) -> list[str]:
        """What is wrong with the (resolved) warm-up for a run of ``total_steps`` steps, with the value to use: a
        warm-up that never ends within the run, and without bias correction one that freezes the variance at less
        than :data:`HALF_SCALE` of its scale (with bias correction the frozen variance has Adam's scale whatever
        the warm-up's length, so there is nothing to warn about)."""
        name, value = self.warmup_option, self.warmup
        given = f"{name}={self.warmup_fraction} ({value} steps)" if self.warmup_fraction is not None else f"{name}={value}"
        suggested = max(1, round(DEFAULT_WARMUP * total_steps))
        out = []
        if self.compressed_steps(total_steps) == 0:
            out.append(
                f"{type(self).__name__}'s {given} is at or past the run's {total_steps} steps: no step is compressed "
                f"(every step sends fp32 gradients, as DDP). Fix: {name}={suggested} ({name}={DEFAULT_WARMUP}, "
                f"{DEFAULT_WARMUP:.0%} of the run)."
            )
        beta2 = max(group["betas"][1] for group in self.param_groups)
        updates, needed = self.variance_updates(total_steps), half_scale_updates(beta2)
        if not self.bias_correction and updates < needed and self.compressed_steps(total_steps):
            out.append(
                f"{type(self).__name__}'s {given} freezes the variance after {updates} updates: without bias "
                f"correction it then holds {1 - beta2 ** updates:.0%} of its scale (1 - {beta2} ** {updates}), and "
                f"every later step is {(1 - beta2 ** updates) ** -0.5:.1f}x Adam's. Fix: bias_correction=True (the "
                f"default), or {self._half_scale_fix(needed)}."
            )
        return out

    def _half_scale_fix(self, needed: int) -> str:
        return f"{self.warmup_option}={needed}"

    def _floor_variance(self) -> None:
        """Where the 1-bit values will divide by the frozen variance: raise each coordinate's to at least
        :data:`VARIANCE_FLOOR` of its tensor's mean (not under ``deepspeed_compat``)."""
        if self.deepspeed_compat:
            return
        for _, p in self._params():
            v = self.state[p]["exp_avg_sq"]
            torch.maximum(v, v.mean() * VARIANCE_FLOOR, out=v)

    # -- helpers -------------------------------------------------------------------------------------------
    def _state_of(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _params(self) -> list[tuple[dict[str, Any], Tensor]]:
        """Every parameter with its group, in the groups' order (the same on every rank: the flat layout)."""
        return [(group, p) for group in self.param_groups for p in group["params"]]

    @staticmethod
    def _grad(p: Tensor) -> Tensor:
        # a parameter without gradient (unused this step) contributes zeros, so the flat layout never changes
        return torch.zeros_like(p) if p.grad is None else p.grad

    def _average(self, tensors: list[Tensor]) -> list[Tensor]:
        """The exchange's mean of ``tensors`` (flattened and concatenated in order), as views in their shapes."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        mean = self.exchange.average(flat)
        self.exchanged = True
        out, offset = [], 0
        for t in tensors:
            out.append(mean[offset : offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
        return out

    def _denominator(self, group: dict[str, Any], state: dict[str, Any]) -> Tensor:
        """``sqrt(v) + eps``; with ``bias_correction``, ``v`` divided by ``1 - b2 ** (variance updates)``."""
        v = state["exp_avg_sq"]
        updates = self.counters["var_updates"]
        if self.bias_correction and updates:
            v = v / (1 - group["betas"][1] ** updates)
        return v.sqrt() + group["eps"]

    def _momentum_correction(self, group: dict[str, Any]) -> float:
        """``1 - b1 ** step`` with ``bias_correction`` (Adam's), else 1."""
        return 1 - group["betas"][0] ** self.counters["step"] if self.bias_correction else 1.0

    def _apply(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        """``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)`` (``m``, ``v`` bias-corrected if asked)."""
        m = state["exp_avg"]
        if self.bias_correction:
            m = m / self._momentum_correction(group)
        update = m / self._denominator(group, state)
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    # -- the step ------------------------------------------------------------------------------------------
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    @override
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step of the method; a no-op (counters included) when no parameter has a gradient."""
        self._check_bound()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.exchanged = False
        if all(p.grad is None for _, p in self._params()):
            return loss
        self.counters["step"] += 1
        self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    # -- checkpoint ----------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out[COUNTERS_KEY] = {k: list(v) if isinstance(v, list) else v for k, v in self.counters.items()}
        return out

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        counters = state_dict.pop(COUNTERS_KEY, None)
        super().load_state_dict(state_dict)
        if counters is not None:
            self.counters = {k: list(v) if isinstance(v, list) else v for k, v in counters.items()}


class OneBitAdam(FrozenVarianceAdam):
    """1-bit Adam (Tang et al., ICML 2021, Algorithm 1): dense Adam for ``freeze_step`` steps, then the variance
    is frozen and every step exchanges the momentum compressed to one bit per element, with error compensation
    on the worker and on the server side.

    Warm-up (steps ``1 .. freeze_step``): the strategy averages the gradient ``g`` densely;
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``. Compressed phase: each rank forms
    ``m_i = b1 m + (1 - b1) g_i`` from its own gradient and ``m`` becomes the compressed average of the ``m_i``;
    ``v`` stays as it was at ``freeze_step``. Every step: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(b1, b2)``, Adam's momentum and variance decay.
        eps: added to ``sqrt(v)``.
        weight_decay: added to the update times the parameter (as DeepSpeed's ``OnebitAdam``).
        freeze_step: dense warm-up steps before the variance freezes: a number of steps (int), or a fraction of
            the run's optimizer steps (float in (0, 1), resolved at setup from ``Trainer(max_steps=...)`` or
            ``max_epochs``). Default :data:`DEFAULT_WARMUP` (15 %; the paper warms up for 15-25 % of BERT's steps).
        bias_correction: divide ``m`` by ``1 - b1 ** step`` and ``v`` by ``1 - b2 ** (variance updates)`` in the
            update, as Adam does. Default ``True`` (``False`` under ``deepspeed_compat``: the paper's Algorithm 1
            and DeepSpeed had none). Uncorrected, a short warm-up freezes a ``v`` that is still far below its scale
            (``1 - 0.999 ** 300 = 26 %``) and every later step is ``1 / sqrt`` of that larger than Adam's.
        deepspeed_compat: DeepSpeed's arithmetic, for migrating a DeepSpeed run: ``bias_correction`` defaults to
            ``False``, no variance floor, and under ``strategy="onebit_adam"`` one pair of reconstruction values
            per tensor piece (``scale_block=None``). Diverges on a parameter that gets no gradient (a bias of a
            dead unit, a fused query-key-value bias).
    """

    paired_strategy = "onebit_adam"
    warmup_option = "freeze_step"

    def __init__(
        self,
        params: Union[Iterable[Tensor], Iterable[dict[str, Any]]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: Warmup = DEFAULT_WARMUP,
        bias_correction: Optional[bool] = None,
        deepspeed_compat: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction, deepspeed_compat)
        self._set_warmup(freeze_step)

    @property
    def freeze_step(self) -> int:
        """The dense warm-up in steps (a fraction given is resolved at setup)."""
        return self.warmup

    @override
    def variance_updates(self, total_steps: int) -> int:
        return min(total_steps, self.warmup)

    @override
    def compressed_steps(self, total_steps: int) -> int:
        return max(0, total_steps - self.warmup)

    @override
    def _initial_counters(self) -> dict[str, Any]:
        return {"step": 0, "frozen": False, "var_updates": 0}

    @override
    def dense_gradients(self) -> bool:
        return not self.counters["frozen"]

    @property
    @override
    def phase(self) -> str:
        return "compressed" if self.counters["frozen"] else "warmup"

    @override
    def _step(self) -> None:
        frozen = self.counters["frozen"]
        params = self._params()
        if not frozen:
            self.counters["var_updates"] += 1
        for group, p in params:
            state = self._state_of(p)
            b1, b2 = group["betas"]
            g = self._grad(p)
            state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            if not frozen:
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        if frozen:
            momenta = [self.state[p]["exp_avg"] for _, p in params]
            for m, mean in zip(momenta, self._average(momenta)):
                m.copy_(mean)
        for group, p in params:
            self._apply(group, p, self.state[p])
        if not frozen and self.counters["step"] >= self.freeze_step:
            self.counters["frozen"] = True
            self._floor_variance()


class ZeroOneAdam(FrozenVarianceAdam):
    """0/1 Adam (Lu et al., 2022): adaptive variance freezing and local steps between 1-bit synchronisations.

    Variance phase (steps ``1 .. var_freeze_step``): ``v`` is updated only at steps that are multiples of an
    interval that starts at 1 and doubles after every ``var_update_scaler`` updates; on those steps the gradient
    is averaged densely and ``m``, ``v`` updated from it. On the others each rank's gradient is averaged by the
    1-bit compressed all-reduce (error compensated) and only ``m`` is updated. After ``var_freeze_step`` the
    variance is frozen, the error buffers reset, and each rank takes local Adam steps from its own gradients; every
    ``local_interval`` steps (1 at first, doubled every ``local_step_scaler`` steps up to ``local_step_clipper``)
    the ranks average their accumulated updates (in momentum units, ``(p - p_sync) * (sqrt(v) + eps)``) by the
    1-bit compressed all-reduce, restart from the last synchronised weights plus that mean, and set ``m`` to the
    learning-rate-weighted mean momentum it implies (``-mean / sum(lr)``). Replicas are identical after every
    synchronisation and differ in between.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(b1, b2)``.
        eps: added to ``sqrt(v)``.
        weight_decay: added to the update times the parameter.
        var_freeze_step: the step after which the variance is frozen: steps (int) or a fraction of the run (float
            in (0, 1), resolved at setup as :class:`OneBitAdam`'s ``freeze_step``). Default :data:`DEFAULT_WARMUP`.
        var_update_scaler: variance updates per interval before the interval doubles (16).
        local_step_scaler: steps per local-step interval before the interval doubles (DeepSpeed's 32678).
        local_step_clipper: the longest local-step interval (16).
        bias_correction: as :class:`OneBitAdam`'s (the variance's count is its updates).
        deepspeed_compat: as :class:`OneBitAdam`'s.
    """

    paired_strategy = "zero_one_adam"
    warmup_option = "var_freeze_step"

    def __init__(
        self,
        params: Union[Iterable[Tensor], Iterable[dict[str, Any]]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: Warmup = DEFAULT_WARMUP,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        bias_correction: Optional[bool] = None,
        deepspeed_compat: bool = False,
    ) -> None:
        check_warmup("var_freeze_step", var_freeze_step)
        check_int("var_update_scaler", var_update_scaler, minimum=1, fix="use the variance updates per interval (16)")
        check_int("local_step_scaler", local_step_scaler, minimum=1, fix="use the steps per local-step interval")
        check_int("local_step_clipper", local_step_clipper, minimum=1, fix="use the longest local-step interval (16)")
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction, deepspeed_compat)
        self._set_warmup(var_freeze_step)
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    @property
    def var_freeze_step(self) -> int:
        """The step after which the variance freezes (a fraction given is resolved at setup)."""
        return self.warmup

    def _variance_phase(self, steps: int) -> int:
        """The variance updates among the first ``steps`` steps (every step until ``var_update_scaler`` updates,
        then every 2nd, 4th, ... step, as :meth:`_step` counts them)."""
        updates, interval, last = 0, 1, 0
        while True:
            first = (last // interval + 1) * interval
            end = first + (self.var_update_scaler - 1) * interval
            if end >= steps:
                return updates + (max(0, steps - first) // interval + 1 if steps >= first else 0)
            updates, last, interval = updates + self.var_update_scaler, end, interval * 2

    @override
    def variance_updates(self, total_steps: int) -> int:
        # the variance phase ends with step var_freeze_step + 1
        return self._variance_phase(min(total_steps, self.warmup + 1))

    @override
    def compressed_steps(self, total_steps: int) -> int:
        # every step of the variance phase without variance update averages 1-bit gradients; every local step is
        # synchronised at first (local_interval 1)
        return total_steps - self.variance_updates(total_steps)

    @override
    def _half_scale_fix(self, needed: int) -> str:
        return f"var_update_scaler={needed} with var_freeze_step={needed}"

    @override
    def _initial_counters(self) -> dict[str, Any]:
        return {"step": 0, "var_frozen": False, "var_updates": 0, "var_interval": 1, "var_counter": 0, "local_interval": 1,
                "local_counter": 0, "lrs": [0.0] * len(self.param_groups)}

    @override
    def dense_gradients(self) -> bool:
        c = self.counters
        return not c["var_frozen"] and (c["step"] + 1) % c["var_interval"] == 0

    @property
    @override
    def phase(self) -> str:
        return "local" if self.counters["var_frozen"] else "variance"

    def in_sync(self) -> bool:
        """Whether every rank holds the same weights now (always before the variance freezes; after it, right
        after a synchronisation)."""
        c = self.counters
        return not c["var_frozen"] or not any(c["lrs"])

    @override
    def _step(self) -> None:
        c = self.counters
        t = c["step"]
        params = self._params()
        if not c["var_frozen"]:
            dense = t % c["var_interval"] == 0
            c["var_updates"] += dense
            grads = [self._grad(p) for _, p in params]
            if not dense:
                grads = self._average(grads)
            for (group, p), g in zip(params, grads):
                state = self._state_of(p)
                b1, b2 = group["betas"]
                if dense:
                    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                self._apply(group, p, state)
            if dense:
                c["var_counter"] += 1
                if c["var_counter"] == self.var_update_scaler:
                    c["var_counter"] = 0
                    c["var_interval"] *= 2
            if t > self.var_freeze_step:
                # the replicas are identical here (every update so far was averaged): the first synchronised point
                c["var_frozen"] = True
                self._floor_variance()
                self.exchange.reset_errors()
                for _, p in params:
                    self.state[p]["anchor"] = p.detach().clone()
            return
        for index, group in enumerate(self.param_groups):
            c["lrs"][index] += group["lr"]
        for group, p in params:
            state = self._state_of(p)
            b1, _ = group["betas"]
            state["exp_avg"].mul_(b1).add_(self._grad(p), alpha=1 - b1)
            self._apply(group, p, state)
        if t % c["local_interval"] == 0:
            self._synchronise(params)
        c["local_counter"] += 1
        if c["local_counter"] == self.local_step_scaler:
            c["local_counter"] = 0
            c["local_interval"] = min(self.local_step_clipper, c["local_interval"] * 2)

    @torch.no_grad()
    def synchronise(self) -> bool:
        """Synchronise now if the ranks are apart (local steps since the last synchronisation), as the next scheduled
        synchronisation would: every rank then holds the same weights and momentum. The strategy calls it on every
        rank when ``fit`` ends between two synchronisations; the schedule's counters are unchanged.

        Returns:
            Whether it exchanged (``False``: already in sync).
        """
        self.exchanged = False
        if self.in_sync():
            return False
        self._synchronise(self._params())
        return True

    def _synchronise(self, params: list[tuple[dict[str, Any], Tensor]]) -> None:
        """Average the updates accumulated since the last synchronisation (1-bit) and restart from it.

        DeepSpeed accumulates ``-lr * update`` in a buffer and subtracts it from the weights; here the weights of
        the last synchronisation are kept instead (``anchor``), so every rank restarts from the same bits (a sum
        subtracted again would leave each rank its own rounding)."""
        c = self.counters
        lrs = {id(group): c["lrs"][i] for i, group in enumerate(self.param_groups)}
        deltas = []
        for group, p in params:
            state = self.state[p]
            deltas.append((p - state["anchor"]).mul_(self._denominator(group, state)))
        for (group, p), mean in zip(params, self._average(deltas)):
            state = self.state[p]
            p.copy_(state["anchor"] + mean / self._denominator(group, state))
            state["anchor"].copy_(p)
            # the mean momentum the update implies (uncorrected, as ``m`` is kept)
            state["exp_avg"].copy_(mean).div_(-lrs[id(group)]).mul_(self._momentum_correction(group))
        c["lrs"] = [0.0] * len(self.param_groups)
