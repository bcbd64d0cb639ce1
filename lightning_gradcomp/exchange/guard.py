"""Non-finite gradients: one decision for all ranks, taken before anything stateful sees the gradient.

A NaN or Inf on one rank would otherwise enter that rank's residual (poisoning every later step), its
momentum-correction buffers, and a shared scaler; and whether the averaged gradient comes out finite
would depend on the compressor. So per bucket, before transforms and error feedback, each rank scans the
bucket buffer once and the ranks agree with one 4-byte all-reduce (MAX of ``rank + 1`` where non-finite):

* ``"skip"``: the bucket and every later bucket of the step are neither transformed, compressed nor sent;
  residuals written earlier in the step are rolled back; the buckets are filled with NaN on every rank, so a
  ``GradScaler`` (fp16 AMP) skips the step and backs off, and otherwise the strategy drops every gradient
  (the optimizer then skips every parameter). Identical on all ranks, so replicas stay identical.
* ``"raise"``: every rank raises :class:`NonFiniteGradientError` naming the parameter and the rank.
* ``"ignore"``: no check (the compressor sees the NaN; use only when something upstream guarantees finiteness).

Where nothing stateful runs before the compressors' shared statistics (no transforms, no residuals, no captured
monitor statistics: :func:`can_share_collective`), the flag travels in the statistics' max all-reduce instead of
one of its own, so a bucket costs one blocking round trip instead of two; the decision is the same.

Steps are delimited by DDP itself: it launches buckets in index order, so bucket 0 starts a step.

A compressor can also turn finite input into non-finite output (fp16 beyond 65504 x world size, a norm that
overflows float32). So each decoded bucket's cheap flag is kept too (:func:`observe_decoded`: no collective,
since every rank decodes the same bits, and no host sync), and at the end of backward :func:`end_backward` skips
or raises for such a step exactly as for a non-finite input.

A run that cannot recover stops, in every mode but ``"ignore"``. A skipped step is the only moment a run can have
gone non-finite unseen (non-finite parameters or optimizer state give non-finite gradients), so on a skipped step,
and only then, :func:`drop_skipped_gradients` checks the parameters and the optimizers' state and the ranks agree
(one 4-byte all-reduce): a non-finite one stops every rank with :class:`NonFiniteGradientError` naming the step
and the tensor. :func:`end_backward` counts consecutive skipped steps: after :data:`WARN_AFTER_SKIPS` of them it
warns, and after :data:`RAISE_AFTER_SKIPS` every rank raises, naming the step and the parameter whose gradient
was non-finite. An isolated overflow (a GradScaler's back-off) is skipped and training goes on.
"""

import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.ledger import Ledger
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.exchange.transport import Transport

log = logging.getLogger(__name__)

NonFinite = Literal["skip", "raise", "ignore"]
NONFINITE_MODES = ("skip", "raise", "ignore")


@dataclass
class NonFiniteGuard:
    """The guard's state for one hook state; only this module's functions change it.

    Attributes:
        mode: what a NaN/Inf gradient on any rank does (``"skip"``, ``"raise"`` or ``"ignore"``).
        step_nonfinite: whether the current (or last) step was found non-finite and skipped.
        skipped_steps: steps skipped for non-finite gradients since construction.
        consecutive_skips: skipped steps in a row, counted by :func:`end_backward`.
    """

    mode: NonFinite = "skip"
    step_nonfinite: bool = False
    skipped_steps: int = 0
    consecutive_skips: int = 0
    #: this step's cheap non-finite flags of the decoded buckets (:func:`observe_decoded`)
    decoded_flags: list[Tensor] = field(default_factory=list)
    #: the ledger's ``hook_calls`` when :func:`end_backward` last counted a step
    counted_hook_calls: int = 0
    #: this rank's parameters whose gradient was non-finite in the latest skipped step (empty: another rank's)
    last_bad: list[str] = field(default_factory=list)

    def set_mode(self, mode: NonFinite) -> None:
        self.mode = mode


class GuardedState(Protocol):
    """What the guard reads of the hook state (structural: the guard does not import the hook)."""

    @property
    def guard(self) -> NonFiniteGuard: ...

    @property
    def memory(self) -> ResidualMemory: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def transforms(self) -> Sequence[Any]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def transport(self) -> Transport: ...

