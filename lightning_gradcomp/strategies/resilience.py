"""The strategy's reliability hooks: exact resume, replica checks, non-finite steps, clear collective failures.

Kept apart from :mod:`lightning_gradcomp.strategies.strategy` (which wires the compression pipeline) as a mixin placed
before ``DDPStrategy`` in :class:`~lightning_gradcomp.GradCompStrategy`'s bases; it expects the strategy to
set ``comm_state`` when it registers the hook and to call :meth:`_init_resilience` from its constructor. What runs
in its hooks is the runtime's (:class:`~lightning_gradcomp.strategies._runtime.Runtime`), which the Fabric strategies share.
"""

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.strategies import checkpoint as ckpt
from lightning_gradcomp.strategies._runtime import (  # noqa: F401  (check_recovery_options: public here)
    ResumeCompression,
    Runtime,
    RuntimeOptions,
    check_recovery_options,
)
from lightning_gradcomp.exchange.guard import NonFiniteGradientError
from lightning_gradcomp.strategies.options import ExchangeOptions
from lightning_gradcomp.strategies.replicas import ReplicaDivergenceError, check_replicas
from lightning_gradcomp.strategies.wiring import HookWiring

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_gradcomp.exchange.hook import GradCompState

    class _StrategyBase(HookWiring, DDPStrategy):
        """The type checker reads the mixin as the DDP strategy it is mixed into, with the hook's wiring (their
        attributes, the methods its overrides extend); at run time it stays a plain mixin ahead of them."""
else:
    _StrategyBase = object

log = logging.getLogger(__name__)


# how a collective reports a peer that died (Gloo) or a peer that stopped answering (timeouts); case-insensitive:
# Gloo writes "Timed out waiting ... for recv", NCCL and the store "timed out" / "Timeout"
_PEER_FAILURE = r"(?i).*(Connection closed by peer|Connection reset by peer|timed out|Timeout|Broken pipe|ECONNRESET).*"


class UnusedParameterError(RuntimeError):
    """A rank computed no gradient for some parameter under ``find_unused_parameters=False`` (or a static graph)."""


def _is_own_diagnosis(exception: BaseException) -> bool:
    """Whether the library raised ``exception`` itself with its cause (not a collective that lost a peer).

    Such a message is the diagnosis of the rank at fault; it must not be rewritten as "another rank died" even when
    its text matches :data:`_PEER_FAILURE` (the unused-parameter message names the process-group timeout).
    """
    if isinstance(exception, (UnusedParameterError, NonFiniteGradientError, ReplicaDivergenceError)):
        return True
    return any(isinstance(arg, str) and arg.startswith("gradcomp:") for arg in exception.args)


