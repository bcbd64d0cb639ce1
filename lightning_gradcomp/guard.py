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
or raises for such a step exactly as for a non-finite input. It also counts consecutive skipped steps: a run whose
every step is skipped is not training, so after :data:`WARN_AFTER_SKIPS` of them it warns, and after
:data:`RAISE_AFTER_SKIPS` every rank raises :class:`NonFiniteGradientError`.
"""

import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from lightning_gradcomp.hook import GradCompState

log = logging.getLogger(__name__)

NonFinite = Literal["skip", "raise", "ignore"]
NONFINITE_MODES = ("skip", "raise", "ignore")

#: consecutive skipped steps after which a warning says the run is not training
WARN_AFTER_SKIPS = 10
#: consecutive skipped steps after which every rank raises :class:`NonFiniteGradientError`
RAISE_AFTER_SKIPS = 100


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank (raised identically on every rank)."""


def begin_step(state: "GradCompState") -> None:
    """Forget the previous step's decision, residual snapshot and decoded flags (called at bucket 0)."""
    state.step_nonfinite = False
    state.residual_undo.clear()
    state.decoded_flags.clear()


def remember_residual(state: "GradCompState", name: str) -> None:
    """Keep the residual a step is about to replace, so a skipped step can put it back."""
    if state.nonfinite == "skip" and name not in state.residual_undo:
        state.residual_undo[name] = state.memory.residuals.get(name)


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


def _worst(state: "GradCompState", buffer: Tensor, rank: int, exact: bool) -> int:
    """The largest flag over ranks (one 4-byte all-reduce, read on the host)."""
    flag = _flag(buffer, rank, exact)
    if state.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.process_group)
        state.collectives["allreduce_nonfinite"] += 1
    return int(flag.item())


def _rank(state: "GradCompState") -> int:
    return dist.get_rank(state.process_group) if state.world_size > 1 else 0


def can_share_collective(state: "GradCompState", names: Sequence[str]) -> bool:
    """Whether this bucket's flag may travel in the hook's statistics all-reduce instead of one of its own.

    Only when nothing stateful runs between the check and that all-reduce: no layer transforms, no residuals
    (the hook then observes a monitored bucket's inputs only once it is known to be finite). Depends only on
    configuration and agreed state, never on rank-local state such as a monitor that lives on rank 0 only, so
    every rank takes the same path and issues the same collectives.
    """
    if state.nonfinite == "ignore" or state.step_nonfinite or state.transforms:
        return False
    return not any(state.compressor_for(n).uses_memory for n in names)


def local_flag(state: "GradCompState", buffer: Tensor) -> Tensor:
    """This rank's cheap flag (``rank + 1`` if its sum is not finite, else 0), to be max-reduced with others."""
    return _flag(buffer, _rank(state))


def bucket_is_nonfinite(
    state: "GradCompState", buffer: Tensor, grads: Sequence[Tensor], names: Sequence[str], worst: Optional[int] = None
) -> bool:
    """Whether this bucket must be skipped on every rank; raises in ``"raise"`` mode.

    Issues one all-reduce per bucket, and a second, exact one on every rank when some rank's cheap check
    fired (none once the step is already known to be skipped: that decision is the same on every rank, so
    every rank leaves it out). ``worst``: the max over ranks of :func:`local_flag`, when it was already reduced
    in another collective (:func:`can_share_collective`); then no first all-reduce is issued here.
    """
    if state.nonfinite == "ignore":
        return False
    if state.step_nonfinite:
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
    if state.nonfinite == "raise":
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
    return True


def _nonfinite_names(named_grads: Iterable[tuple[str, Optional[Tensor]]]) -> list[str]:
    return [n for n, g in named_grads if g is not None and not bool(torch.isfinite(g).all())]


def _skip_step(state: "GradCompState") -> None:
    """Mark the step skipped on this rank (every rank decides the same) and roll back its residuals."""
    state.step_nonfinite = True
    state.skipped_steps += 1
    for name, old in state.residual_undo.items():
        if old is None:
            state.memory.residuals.pop(name, None)
        else:
            state.memory.residuals[name] = old
    state.residual_undo.clear()
    return True