#: consecutive skipped steps after which a warning says the run is not training
WARN_AFTER_SKIPS = 5
#: consecutive skipped steps after which every rank raises :class:`NonFiniteGradientError` (a GradScaler's start-up
#: back-off skips a few steps; ten in a row is a run that does not recover)
RAISE_AFTER_SKIPS = 10


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank (raised identically on every rank)."""


def begin_step(state: GuardedState) -> None:
    """Forget the previous step's decision and decoded flags, and open the residuals' step (called at bucket 0).

    Only a step that may be skipped keeps the residuals it replaces (for :meth:`ResidualMemory.rollback`)."""
    state.guard.step_nonfinite = False
    state.guard.decoded_flags.clear()
    state.memory.begin_step(keep_undo=state.guard.mode == "skip")


def _flag(buffer: Tensor, rank: int, exact: bool = False) -> Tensor:
    """``rank + 1`` where ``buffer`` may hold NaN/Inf, else 0 (float32, one element, on the buffer's device).

    The default is one reduction pass with no bucket-sized temporary: NaN and Inf propagate through a sum (Inf -
    Inf is NaN), so a finite sum proves a finite bucket, but a non-finite sum may also be a float32 overflow of
    finite values. ``exact=True`` checks every element (a bool per element: on CPU a fresh, page-faulted
    allocation on every call, hence not the default).
    """
    if exact:
        bad = ~torch.isfinite(buffer).all()
    else:
        # half-precision buckets are summed in float32, so an fp16 sum does not overflow at 65504
        bad = ~torch.isfinite(buffer.sum(dtype=torch.float32 if buffer.element_size() < 4 else None))
    return (bad.to(torch.float32) * (rank + 1)).reshape(1)


def _worst(state: GuardedState, buffer: Tensor, rank: int, exact: bool) -> int:
    """The largest flag over ranks (one 4-byte all-reduce, read on the host)."""
    flag = _flag(buffer, rank, exact)
    if state.world_size > 1:
        state.transport.max_(flag)
        state.ledger.count("allreduce_nonfinite")
    return int(flag.item())


def _rank(state: GuardedState) -> int:
    return state.transport.rank


def can_share_collective(state: GuardedState, compressors: Sequence[Compressor]) -> bool:
    """Whether this bucket's flag may travel in the hook's statistics all-reduce instead of one of its own.

    Only when nothing stateful runs between the check and that all-reduce: no layer transforms, no residuals
    (the hook then observes a monitored bucket's inputs only once it is known to be finite). Depends only on
    configuration and agreed state, never on rank-local state such as a monitor that lives on rank 0 only, so
    every rank takes the same path and issues the same collectives.
    """
    if state.guard.mode == "ignore" or state.guard.step_nonfinite or state.transforms:
        return False
    return not any(c.uses_memory for c in compressors)


def local_flag(state: GuardedState, buffer: Tensor) -> Tensor:
    """This rank's cheap flag (``rank + 1`` if its sum is not finite, else 0), to be max-reduced with others."""
    return _flag(buffer, _rank(state))


def bucket_is_nonfinite(
    state: GuardedState, buffer: Tensor, grads: Sequence[Tensor], names: Sequence[str], worst: Optional[int] = None
) -> bool:
    """Whether this bucket must be skipped on every rank; raises in ``"raise"`` mode.

    Issues one all-reduce per bucket, and a second, exact one on every rank when some rank's cheap check
    fired (none once the step is already known to be skipped: that decision is the same on every rank, so
    every rank leaves it out). ``worst``: the max over ranks of :func:`local_flag`, when it was already reduced
    in another collective (:func:`can_share_collective`); then no first all-reduce is issued here.
    """
    if state.guard.mode == "ignore":
        return False
    if state.guard.step_nonfinite:
        return True
    rank = _rank(state)
    if worst is None:
        worst = _worst(state, buffer, rank, exact=False)
    if worst != 0:
        # some rank's sum was not finite: every rank saw that, so all of them take the exact look together
        # (a float32 overflow of finite values must not skip a step)
        worst = _worst(state, buffer, rank, exact=True)
    if worst == 0:
        return False
    if state.guard.mode == "raise":
        local = _nonfinite_names(zip(names, grads))
        where = (
            f"`{local[0]}` on rank {rank}" + (f" (also {local[1:]})" if local[1:] else "")
            if local
            else f"the bucket {list(names)} on rank {worst - 1}"
        )
        raise NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf) in {where}; every rank stops here. Fix: lower the learning rate, "
            f"check the data, or pass `GradCompStrategy(nonfinite='skip')` to skip such steps on every rank."
        )
    _skip_step(state)
    state.guard.last_bad = _nonfinite_names(zip(names, grads))
    return True


def _nonfinite_names(named_grads: Iterable[tuple[str, Optional[Tensor]]]) -> list[str]:
    return [n for n, g in named_grads if g is not None and not bool(torch.isfinite(g).all())]


