"""Invalid configurations, contributed per module: each ``tests/bad_configs/<topic>.py`` defines ``BAD_CONFIGS``.

A compressor or callback author adds a file here (no shared file to edit); ``tests/unit/test_bad_input.py``
collects every module's list and checks that each case raises a ``ValueError`` naming the argument, the value
and the fix, before any training step (at construction, or at the setup step that precedes training).
"""

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BadConfig:
    """One invalid configuration.

    Attributes:
        id: short test id, unique across modules (prefix it with the module's topic).
        build: builds the configuration (or runs the setup step that validates it); must raise ``ValueError``.
        argument: the argument's name, which the message must contain.
        value: how the value appears in the message (usually its ``repr``).
    """

    id: str
    build: Callable[[], object]
    argument: str
    value: str


def collect() -> list[BadConfig]:
    """Every module's ``BAD_CONFIGS``, in module order."""
    cases: list[BadConfig] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        cases.extend(getattr(module, "BAD_CONFIGS", []))
    return cases
