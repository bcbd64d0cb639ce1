"""The per-rank runtime both front-ends hold: one implementation under the Trainer and under Fabric.

:class:`~lightning_gradcomp.GradCompStrategy` (through :class:`~lightning_gradcomp.strategies.resilience.ResilienceMixin`) and
:class:`~lightning_gradcomp.strategies.fabric.GradCompFabricStrategy` (through :class:`~lightning_gradcomp.strategies.fabric.FabricRecovery`)
derive from unrelated Lightning classes whose hooks differ (``post_backward`` against ``backward``, a Trainer's
``optimizer_step`` against Fabric's, ``save_checkpoint`` with other arguments). Each front-end keeps only the
translation from its hooks; what happens in them is :class:`Runtime`'s: the reliability options, the hook state's
non-finite mode (given to its constructor), every rank's compression state into the checkpoint and back (with the
refusals of another layout), the non-finite step after backward, and the replica check after an optimizer step.
"""

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_gradcomp.strategies import checkpoint as ckpt
from lightning_gradcomp.exchange.guard import NONFINITE_MODES, NonFinite, agree_across_sites, drop_skipped_gradients
from lightning_gradcomp.strategies.replicas import check_replicas
from lightning_gradcomp.validation import check_choice, check_int

if TYPE_CHECKING:
    from lightning_gradcomp.exchange.hook import GradCompState

ResumeCompression = Literal["exact", "reset"]


def check_recovery_options(nonfinite: Any, resume_compression: Any, timeout: Any) -> None:
    """Validate the options the Trainer and Fabric strategies share for faults and resume.

    Raises:
        ValueError: ``nonfinite`` or ``resume_compression`` is not one of its modes, or ``timeout`` is not a positive
            ``timedelta`` (``None`` is torch's default).
    """
    check_choice("nonfinite", nonfinite, NONFINITE_MODES)
    check_choice("resume_compression", resume_compression, ("exact", "reset"))
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise ValueError(
            f"Expected `timeout` to be a positive datetime.timedelta, but got {timeout!r}. Fix: e.g. "
            f"`timeout=timedelta(minutes=2)`: a collective waits this long for a dead peer before failing."
        )


