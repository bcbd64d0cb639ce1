"""Optional dependencies: import one, or fail with the ``pip install 'lightning_gradcomp[extra]'`` that fixes it.

The library (strategy, compressors, callbacks) and the lab's CLI need none of them; each extra of ``pyproject.toml``
serves one feature (``wandb``: W&B logging; ``report``: ``gradcomp report`` plots, in ``gradcomp_lab``).
"""

import importlib
from types import ModuleType


def missing_extra_message(module: str, extra: str, purpose: str) -> str:
    """The error text for ``purpose`` needing ``module`` from the ``extra`` extra, which is not installed."""
    return (
        f"Expected `{module}` to be installed for {purpose}, but it is not. "
        f"Fix: pip install 'lightning_gradcomp[{extra}]' (or `pip install {module}`)."
    )


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``; when it is missing, raise a ``ModuleNotFoundError`` naming the extra that installs it.

    Args:
        module: the module to import (``"wandb"``).
        extra: the ``lightning_gradcomp`` extra that installs it (``"wandb"``).
        purpose: what needs it, for the message (``"W&B logging"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModuleNotFoundError(missing_extra_message(module, extra, purpose), name=module) from exc
