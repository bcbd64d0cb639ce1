"""``Trainer(strategy=...)`` and ``Fabric(strategy=...)`` refused with this package's errors.

Lightning refuses a strategy name it does not know, and a strategy of the other API (the Trainer's
``GradCompStrategy`` given to Fabric), with one generic message ("You selected an invalid strategy name") that names
neither the closest name nor the class to use. Lightning has no hook for this, so importing :mod:`lightning_gradcomp`
wraps the one method of each connector that makes that check (``_check_config_and_set_final_flags``, the first use of
the argument when a ``Trainer`` or ``Fabric`` is constructed). The wrapper raises our error exactly where Lightning's
check would raise (the same registry, read at the same moment) and otherwise calls Lightning's method unchanged; a
strategy of Lightning's own stays with Lightning's message.
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any, Optional

import lightning_gradcomp.registry as registry

#: (module, class, whether it is Fabric's) of the connectors whose strategy check is wrapped
_CONNECTORS = (
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector", False),
    ("lightning.fabric.connector", "_Connector", True),
)
_METHOD = "_check_config_and_set_final_flags"
#: marks a wrapped method, so that importing twice (or reloading) never wraps it twice
_MARK = "_gradcomp_strategy_check"


def _strategy_base(fabric: bool) -> type:
    """The base class of Fabric's strategies or of the Trainer's."""
    if fabric:
        from lightning.fabric.strategies import Strategy as FabricStrategy

        return FabricStrategy
    from lightning.pytorch.strategies import Strategy as TrainerStrategy

    return TrainerStrategy


def _twin(cls: type, fabric: bool) -> Optional[tuple[str, Any]]:
    """For a strategy class of the other API that is ours (or a subclass of ours): the first name it is registered
    under in its own API's registry, and what the same name is in the wanted API's (a class, or the function that
    raises the Trainer-only error); ``None`` for a class that is not ours."""
    source, target = registry.lightning_strategy_registry(not fabric), registry.lightning_strategy_registry(fabric)
    ours = set(registry.strategy_names())
    for base in cls.__mro__:
        for name, data in source.items():
            if name in ours and data["strategy"] is base and name in target:
                return name, target[name]["strategy"]
    return None


def strategy_argument_error(strategy: object, fabric: bool) -> Optional[str]:
    """Our error for a ``strategy`` argument that the Trainer's (``Fabric``'s with ``fabric``) connector refuses
    with its generic message; ``None`` where Lightning accepts it, or refuses something that is not ours."""
    if isinstance(strategy, str):
        return registry.strategy_name_error(strategy, fabric=fabric)
    if isinstance(strategy, _strategy_base(fabric)) or not isinstance(strategy, _strategy_base(not fabric)):
        return None
    twin = _twin(type(strategy), fabric)
    if twin is None:
        return None
    name, target = twin
    given = type(strategy).__name__
    if fabric and not isinstance(target, type):
        from lightning_gradcomp.strategies.fabric import trainer_only_message

        return trainer_only_message(f"the Trainer's `{given}`", name, given)
    api, runner, other = ("Fabric", "Fabric", "the Trainer's") if fabric else ("Trainer", "the Trainer", "Fabric's")
    return (
        f"Expected `strategy` to be a {api} strategy (`lightning.{'fabric' if fabric else 'pytorch'}.strategies."
        f"Strategy`), but got {other} `{given}`, which {runner} cannot run. Fix: "
        f"`{api}(strategy={target.__name__}(...))` with the same arguments, or a registered name such as "
        f"`{api}(strategy={name!r})`."
    )


def _checked(original: Callable[..., None], fabric: bool) -> Callable[..., None]:
    """``original`` (a connector's ``_check_config_and_set_final_flags``), raising our error first."""

    @functools.wraps(original)
    def check_config_and_set_final_flags(self: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning passes every argument by keyword; a positional call is taken in its signature's order
        strategy = kwargs["strategy"] if "strategy" in kwargs else args[0] if args else "auto"
        error = strategy_argument_error(strategy, fabric)
        if error is not None:
            raise ValueError(error)
        original(self, *args, **kwargs)

    setattr(check_config_and_set_final_flags, _MARK, True)
    return check_config_and_set_final_flags


def install() -> None:
    """Wrap the strategy check of the Trainer's and Fabric's connectors (once). A Lightning without that method
    keeps its own messages."""
    for module_name, class_name, fabric in _CONNECTORS:
        connector = getattr(importlib.import_module(module_name), class_name, None)
        original = getattr(connector, _METHOD, None)
        if original is None or getattr(original, _MARK, False):
            continue
        setattr(connector, _METHOD, _checked(original, fabric))