def mark_skipped(state: GuardedState) -> None:
    """Skip this step on this rank because another rank's guard did (an engine whose guard agrees within a
    subgroup only spreads the decision itself, e.g. :func:`lightning_gradcomp.strategies.shards.agree_on_skip`)."""
    _skip_step(state)


def _skip_step(state: GuardedState) -> None:
    """Mark the step skipped on this rank (every rank decides the same) and roll back its residuals."""
    state.guard.step_nonfinite = True
    state.guard.skipped_steps += 1
    state.memory.rollback()


def drop_skipped_gradients(
    state: GuardedState,
    seen: int,
    named_parameters: Iterable[tuple[str, Tensor]],
    has_scaler: bool,
    step: Optional[int] = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> int:
    """After backward: check what was decoded (:func:`end_backward`), then, if the hook skipped a step since ``seen``
    skips, stop a run that cannot recover (:func:`check_recoverable`) or make the optimizer step a no-op.

    Every gradient is dropped (``p.grad = None``: optimizers skip such parameters, so no update, momentum or decay),
    except under a ``GradScaler``, which skips the step itself on the NaN-filled buckets and lowers its scale.
    Called by the Trainer and the Fabric strategy alike (``step``: the step for the messages); returns the count
    to pass as ``seen`` next time.
    """
    named = list(named_parameters)
    end_backward(state, ((n, p.grad) for n, p in named), step=step)
    skipped = state.guard.skipped_steps
    if skipped == seen:
        return seen
    check_recoverable(state, named, optimizers, step)
    log.warning("gradcomp: non-finite gradient on some rank; step skipped on every rank (%d so far)", skipped)
    if not has_scaler:
        for _, p in named:
            p.grad = None
    return skipped


def check_recoverable(
    state: GuardedState,
    named_parameters: Sequence[tuple[str, Tensor]],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    step: Optional[int] = None,
) -> None:
    """On a skipped step: raise :class:`NonFiniteGradientError` on every rank when some rank holds a non-finite
    parameter or optimizer state (no later step can be finite: skipping would skip the rest of the run).

    Every rank calls it at the same skipped step (the skip is agreed); the ranks agree with one 4-byte MAX
    all-reduce, since 0/1 Adam's ranks hold their own weights between synchronisations. Not in ``"ignore"`` mode.
    """
    if state.guard.mode == "ignore":
        return
    bad = _nonfinite_names((n, _local(p.detach())) for n, p in named_parameters)
    names = {id(p): n for n, p in named_parameters}
    for optimizer in optimizers:
        for p, entry in optimizer.state.items():
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(_local(value)).all()):
                    bad.append(f"{type(optimizer).__name__}'s {key} of {names.get(id(p), 'a parameter')}")
    rank = _rank(state)
    flag = torch.full((1,), float(rank + 1) if bad else 0.0, device=named_parameters[0][1].device
                      if named_parameters else None)
    if state.world_size > 1:
        state.transport.max_(flag)
        state.ledger.count("allreduce_nonfinite")
    worst = int(flag.item())
    if worst == 0:
        return
    where = f"`{bad[0]}` on rank {rank}" + (f" (also {bad[1:4]})" if bad[1:] else "") if bad else f"rank {worst - 1}"
    raise NonFiniteGradientError(
        f"Non-finite parameters or optimizer state at step {_step_text(step)}: {where}. The run cannot recover (every "
        f"later step would be skipped), so every rank stops here. Fix: lower the learning rate, clip gradients "
        f"(Trainer(gradient_clip_val=...)), check the data, and resume from a checkpoint saved before step "
        f"{_step_text(step)}."
    )