class Runtime:
    """One rank's reliability state around the hook state: options, pending restore, step counters.

    Args:
        nonfinite: what a NaN/Inf gradient on any rank does (``"skip"``, ``"raise"``, ``"ignore"``).
        resume_compression: ``"exact"`` restores every rank's compression state, ``"reset"`` starts it afresh.
        timeout: the strategy's collective timeout (validated here with the other options).
        check_replicas_every: every k optimizer steps, compare the replicas' parameters (0: never).
        nonfinite_across_sites: decide a non-finite step over every site, not only inside the hook's group
            (WeightGrad's sites).

    Raises:
        ValueError: an option outside its range (:func:`check_recovery_options`).
    """

    def __init__(
        self,
        nonfinite: NonFinite,
        resume_compression: ResumeCompression,
        timeout: Any,
        check_replicas_every: int = 0,
        nonfinite_across_sites: bool = False,
    ) -> None:
        check_int("check_replicas_every", check_replicas_every, minimum=0,
                  fix="use 0 to disable or k > 0 to check every k optimizer steps")
        check_recovery_options(nonfinite, resume_compression, timeout)
        self.nonfinite: NonFinite = nonfinite
        self.resume_compression: ResumeCompression = resume_compression
        self.check_replicas_every = check_replicas_every
        self.nonfinite_across_sites = nonfinite_across_sites
        #: this rank's checkpoint entry, loaded before its hook state existed
        self.pending: Optional[dict[str, Any]] = None
        #: the hook state's skipped-step count at the last backward
        self.nonfinite_seen = 0
        #: optimizer steps since the hook state was attached (the replica check's clock)
        self.optimizer_steps = 0
        #: whether the hook only skips and each step's decision is agreed over every site after backward
        self.sites_agree = False

    def hook_mode(self, hook_world: int, world_size: int) -> NonFinite:
        """The non-finite mode to build the hook state with, for a hook over ``hook_world`` of ``world_size`` ranks.

        Where the decision is taken over every site while the hook's group is one site, the hook only skips (a site
        must not stop alone) and :meth:`end_backward` agrees on the step, raising where the user asked to.
        """
        self.sites_agree = self.nonfinite_across_sites and self.nonfinite != "ignore" and hook_world < world_size
        return "skip" if self.sites_agree else self.nonfinite

    def attach(self, state: "GradCompState", device: torch.device) -> None:
        """The hook state exists: start the counters from it and restore a checkpoint loaded before it existed."""
        self.nonfinite_seen = state.guard.skipped_steps
        self.optimizer_steps = 0
        self.restore_pending(state, device)

    def restore_pending(self, state: Optional["GradCompState"], device: torch.device) -> None:
        """Load the pending checkpoint entry into ``state`` (nothing without one, or before the state exists)."""
        if self.pending is None or state is None:
            return
        ckpt.restore(state, self.pending, device)
        self.pending = None

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], state: Optional["GradCompState"], rank: int, world_size: int,
             shard_size: Optional[int]) -> None:
        """Gather every rank's compression state into ``checkpoint`` on rank 0 (a collective: every rank calls it)."""
        if state is not None:
            ckpt.gather_into(checkpoint, state, rank, world_size, shard_size)

    def load(self, checkpoint: Mapping[str, Any], rank: int, world_size: int, sites: Optional[Sequence[int]],
             option: Optional[str], shard_size: Optional[int], state: Optional["GradCompState"],
             device: torch.device) -> None:
        """Take this rank's entry of ``checkpoint`` (refusing another world size, exchange or shard size, see
        :func:`~lightning_gradcomp.strategies.checkpoint.select`) and restore it into ``state`` now, or keep it for
        :meth:`attach` when the hook state of this run does not exist yet (``state`` is ``None``)."""
        self.pending = ckpt.select(checkpoint, rank, world_size, self.resume_compression == "reset", sites, option,
                                   shard_size)
        self.restore_pending(state, device)

    def clear(self) -> None:
        """Forget a loaded entry that was never restored (teardown)."""
        self.pending = None

    # -- after backward and after an optimizer step ---------------------------------------------------------------
    def end_backward(self, state: "GradCompState", named_parameters: Iterable[tuple[str, Tensor]], rank: int,
                     device: torch.device, has_scaler: bool, step: Optional[int] = None,
                     optimizers: Sequence[torch.optim.Optimizer] = ()) -> bool:
        """After a backward that ran the hook: agree on the step over every site where needed, then drop a skipped
        step's gradients, or stop a run that cannot recover
        (:func:`~lightning_gradcomp.exchange.guard.drop_skipped_gradients`; ``step``, for its messages, defaults to
        the optimizer steps counted here). Returns whether this backward's step was skipped."""
        named = list(named_parameters)
        step = self.optimizer_steps if step is None else step
        if self.sites_agree:
            agree_across_sites(state, ((n, p.grad) for n, p in named), rank, device,
                               raise_agreed=self.nonfinite == "raise", step=step)
        seen = self.nonfinite_seen
        self.nonfinite_seen = drop_skipped_gradients(state, seen, named, has_scaler=has_scaler, step=step,
                                                     optimizers=optimizers)
        return self.nonfinite_seen != seen

    def after_optimizer_step(self, named_parameters: Iterable[tuple[str, Tensor]], world_size: int, step: int,
                             sets: Optional[list[list[int]]], scope: str) -> None:
        """Count the optimizer step and, every ``check_replicas_every`` steps, compare the parameters of each set of
        ranks in ``sets`` (``None``: all ranks) bit for bit (:func:`~lightning_gradcomp.strategies.replicas.check_replicas`;
        every rank calls it after the same step). ``step`` and ``scope`` are for the message.

        Raises:
            ReplicaDivergenceError: on every rank, naming the first parameter that differs inside a set.
        """
        self.optimizer_steps += 1
        # sets of one rank each (DiLoCo's sites under FSDP2: nothing is held twice between rounds): nothing to compare
        agreeing = sets is None or any(len(ranks) > 1 for ranks in sets)
        if not (agreeing and self.check_replicas_every and self.optimizer_steps % self.check_replicas_every == 0):
            return
        named = list(named_parameters)
        # a sharded model's parameters are DTensors: each rank compares the shard it holds
        local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named]
        check_replicas([n for n, _ in named], local, world_size, step, sets, scope)


class RuntimeOptions:
    """The runtime's options as attributes of the strategy that holds it (the Trainer's and Fabric's mixins)."""

    _runtime: Runtime

    @property
    def nonfinite(self) -> NonFinite:
        """What a NaN/Inf gradient on any rank does: ``"skip"``, ``"raise"`` or ``"ignore"``."""
        return self._runtime.nonfinite

    @property
    def resume_compression(self) -> ResumeCompression:
        """``"exact"`` or ``"reset"``: whether a checkpoint's compression state is restored."""
        return self._runtime.resume_compression

    @property
    def check_replicas_every(self) -> int:
        """Every k optimizer steps, the replicas' parameters are compared (0: never)."""
        return self._runtime.check_replicas_every

    @check_replicas_every.setter
    def check_replicas_every(self, every: int) -> None:
        self._runtime.check_replicas_every = every
