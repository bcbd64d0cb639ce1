"""``OneBitAdamStrategy`` (``strategy="onebit_adam"``) and ``ZeroOneAdamStrategy`` (``"zero_one_adam"``).

DDP with the gradcomp hook, whose gradient exchange follows the optimizer's phase: on the steps where
:meth:`~lightning_gradcomp.optimizers.frozen_adam.FrozenVarianceAdam.dense_gradients` asks for it (1-bit Adam's
warm-up, 0/1 Adam's variance updates) the hook averages the gradients in fp32 exactly as ``strategy="fp32"``; on
the others it leaves each rank its own gradient (no gradient collective; the non-finite guard's 4-byte flag
still runs, so a NaN on one rank skips or raises on every rank alike), and the optimizer exchanges the momentum
or the accumulated update through :class:`~lightning_gradcomp.onebit_adam.exchange.CompressedAllReduce` inside
its step. The optimizer's phase counters are identical on every rank, so every rank takes the same path.
"""

import inspect
import logging
import math
import warnings
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.exchange import comm
from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.exchange.groups import LayerViews, layer_offsets
from lightning_gradcomp.exchange.guard import begin_step, bucket_is_nonfinite
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.exchange.ledger import GroupRecord
from lightning_gradcomp.onebit_adam.exchange import CompressedAllReduce
from lightning_gradcomp.optimizers.frozen_adam import FrozenVarianceAdam, OneBitAdam, ZeroOneAdam
from lightning_gradcomp.strategies.final_sync import FinalSynchronisation
from lightning_gradcomp.strategies.replicas import check_replicas
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.strategies.strategy import GradCompStrategy
from lightning_gradcomp.validation import check_int, resolve_dense_steps, run_steps

log = logging.getLogger(__name__)

#: key of the per-rank state in ``GradCompState.extra`` (and the checkpoint)
LINK_KEY = "frozen_adam"
#: the step after which the variance freezes, under each optimizer's name for it
_FREEZE_EQUIVALENT = {"freeze_step": "var_freeze_step", "var_freeze_step": "freeze_step"}
#: elements per pair of reconstruction values by default (``scale_block="auto"`` outside ``deepspeed_compat``)
DEFAULT_SCALE_BLOCK = 64
#: the length taken for a run without end (``max_steps=-1, max_epochs=-1``): every warm-up in steps ends in it
ENDLESS = 2**62


