"""Argument checks with one wording: the argument, the value, what was expected and how to fix it.

Every public constructor validates eagerly with these helpers, so a bad configuration fails before any
process group exists and never gets silently clamped.
"""

import difflib
import math
from collections.abc import Iterable
from typing import Any, Optional, Union


def _fail(name: str, value: Any, expected: str, fix: Optional[str]) -> ValueError:
    # every message carries a fix; without a specific one, the expectation itself is the fix
    return ValueError(f"Expected `{name}` to be {expected}, but got {value!r}. Fix: {fix or 'pass ' + expected}.")


def check_number(
    name: str,
    value: Any,
    *,
    minimum: Optional[float] = None,
    maximum: Optional[float] = None,
    min_open: bool = False,
    max_open: bool = False,
    fix: Optional[str] = None,
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number within the given bounds."""
    lo = "" if minimum is None else ("> " if min_open else ">= ") + f"{minimum:g}"
    hi = "" if maximum is None else ("< " if max_open else "<= ") + f"{maximum:g}"
    expected = "a finite number" + (f" {lo}" if lo else "") + (" and" if lo and hi else "") + (f" {hi}" if hi else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, value, expected, fix)
    if minimum is not None and (value <= minimum if min_open else value < minimum):
        raise _fail(name, value, expected, fix)
    if maximum is not None and (value >= maximum if max_open else value > maximum):
        raise _fail(name, value, expected, fix)


def check_int(name: str, value: Any, *, minimum: Optional[int] = None, fix: Optional[str] = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a bool) at least ``minimum``."""
    expected = "an integer" + ("" if minimum is None else f" >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, expected, fix)
    if minimum is not None and value < minimum:
        raise _fail(name, value, expected, fix)


#: what fixes a bad ``dense_steps``, in every message about it
_DENSE_FIX = ("pass a number of steps (an int >= 0; 0 compresses from the first step) or a fraction of the run "
              "strictly between 0 and 1, e.g. 0.05")


def check_dense_steps(name: str, value: object, minimum: int = 0, fix: str = _DENSE_FIX) -> None:
    """Raise ``ValueError`` unless ``value`` is a number of steps (an ``int`` >= ``minimum``) or a fraction of the
    run (a ``float`` strictly between 0 and 1): a preset's or a schedule's dense steps, 1-bit Adam's warm-up
    (``minimum`` 1: the variance must see a gradient before it is frozen). ``fix`` says what to pass instead.

    A float of 1 or more is refused rather than read as steps: ``100.0`` is more likely a typo for ``100`` than a
    fraction, and guessing would be a silent change of meaning.
    """
    if isinstance(value, float) and math.isfinite(value) and 0 < value < 1:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return
    raise ValueError(f"Expected `{name}` to be an int >= {minimum} (steps) or a float in (0, 1) (a fraction of the "
                     f"run), but got {value!r}. Fix: {fix}.")


def run_steps(trainer: Any) -> float:
    """A Trainer's run length in optimizer steps: ``max_steps`` when set, else the steps of ``max_epochs``
    (``estimated_stepping_batches``; ``inf`` for a run without end). What a warm-up given as a fraction of the run
    is a fraction of (a preset's dense steps, 1-bit Adam's ``freeze_step``)."""
    return float(trainer.max_steps if trainer.max_steps >= 0 else trainer.estimated_stepping_batches)


def fraction_of_run(fraction: float, total_steps: float) -> int:
    """``fraction`` of a run of ``total_steps`` optimizer steps, in whole steps and at least one (a warm-up given as
    a fraction is never none): 0.05 of 200 steps is 10, of 2000 is 100."""
    return max(1, round(fraction * total_steps))


def resolve_dense_steps(dense_steps: Union[int, float], total_steps: float, name: str = "dense_steps",
                        minimum: int = 0, in_steps: Optional[str] = None) -> int:
    """The number of dense first steps: ``dense_steps`` itself when it is an int, else that fraction of
    ``total_steps`` (:func:`run_steps`; :func:`fraction_of_run`). ``minimum`` as in :func:`check_dense_steps`;
    ``in_steps``: how to give ``name`` in steps, for the error of a run without an end (default: a
    ``CompressionSchedule``'s).

    Raises:
        ValueError: ``dense_steps`` is neither, or a fraction is given for a run without an end.
    """
    check_dense_steps(name, dense_steps, minimum)
    if isinstance(dense_steps, int):
        return dense_steps
    if isinstance(total_steps, bool) or not math.isfinite(total_steps) or total_steps < 1:
        in_steps = in_steps or ("pass the dense steps as a number of steps, e.g. `CompressionSchedule(dense_steps=100)` "
                                "among the Trainer's callbacks (a preset then uses it)")
        raise ValueError(
            f"Expected a run with a known number of steps for `{name}={dense_steps!r}` (a fraction of the run), but "
            f"got {total_steps!r} steps (no `max_steps` nor `max_epochs`). Fix: set `Trainer(max_steps=...)`, or "
            f"{in_steps}."
        )
    return fraction_of_run(dense_steps, total_steps)


def check_choice(name: str, value: Any, choices: Iterable[str], fix: Optional[str] = None) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise _fail(name, value, "one of " + ", ".join(repr(c) for c in options), fix or f"pick one of {options}")


def check_bool(name: str, value: Any, fix: Optional[str] = None) -> None:
    """Raise ``ValueError`` unless ``value`` is a ``bool``: the string ``"false"`` is truthy, so never coerce."""
    if not isinstance(value, bool):
        raise _fail(name, value, "True or False", fix or f"pass the bool itself, e.g. `{name}=False` (a string such as 'false' is truthy)")


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of ``choices`` (difflib), or ``""``."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


class UnknownOptionError(TypeError, ValueError):
    """An unknown keyword argument: a ``TypeError`` as Python raises for one, and a ``ValueError`` like every other
    bad configuration here, so both ``except`` clauses catch it."""


def check_options(owner: str, given: Iterable[str], valid: Iterable[str], values: Optional[dict[str, Any]] = None) -> None:
    """Raise :class:`UnknownOptionError` naming the first of ``given`` not in ``valid``, the closest valid option
    (:func:`did_you_mean`) and the valid options.

    Args:
        owner: the class the options were passed to, e.g. ``"TernGrad"``.
        given: the keyword names passed.
        valid: the names ``owner`` accepts.
        values: the passed values by name, to show the offending one.
    """
    options = list(valid)
    unknown = [name for name in given if name not in options]
    if unknown:
        name = unknown[0]
        shown = f"{name}={(values or {}).get(name)!r}" if values and name in values else name
        raise UnknownOptionError(
            f"Expected `{name}` to be an option of {owner}, but got {shown}"
            + (f" (also unknown: {unknown[1:]})" if unknown[1:] else "")
            + f". Fix: {did_you_mean(name, options)}{owner}'s options are {options}."
        )