def _params_of(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """torch's own ``state_dict`` of an optimizer over sharded (``DTensor``) parameters, every ``DTensor`` in it as
    this rank's local shard, and under ``"sharded"`` the keys that were (:func:`load_local_optimizer_state` rebuilds
    them). Lightning's ``ModelParallelStrategy.optimizer_state`` gives the distributed-checkpoint form instead, keyed
    by parameter name and written once per shard, which one rank cannot load on its own."""
    saved = optimizer.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    sharded: dict[Any, list[str]] = {}
    for index, entry in saved["state"].items():
        state[index] = {}
        for key, value in entry.items():
            if isinstance(value, DTensor):
                value = value.to_local()
                sharded.setdefault(index, []).append(key)
            state[index][key] = value
    return {"state": state, "param_groups": saved["param_groups"], "sharded": sharded}


def load_local_optimizer_state(optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
    """Load :func:`local_optimizer_state`'s form: each saved shard becomes a ``DTensor`` again, laid out as its
    parameter (same mesh, placements, global shape and stride)."""
    params = _params_of(optimizer)
    state = {index: dict(entry) for index, entry in saved["state"].items()}
    for index, keys in saved["sharded"].items():
        p = params[int(index)]
        assert isinstance(p, DTensor)
        for key in keys:
            state[index][key] = DTensor.from_local(state[index][key].to(p.device), p.device_mesh, p.placements,
                                                   run_check=False, shape=p.shape, stride=p.stride())
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class RankOptimizerStates:
    """This rank's optimizer states as per-rank checkpoint state (``GradCompState.extra``), for strategies whose ranks'
    optimizers differ (WeightGrad's sites): Lightning saves rank 0's ``optimizer_states`` only and gives them to
    every rank. Restored in two steps: the checkpoint entry is kept when the hook state is restored (at DDP wrap,
    before the optimizers are), then applied by :meth:`apply` once Lightning has loaded rank 0's states.

    Over a sharded model (DiLoCo's sites under FSDP2) each rank keeps its own shard of its optimizer's state
    (:func:`local_optimizer_state`): a distributed checkpoint writes each shard once, from one site."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.pending: Optional[list[dict[str, Any]]] = None

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [local_optimizer_state(o) if any(isinstance(p, DTensor) for p in _params_of(o))
                               else self.strategy.optimizer_state(o) for o in self.strategy.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state["optimizers"]

    def apply(self) -> None:
        """Load the kept states into this rank's optimizers (after Lightning loaded rank 0's)."""
        if self.pending is None:
            return
        for optimizer, saved in zip(self.strategy.optimizers, self.pending):
            if "sharded" in saved:
                load_local_optimizer_state(optimizer, saved)
            else:
                optimizer.load_state_dict(saved)
            _optimizer_to_device(optimizer, self.strategy.root_device)
        self.pending = None


class ResilienceMixin(RuntimeOptions, _StrategyBase):
    """The Trainer's side of the per-rank runtime (:class:`~lightning_gradcomp.strategies._runtime.Runtime`): checkpointed
    compression state, an optional replica check, and non-finite handling for a DDP strategy. Its overrides translate
    the Trainer's hooks into the runtime's calls, which :class:`~lightning_gradcomp.strategies.fabric.FabricRecovery` makes
    from Fabric's."""

    comm_state: Optional["GradCompState"]
    #: whether each rank's optimizer state is checkpointed (ranks whose optimizers differ, e.g. WeightGrad's sites)
    per_rank_optimizer_state: bool = False
    #: whether a non-finite step is decided over every site, not only inside the hook's site (WeightGrad): one 4-byte
    #: all-reduce over every rank per step when there are several sites (:func:`~lightning_gradcomp.exchange.guard.agree_across_sites`)
    nonfinite_across_sites: bool = False
    #: whether the hook state exchanges at every backward; ``False`` where it only carries the per-rank checkpoint
    #: state (DiLoCo over FSDP2: the inner steps are FSDP2's own, with no hook), so no bucket is expected after backward
    hook_every_step: bool = True

    def _init_resilience(self, options: ExchangeOptions) -> None:
        self._runtime = Runtime(options.nonfinite, options.resume_compression, options.timeout,
                                options.check_replicas_every, self.nonfinite_across_sites)
        self._buffers_before: Optional[list[tuple[Tensor, Tensor]]] = None

    @property
    def _optimizer_steps(self) -> int:
        return self._runtime.optimizer_steps

    def _attach_resilience(self, state: "GradCompState") -> None:
        """Called by the strategy right after it created the hook state (at DDP wrap time)."""
        if self.per_rank_optimizer_state:
            state.attach("optimizer", RankOptimizerStates(self))
        self._runtime.attach(state, self.root_device)

    # -- checkpoint: every rank's state into rank 0's file, each rank's part back on resume ------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        # runs on every rank (Trainer.save_checkpoint, ModelCheckpoint): gather, then rank 0 writes
        self._runtime.save(checkpoint, self.comm_state, self.global_rank, self.world_size, self._checkpoint_shard_size())
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.max_steps != -1:  # Lightning's iteration-based training
            ckpt.complete_epoch_end(checkpoint)
        sites, option = self._checkpoint_sites(self.world_size, self.num_nodes)
        # the hook of this run exists already only where the checkpoint is restored after setup; otherwise the
        # entry is applied at DDP wrap (`_attach_resilience`)
        live = self.comm_state if self.restore_checkpoint_after_setup else None
        self._runtime.load(checkpoint, self.global_rank, self.world_size, sites, option, self._checkpoint_shard_size(),
                           live, self.root_device)
        if self.resume_compression == "reset" and ckpt.CHECKPOINT_KEY in checkpoint:
            rank_zero_warn("gradcomp: `resume_compression='reset'`: residuals, generators and transforms start afresh.")
        elif ckpt.CHECKPOINT_KEY not in checkpoint:
            rank_zero_warn(self._without_state_message(checkpoint_path))
        if not self.lightning_restore_optimizer:
            # the strategy loaded the optimizers itself (ModelParallelStrategy, above): Lightning will not call
            # `load_optimizer_state_dict`, so this rank's own states replace the loaded ones here
            self._apply_own_optimizer_states()
        return checkpoint

    def _without_state_message(self, checkpoint_path: _PATH) -> str:
        """The warning for a checkpoint without compression state (written by another strategy)."""
        return (
            f"gradcomp: the checkpoint {checkpoint_path} holds no compression state (written without "
            f"GradCompStrategy?); residuals, generators and transforms start afresh."
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self._apply_own_optimizer_states()

    def _apply_own_optimizer_states(self) -> None:
        own = self.comm_state.extra.get("optimizer") if self.comm_state is not None else None
        if isinstance(own, RankOptimizerStates):
            own.apply()  # this rank's states replace rank 0's

    # -- replica check and non-finite steps ------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        assert module is not None  # optimizer steps run only with a module attached
        sets = self._replica_sets()
        self._runtime.after_optimizer_step(module.named_parameters(), self.world_size, module.trainer.global_step,
                                           sets, self._replica_scope(sets))
        return output

    def _check_landed_rounds(self, sync: Any, what: str) -> None:
        """Take the rounds that ``sync`` (an :class:`~lightning_gradcomp.outer.engine.OuterSync`) applied this step
        and, with ``check_replicas_every`` set, compare what they made global on every rank (``what``, for the
        message). Every rank calls it after the same optimizer step."""
        landed = sync.take_landed()
        if landed:
            module = self.lightning_module
            assert module is not None
            names, tensors = sync.agreed(landed)
            self._check_after_round(names, tensors, module.trainer.global_step, what)

    def _check_after_round(self, names: list[str], tensors: list[Tensor], step: int, what: str) -> None:
        """With ``check_replicas_every`` set: compare on every rank what a round just made global (``what``, for
        the message). Every rank must call it at the same point (right after the same round)."""
        if self.check_replicas_every:
            sets = self._round_sets()
            scope = (f"every rank must hold the same {what}" if sets is None
                     else f"the ranks holding the same shard must hold the same {what}")
            check_replicas(names, tensors, self.world_size, step, sets, scope)

    def _round_sets(self) -> Optional[list[list[int]]]:
        """The sets of global ranks that hold the same tensors right after an outer round (``None``: every rank;
        under FSDP2, the ranks holding the same shard in every site)."""
        return None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.nonfinite == "skip" and self._buffers_before is None:
            # before DDP's forward (and its buffer broadcast): what a skipped step must leave in place. Taken at
            # the first micro-batch of an accumulation window, kept until its synchronizing backward
            module = self.lightning_module
            assert module is not None  # training steps run only with a module attached
            self._buffers_before = [(b, b.detach().clone()) for b in module.buffers()]
        return super().training_step(*args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        state = self.comm_state
        if state is None or not self.hook_every_step or not getattr(self.model, "require_backward_grad_sync", True):
            return  # no_sync (gradient accumulation): no bucket goes out, nothing is decided yet
        buffers_before, self._buffers_before = self._buffers_before, None
        module = self.lightning_module
        assert module is not None  # a backward runs only with a module attached
        self._check_every_bucket_arrived(state, module)
        has_scaler = getattr(self.precision_plugin, "scaler", None) is not None
        if self._runtime.end_backward(state, module.named_parameters(), self.global_rank, self.root_device, has_scaler,
                                      module.trainer.global_step, self.optimizers):
            # the forward of the skipped step already moved running statistics (BatchNorm) with the bad batch, and
            # DDP broadcasts rank 0's buffers at the next forward: put every rank's back as they were before the step
            for buffer, saved in buffers_before or ():
                buffer.copy_(saved)

    def _check_every_bucket_arrived(self, state: "GradCompState", module: "pl.LightningModule") -> None:
        """Fail at once where DDP would hang: a parameter without gradient on this rank keeps its bucket (and every
        later one) from being handed to the hook, while the other ranks wait in that bucket's collectives until the
        process-group timeout. This rank stops with the cause; its exit ends their wait (connection closed)."""
        if state.ledger.take_last_bucket_seen():
            return
        missing = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
        raise UnusedParameterError(
            f"gradcomp: rank {self.global_rank} computed no gradient for {missing or 'some parameter'} at step "
            f"{module.trainer.global_step}, so DDP never handed their bucket to the communication hook and the other "
            f"ranks would wait for it until the process-group timeout. Fix: pass `find_unused_parameters=True` (and "
            f"not `static_graph=True`) to the strategy when some rank may skip a layer at some step."
        )

    @override
    def teardown(self) -> None:
        self._runtime.clear()
        super().teardown()

    # -- faults ------------------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if _is_own_diagnosis(exception):
            return  # this rank found the cause: its message says it (and may mention the timeout it spared)
        _augment_message(
            exception,
            pattern=_PEER_FAILURE,
            new_message=(
                f"gradcomp: a collective failed on rank {self.global_rank}: another rank died or stopped answering "
                f"(see its log for the cause); this rank stops too. Original error: {exception}"
            ),
        )