def drop_skipped_gradients(
    state: "GradCompState", seen: int, named_parameters: Iterable[tuple[str, Tensor]], has_scaler: bool
) -> int:
    """After backward: check what was decoded (:func:`end_backward`), then, if the hook skipped a step since ``seen``
    skips, make the optimizer step a no-op.

    Every gradient is dropped (``p.grad = None``: optimizers skip such parameters, so no update, momentum or decay),
    except under a ``GradScaler``, which skips the step itself on the NaN-filled buckets and lowers its scale.
    Called by the Trainer and the Fabric strategy alike; returns the count to pass as ``seen`` next time.
    """
    named = list(named_parameters)
    end_backward(state, ((n, p.grad) for n, p in named))
    if state.skipped_steps == seen:
        return seen
    log.warning("gradcomp: non-finite gradient on some rank; step skipped on every rank (%d so far)", state.skipped_steps)
    if not has_scaler:
        for _, p in named:
            p.grad = None
    return state.skipped_steps


def observe_decoded(state: "GradCompState", buffer: Tensor) -> None:
    """After a bucket was decoded into ``buffer``: keep its cheap non-finite flag for :func:`end_backward`.

    Every rank decodes the same payloads into the same bits, so every rank keeps the same flags: no collective.
    The flag stays a tensor (no host sync); a list append, because buckets may be decoded on several threads.
    """
    if state.nonfinite != "ignore" and not state.step_nonfinite:
        state.decoded_flags.append(_flag(buffer, 0))


def end_backward(state: "GradCompState", named_grads: Iterable[tuple[str, Optional[Tensor]]]) -> bool:
    """At the end of a backward pass: skip (or raise for) a step whose decoded gradients are non-finite although
    every rank's input was finite, and count consecutive skipped steps. Returns whether the step is skipped.

    Identical on every rank (same decoded bits, same counters), so every rank skips or raises together. A backward
    without the hook (gradient accumulation) changes nothing. Raises :class:`NonFiniteGradientError` in
    ``"raise"`` mode, and in any mode after :data:`RAISE_AFTER_SKIPS` consecutive skipped steps.
    """
    if state.hook_calls == state.counted_hook_calls:
        return False
    state.counted_hook_calls = state.hook_calls
    flags, state.decoded_flags = state.decoded_flags, []
    if flags and not state.step_nonfinite and bool(torch.stack(flags).max() > 0):
        bad = _nonfinite_names(named_grads)  # the cheap flag may be a float32 overflow of a finite sum
        if bad and state.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"Compression turned finite gradients into non-finite ones in {bad} (an overflow in the "
                f"compressor's encoding, e.g. fp16 beyond 65504 x world size); every rank stops here. Fix: lower the "
                f"learning rate, clip gradients before compression (SigmaClipping, LocalGradientClipping), or use "
                f"'bf16'/'fp32'; `nonfinite='skip'` skips such steps on every rank."
            )
        if bad:
            _skip_step(state)
    state.consecutive_skips = state.consecutive_skips + 1 if state.step_nonfinite else 0
    if state.consecutive_skips == WARN_AFTER_SKIPS:
        warnings.warn(
            f"gradcomp: the last {WARN_AFTER_SKIPS} steps were all skipped for non-finite gradients: the model is "
            f"not training. Causes: non-finite data or loss, a diverged model, or a compressor whose encoding "
            f"overflows (fp16 beyond 65504 x world size). Fix: lower the learning rate, clip gradients before "
            f"compression, or use 'bf16'/'fp32'. After {RAISE_AFTER_SKIPS} consecutive skipped steps every rank raises.",
            UserWarning,
            stacklevel=2,
        )
    if state.consecutive_skips >= RAISE_AFTER_SKIPS:
        raise NonFiniteGradientError(
            f"The last {state.consecutive_skips} steps were all skipped for non-finite gradients (on some rank, or "
            f"after compression); training made no progress, so every rank stops here. Fix: lower the learning rate, "
            f"check the data, clip gradients before compression, or use 'bf16'/'fp32' instead of 'fp16'."
        )
    return state.step_nonfinite