class FrozenAdamLink:
    """What the hook and the checkpoint need of the optimizer and its exchange (``GradCompState.extra``).

    Created with the hook state (before the optimizer exists); :meth:`bind` connects the optimizer and builds the
    exchange. A checkpoint's entry restored before that is applied by :meth:`bind`.
    """

    def __init__(self, rank: int, world_size: int, group: Optional[dist.ProcessGroup], device: torch.device,
                 block_size: Optional[int] = None) -> None:
        self.rank = rank
        self.block_size = block_size
        self.world_size = world_size
        self.group = group
        self.device = device
        self.optimizer: Optional[FrozenVarianceAdam] = None
        self.exchange: Optional[CompressedAllReduce] = None
        self.params: dict[str, Tensor] = {}
        self._pending: Optional[dict[str, Any]] = None

    def bind(self, optimizer: FrozenVarianceAdam, params: dict[str, Tensor]) -> None:
        """Connect ``optimizer`` (its parameters by name, in its order) and build its exchange."""
        self.optimizer = optimizer
        self.params = params
        self.exchange = CompressedAllReduce([(n, p.numel()) for n, p in params.items()], self.rank, self.world_size,
                                            self.group, self.block_size)
        optimizer.bind(self.exchange)
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None

    def dense_gradients(self) -> bool:
        """Whether this step's gradients are averaged by the hook (always until an optimizer is bound)."""
        return self.optimizer is None or self.optimizer.dense_gradients()

    def state_dict(self) -> dict[str, Any]:
        if self.exchange is None:
            return dict(self._pending or {})
        out: dict[str, Any] = {"exchange": self.exchange.state_dict()}
        if isinstance(self.optimizer, ZeroOneAdam) and not self.optimizer.in_sync():
            # between synchronisations each rank has its own weights, and Lightning saves rank 0's only
            out["params"] = {n: p.detach().cpu().clone() for n, p in self.params.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.exchange is None:
            self._pending = state
        else:
            self._apply(state)

    @torch.no_grad()
    def _apply(self, state: dict[str, Any]) -> None:
        assert self.exchange is not None
        if "exchange" in state:
            self.exchange.load_state_dict(state["exchange"], self.device)
        for name, value in state.get("params", {}).items():
            self.params[name].copy_(value)


def frozen_adam_hook(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The gradcomp hook on dense steps; on the others each rank keeps its own gradient.

    Register with ``ddp_model.register_comm_hook(state, frozen_adam_hook)`` on a state with a
    :class:`FrozenAdamLink` under ``state.extra[LINK_KEY]``.
    """
    link: FrozenAdamLink = state.extra[LINK_KEY]
    if link.dense_gradients():
        return gradcomp_hook(state, bucket)
    state.ledger.bucket_called(bucket.is_last(), first=bucket.index() == 0)
    buffer = bucket.buffer()
    if bucket.index() == 0:
        begin_step(state)
    params = bucket.parameters()
    names = [state.names[id(p)] for p in params]
    grads = LayerViews(buffer, layer_offsets(bucket), [p.shape for p in params])
    # one rank's NaN decides for all: every rank then drops the step (the optimizer's step is a no-op everywhere)
    if bucket_is_nonfinite(state, buffer, grads, names):
        return comm.completed(buffer.fill_(float("nan")))
    state.ledger.record_shared(bucket.index(), 0)
    return comm.completed(buffer)


class OneBitAdamStrategy(GradCompStrategy):
    """1-bit Adam (``strategy="onebit_adam"``): use with :class:`~lightning_gradcomp.optimizers.OneBitAdam`.

    Dense fp32 gradient averaging during the optimizer's warm-up, then no gradient collective: the optimizer
    exchanges its momentum by the two-stage 1-bit all-reduce with worker and server error compensation
    (:mod:`lightning_gradcomp.onebit_adam.exchange`). The method's options (``freeze_step``, ...) are the
    optimizer's, as in DeepSpeed. Every option of :class:`~lightning_gradcomp.GradCompStrategy` applies except
    ``compressor`` (fp32 during warm-up; the exchange is 1-bit) and the hierarchical exchange.

    At setup (before step 0) a warm-up given as a fraction of the run is resolved from the Trainer's
    ``max_steps`` (or ``max_epochs``), and rank 0 warns when the warm-up leaves no compressed step or freezes an
    uncorrected variance below half its scale
    (:meth:`~lightning_gradcomp.optimizers.frozen_adam.FrozenVarianceAdam.warmup_warnings`).

    Args:
        scale_block: elements per pair of reconstruction values in the 1-bit exchange (``block_size`` of
            :class:`~lightning_gradcomp.onebit_adam.CompressedAllReduce`). ``"auto"`` (default): 64 (2 bits per
            element), or one pair per tensor piece (``None``, DeepSpeed's one scale per tensor) when the optimizer
            has ``deepspeed_compat=True``. One pair per piece diverges on a model whose tensors mix coordinates
            with and without gradient (a fused query-key-value bias, a bias of dead units: ``docs/onebit_adam.md``).
        **kwargs: :class:`~lightning_gradcomp.GradCompStrategy`'s options.
    """

    strategy_name = "onebit_adam"
    #: the optimizer this strategy completes
    optimizer_class: type[FrozenVarianceAdam] = OneBitAdam

    def __init__(self, scale_block: Union[int, None, Literal["auto"]] = "auto", **kwargs: Any) -> None:
        if scale_block is not None and scale_block != "auto":
            check_int("scale_block", scale_block, minimum=1,
                      fix="use e.g. 64, None for one scale per tensor piece, or 'auto'")
        self.scale_block = scale_block
        for option in ("compressor", "hierarchy", "site_size", "site_sizes"):
            if kwargs.get(option) is not None:
                raise ValueError(
                    f"Expected `{option}` to be unset for {type(self).__name__}, but got {kwargs[option]!r}. Fix: drop "
                    f"it: warm-up gradients travel in fp32 and the exchange is {type(self).__name__}'s own 1-bit "
                    f"all-reduce (use GradCompStrategy for another compressor)."
                )
        self._refuse_optimizer_options(kwargs)
        super().__init__(compressor="fp32", **kwargs)
        self.link: Optional[FrozenAdamLink] = None

    def _refuse_optimizer_options(self, kwargs: dict[str, Any]) -> None:
        """An option of either optimizer given to the strategy: name where it goes (the generic unknown-option
        error would point at compressor and DDP options)."""
        own = self.optimizer_class
        options: dict[type[FrozenVarianceAdam], list[str]] = {
            cls: [n for n in inspect.signature(cls).parameters if n != "params"] for cls in (OneBitAdam, ZeroOneAdam)
        }
        misplaced = [k for k in kwargs if any(k in names for names in options.values())]
        if not misplaced:
            return
        name, value = misplaced[0], kwargs[misplaced[0]]
        # each method's variance freeze has its own name: point at the one of this strategy's optimizer
        target = _FREEZE_EQUIVALENT.get(name, name) if name not in options[own] else name
        other = OneBitAdam if own is ZeroOneAdam else ZeroOneAdam
        where = (f"`{own.__name__}(self.parameters(), {target}={value!r})` from configure_optimizers"
                 if target in options[own] else
                 f"`{other.__name__}(self.parameters(), {name}={value!r})` from configure_optimizers, with "
                 f"Trainer(strategy={other.paired_strategy!r})")
        raise ValueError(
            f"Expected `{name}` to be given to the optimizer, but got {type(self).__name__}({name}={value!r}): the "
            f"method's options are its optimizer's (as in DeepSpeed), not the strategy's. Fix: drop it here and return "
            f"{where} (1-bit Adam's warm-up is `OneBitAdam(params, freeze_step=...)`, 0/1 Adam's "
            f"`ZeroOneAdam(params, var_freeze_step=...)`)."
        )

    @override
    def _hook_function(self) -> Callable[..., Any]:
        return frozen_adam_hook

    @override
    def _announce(self, named: dict[str, torch.nn.Parameter], float_names: frozenset[str], world_size: int,
                  in_sites: bool = False, between_sites: bool = False) -> None:
        """Nothing at DDP wrap: the fp32 compressor is only the warm-up's; :meth:`setup_optimizers` says what runs
        once the optimizer (and so the exchange's size) is known."""

    @override
    def _on_hook_state(self, named: dict[str, torch.nn.Parameter]) -> None:
        assert self.comm_state is not None
        self.link = FrozenAdamLink(self.global_rank, self.comm_state.world_size, self.comm_state.peers.process_group,
                                   self.root_device, None if self.scale_block == "auto" else self.scale_block)
        self.comm_state.attach(LINK_KEY, self.link)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        optimizer = self._check_optimizer(self.optimizers)
        if self.link is None or self.comm_state is None:
            return  # not fitting: nothing is exchanged
        by_id = self.comm_state.names
        params = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in by_id:
                    raise ValueError(
                        f"Expected every parameter of {type(optimizer).__name__} to be a trainable parameter of the "
                        f"LightningModule, but got one of shape {tuple(p.shape)} that is not. Fix: pass "
                        f"`self.parameters()` (or groups of them) to the optimizer in configure_optimizers."
                    )
                params[by_id[id(p)]] = p
        if self.scale_block == "auto":
            self.link.block_size = None if optimizer.deepspeed_compat else DEFAULT_SCALE_BLOCK
        total = self._total_steps(trainer, optimizer)
        optimizer.resolve_warmup(total)
        self.link.bind(optimizer, params)
        if self.global_rank == 0:
            for message in optimizer.warmup_warnings(total):
                warnings.warn(f"gradcomp: {message}", UserWarning, stacklevel=2)
            numel = sum(p.numel() for p in params.values())
            assert self.link.exchange is not None
            compressed = optimizer.compressed_steps(total)
            steps = "after the warm-up" if total == ENDLESS else f"on {compressed:,} of the run's {total:,} steps"
            then = (
                f"then the two-stage 1-bit all-reduce with worker and server error compensation {steps} (about "
                f"{self.link.exchange.expected_nbytes():,} bytes per exchange)"
                if compressed else f"and no compressed step in the run's {total:,} steps"
            )
            log.info("gradcomp: %s on %d ranks, phase %s: fp32 gradient all-reduce on dense steps (%s bytes), %s; "
                     "bytes_per_step() averages both phases over the run",
                     type(optimizer).__name__, self.comm_state.world_size, optimizer.phase, f"{4 * numel:,}", then)

    def _total_steps(self, trainer: "pl.Trainer", optimizer: FrozenVarianceAdam) -> int:
        """The run's optimizer steps (``max_steps``, else the epochs' steps); a clear error where a fraction of the
        run must be resolved and the run has no end."""
        total = run_steps(trainer)
        if optimizer.warmup_fraction is not None:  # a fraction of a run without end is refused as dense steps are
            name = optimizer.warmup_option
            resolve_dense_steps(optimizer.warmup_fraction, total, name, minimum=1,
                                in_steps=f"give {type(optimizer).__name__}'s {name} in steps (e.g. {name}=300)")
        return int(total) if math.isfinite(total) else ENDLESS

    def _check_optimizer(self, optimizers: list[Optimizer]) -> FrozenVarianceAdam:
        """The one optimizer, of :attr:`optimizer_class`; a clear error before the first step otherwise."""
        expected = self.optimizer_class.__name__
        if len(optimizers) != 1 or not isinstance(optimizers[0], self.optimizer_class):
            got = [type(o).__name__ for o in optimizers]
            raise ValueError(
                f"Expected configure_optimizers to return one lightning_gradcomp.optimizers.{expected} for "
                f"strategy={self.strategy_name!r}, but got {got if len(got) != 1 else got[0]}. Fix: return "
                f"`{expected}(self.parameters(), lr=...)` (its exchange and phase drive this strategy's), or use "
                f"another strategy with {got[0] if len(got) == 1 else 'these optimizers'}."
            )
        optimizer = optimizers[0]
        assert isinstance(optimizer, FrozenVarianceAdam)
        return optimizer

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        dense = self.link is None or self.link.dense_gradients()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if not dense and self.link is not None and self.comm_state is not None:
            self._record_exchange()
        return output

    def _record_exchange(self) -> None:
        """Account the step's compressed exchange in the hook's ledger (so ``bytes_per_step``, the progress bar
        and the monitor show it): its bytes apportioned to the parameters by element count (0 on a step without
        exchange, 0/1 Adam's local steps)."""
        link, state = self.link, self.comm_state
        assert link is not None and state is not None and link.exchange is not None and link.optimizer is not None
        total = link.exchange.last_nbytes if link.optimizer.exchanged else 0
        names = list(link.params)
        numels = [link.params[n].numel() for n in names]
        numel = sum(numels)
        nbytes, given = [], 0
        for i, n in enumerate(numels):
            share = total - given if i == len(numels) - 1 else total * n // numel
            nbytes.append(share)
            given += share
        segments = Segments(names, [link.params[n].shape for n in names])
        state.ledger.record_group(GroupRecord(segments, tuple(nbytes), Aggregation.GATHER, {}))

    @property
    def stats(self) -> dict[str, Tensor]:
        """Statistics of the latest step for :class:`~lightning_gradcomp.callbacks.CompressionMonitor`:
        ``compressed_phase`` (1 once the gradients are no longer averaged densely), ``bytes_per_step`` (what
        this rank contributed per step, averaged over the run so far), ``last_step_bytes`` (in the latest step),
        ``worker_error_norm`` and ``server_error_norm``."""
        if self.link is None or self.link.exchange is None or self.comm_state is None:
            return {}
        return {
            "compressed_phase": torch.tensor(float(not self.link.dense_gradients())),
            "bytes_per_step": torch.tensor(float(self.comm_state.bytes_per_step())),
            "last_step_bytes": torch.tensor(float(self.comm_state.last_step_bytes())),
            **self.link.exchange.error_norms(),
        }

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry)


class ZeroOneAdamStrategy(OneBitAdamStrategy):
    """0/1 Adam (``strategy="zero_one_adam"``): use with :class:`~lightning_gradcomp.optimizers.ZeroOneAdam`.

    Dense fp32 gradient averaging on the optimizer's variance-update steps; 1-bit compressed gradient averaging on
    the other steps before the variance freezes; after it, local steps and a 1-bit averaged update every
    ``local_interval`` steps. Between synchronisations the ranks' weights and optimizer states differ, so each
    rank's are checkpointed. A ``fit`` that ends between two synchronisations synchronises once more after its last
    step (:meth:`final_synchronisation`, run by
    :class:`~lightning_gradcomp.strategies.final_sync.FinalSynchronisation`), so every rank leaves ``fit`` with the
    same weights, and the checkpoints written at its end hold them.

    Args:
        **kwargs: :class:`OneBitAdamStrategy`'s ``scale_block`` and :class:`~lightning_gradcomp.GradCompStrategy`'s
            options.
    """

    strategy_name = "zero_one_adam"
    optimizer_class = ZeroOneAdam
    per_rank_optimizer_state = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # replicas differ between synchronisations by design: the check runs here, at synchronised steps only
        self.sync_check_every, self.check_replicas_every = self.check_replicas_every, 0

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        k = self.sync_check_every
        if k and self._optimizer_steps % k == 0 and isinstance(optimizer, ZeroOneAdam) and optimizer.in_sync():
            self._check_synchronised()
        return output

    def _check_synchronised(self) -> None:
        """The replica check (``check_replicas_every``) at a synchronised point."""
        module = self.lightning_module
        assert module is not None  # optimizer steps run only with a module attached
        named = list(module.named_parameters())
        check_replicas([n for n, _ in named], [p for _, p in named], self.world_size, module.trainer.global_step)

    def final_synchronisation(self) -> None:
        """At the end of ``fit``: the scheduled synchronisation brought forward when the ranks are apart
        (:meth:`~lightning_gradcomp.optimizers.ZeroOneAdam.synchronise`), so every rank holds the same weights.

        The method's own exchange rather than an exact average of the weights: its weights, momentum and
        synchronisation anchor stay consistent, so a run resumed from the final checkpoint continues the method
        (exactly as if the schedule had synchronised at this step). Every rank calls it at the same point (the
        decision depends only on the optimizer's counters, identical on every rank)."""
        link = self.link
        if link is None or not isinstance(link.optimizer, ZeroOneAdam) or not link.optimizer.synchronise():
            return
        assert link.exchange is not None
        module = self.lightning_module
        assert module is not None
        if self.global_rank == 0:
            log.info(
                "gradcomp: ZeroOneAdam: final synchronisation after step %d (it ended between two), so every rank "
                "leaves fit with the same weights (%s bytes from this rank)", module.trainer.global_step,
                f"{link.exchange.last_nbytes:,}",
            )
        if self.sync_check_every:
            self._check_synchronised()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        FinalSynchronisation.attach(trainer)  # runs `final_synchronisation` after the last step
        super().setup(trainer)


def register(strategy_registry: Any = None) -> None:
    """Register ``"onebit_adam"`` and ``"zero_one_adam"`` (and their fork-started ``*_notebook`` variants)."""
    registry.register_preset(
        "onebit_adam", OneBitAdamStrategy,
        "1-bit Adam: dense warm-up, then frozen variance and 1-bit momentum with worker and server error compensation; "
        "use lightning_gradcomp.optimizers.OneBitAdam", strategy_registry,
    )
    registry.register_preset(
        "zero_one_adam", ZeroOneAdamStrategy,
        "0/1 Adam: adaptive variance freezing, 1-bit exchanges and local steps; use lightning_gradcomp.optimizers.ZeroOneAdam",
        strategy_registry,
    )
