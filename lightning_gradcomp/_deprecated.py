"""Deprecated spellings of public names that moved: each still resolves for one release, with a warning.

A package whose names moved defines ``__getattr__ = moved_names(__name__, {...})``: Python calls a module's
``__getattr__`` only for names the module does not hold, so the current names are untouched and an old one costs
nothing until a script spells it. The new place is imported only then, which is what lets an alias point into the
lab (``gradcomp_lab``) without the library importing the lab when it is imported itself.

Modules that moved into a subpackage (``lightning_gradcomp.hook`` is ``lightning_gradcomp.exchange.hook``) keep
their old import path the same way: :class:`MovedModules` resolves it to the module at its new place.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Optional


def moved_names(module: str, moves: Mapping[str, str], stacklevel: int = 2) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each moved name at its new place, with a ``DeprecationWarning``.

    Args:
        module: the module that held the names (its ``__name__``).
        moves: old name -> its new place as ``"package.module:Name"``.
        stacklevel: the warning's ``stacklevel`` (3 where the module's own ``__getattr__`` calls this one).

    Returns:
        The ``__getattr__`` to assign in ``module``; other unknown names raise ``AttributeError`` as usual.
    """

    def __getattr__(name: str) -> Any:
        target = moves.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, attribute = target.partition(":")
        # stacklevel 2 (3 through a module's own __getattr__): the warning points at the script's line, where
        # Python's default filter shows it
        warnings.warn(
            f"`{module}.{name}` moved to `{new_module}.{attribute}`; the old name is deprecated and will be removed "
            f"in the next release. Fix: `from {new_module} import {attribute}`.",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return getattr(importlib.import_module(new_module), attribute)

    return __getattr__


#: modules that moved into a subpackage: old dotted name -> new one
MOVED_MODULES: dict[str, str] = {
    f"lightning_gradcomp.{old}": f"lightning_gradcomp.{new}"
    for old, new in {
        **{m: f"exchange.{m}" for m in ("hook", "groups", "router", "ledger", "guard", "memory",
                                        "pipeline", "planner", "costmodel", "codec", "transport", "comm", "stats")},
        "segments": "flat", "bits": "wire.bits", "sparse": "wire.sparse", "hierarchy": "sites.hierarchy",
        **{m: f"strategies.{m}" for m in ("strategy", "fabric", "wiring", "resilience", "checkpoint", "replicas",
                                          "sharded", "shards", "towers", "presets")},
    }.items()
}


class _MovedModule(importlib.abc.Loader):
    """Loads an old module name as the module at its new place (the same object), with a ``DeprecationWarning``."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"`{self.old}` moved to `{self.new}`; the old module path is deprecated and will be removed in the next "
            f"release. Fix: `import {self.new}` (or import the name from `lightning_gradcomp`).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new place has run already


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED_MODULES` (pickles and scripts that import ``lightning_gradcomp.hook``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModule(fullname, new))


def install_moved_modules() -> None:
    """Let the old module paths import (once per process)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())  # before an editable install's finder, which maps the package