def _local(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds (a sharded model's DTensor): each rank checks its own, with no
    collective of the DTensor's."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _step_text(step: Optional[int]) -> str:
    return "?" if step is None else str(step)


def agree_across_sites(
    state: GuardedState,
    named_grads: Iterable[tuple[str, Optional[Tensor]]],
    rank: int,
    device: torch.device,
    raise_agreed: bool,
    step: Optional[int] = None,
) -> None:
    """After backward, under a strategy whose hook runs inside a site: make the step's decision the same on every
    rank of every site. Call before :func:`drop_skipped_gradients` (it runs :func:`end_backward` with the agreement).

    The hook's flag all-reduce spans its own group, the site: alone, one site would skip (or raise) a step that the
    other sites take. So each rank adds its site's decision (``rank + 1`` where its site skipped the step, after the
    check of the decoded buckets) to one 4-byte MAX all-reduce over every rank (the default group); a site that did
    not skip then skips too, and with ``raise_agreed`` (the user's ``"raise"``, while the hook only skips so that no
    site stops alone) every rank raises. A backward without the hook (gradient accumulation) issues nothing.

    Raises:
        NonFiniteGradientError: with ``raise_agreed``, on every rank, when some site found a non-finite gradient.
    """
    worst = 0

    def agree(skipped: bool) -> bool:
        nonlocal worst
        flag = torch.full((1,), float(rank + 1) if skipped else 0.0, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        state.ledger.count("allreduce_nonfinite_sites")
        worst = int(flag.item())
        return worst != 0

    if end_backward(state, named_grads, agree, step) and raise_agreed:
        raise NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf) in the site of rank {worst - 1}; every rank of every site stops here. "
            f"Fix: lower the learning rate, check the data, or pass `nonfinite='skip'` to skip such steps on every rank."
        )


def observe_decoded(state: GuardedState, buffer: Tensor) -> None:
    """After a bucket was decoded into ``buffer``: keep its cheap non-finite flag for :func:`end_backward`.

    Every rank decodes the same payloads into the same bits, so every rank keeps the same flags: no collective.
    The flag stays a tensor (no host sync); a list append, because buckets may be decoded on several threads.
    """
    if state.guard.mode != "ignore" and not state.guard.step_nonfinite:
        state.guard.decoded_flags.append(_flag(buffer, 0))


def end_backward(
    state: GuardedState,
    named_grads: Iterable[tuple[str, Optional[Tensor]]],
    agree: Optional[Callable[[bool], bool]] = None,
    step: Optional[int] = None,
) -> bool:
    """At the end of a backward pass: skip (or raise for) a step whose decoded gradients are non-finite although
    every rank's input was finite, and count consecutive skipped steps. Returns whether the step is skipped.

    ``agree``: given this rank's decision, the decision of every rank (:func:`agree_across_sites`); a step skipped
    only elsewhere is then skipped here too (residuals rolled back, gradients NaN-filled as the hook fills a skipped
    step's buckets, so a GradScaler skips it as well) before the skips are counted.

    Identical on every rank (same decoded bits, same counters), so every rank skips or raises together. A backward
    without the hook (gradient accumulation) changes nothing. Raises :class:`NonFiniteGradientError` in
    ``"raise"`` mode, and in any mode after :data:`RAISE_AFTER_SKIPS` consecutive skipped steps.
    """
    guard = state.guard
    if state.ledger.hook_calls == guard.counted_hook_calls:
        return False
    guard.counted_hook_calls = state.ledger.hook_calls
    named_grads = list(named_grads)
    flags, guard.decoded_flags = guard.decoded_flags, []
    if flags and not guard.step_nonfinite and bool(torch.stack(flags).max() > 0):
        bad = _nonfinite_names(named_grads)  # the cheap flag may be a float32 overflow of a finite sum
        if bad and guard.mode == "raise":
            raise NonFiniteGradientError(
                f"Compression turned finite gradients into non-finite ones in {bad} (an overflow in the "
                f"compressor's encoding, e.g. fp16 beyond 65504 x world size); every rank stops here. Fix: lower the "
                f"learning rate, clip gradients before compression (SigmaClipping, LocalGradientClipping), or use "
                f"'bf16'/'fp32'; `nonfinite='skip'` skips such steps on every rank."
            )
        if bad:
            _skip_step(state)
            state.guard.last_bad = bad
    if agree is not None and agree(guard.step_nonfinite) and not guard.step_nonfinite:
        _skip_step(state)
        for _, grad in named_grads:
            if grad is not None:
                grad.fill_(float("nan"))
    guard.consecutive_skips = guard.consecutive_skips + 1 if guard.step_nonfinite else 0
    if guard.consecutive_skips == WARN_AFTER_SKIPS:
        warnings.warn(
            f"gradcomp: the last {WARN_AFTER_SKIPS} steps were all skipped for non-finite gradients: the model is "
            f"not training. Causes: non-finite data or loss, a diverged model, or a compressor whose encoding "
            f"overflows (fp16 beyond 65504 x world size). Fix: lower the learning rate, clip gradients before "
            f"compression, or use 'bf16'/'fp32'. After {RAISE_AFTER_SKIPS} consecutive skipped steps every rank raises.",
            UserWarning,
            stacklevel=2,
        )
    if guard.consecutive_skips >= RAISE_AFTER_SKIPS:
        where = f"`{guard.last_bad[0]}` on this rank" if guard.last_bad else "a parameter on another rank"
        raise NonFiniteGradientError(
            f"The last {guard.consecutive_skips} steps were all skipped for non-finite gradients (on some rank, or "
            f"after compression), up to step {_step_text(step)} (the latest: {where}); training made no progress, "
            f"so every rank stops here. Fix: lower the learning rate, check the data, clip gradients before "
            f"compression, or use 'bf16'/'fp32' instead of 'fp16'."
        )
    return guard.step_nonfinite
