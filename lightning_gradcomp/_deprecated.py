"""Deprecated spellings of public names that moved: each still resolves for one release, with a warning.

A package whose names moved defines ``__getattr__ = moved_names(__name__, {...})``: Python calls a module's
``__getattr__`` only for names the module does not hold, so the current names are untouched and an old one costs
nothing until a script spells it. The new place is imported only then, which is what lets an alias point into the
lab (``gradcomp_lab``) without the library importing the lab when it is imported itself.
"""

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved_names(module: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each moved name at its new place, with a ``DeprecationWarning``.

    Args:
        module: the module that held the names (its ``__name__``).
        moves: old name -> its new place as ``"package.module:Name"``.

    Returns:
        The ``__getattr__`` to assign in ``module``; other unknown names raise ``AttributeError`` as usual.
    """

    def __getattr__(name: str) -> Any:
        target = moves.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, attribute = target.partition(":")
        # stacklevel 2: the warning points at the script's line, where Python's default filter shows it
        warnings.warn(
            f"`{module}.{name}` moved to `{new_module}.{attribute}`; the old name is deprecated and will be removed "
            f"in the next release. Fix: `from {new_module} import {attribute}`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_module), attribute)

    return __getattr__
