"""Names for compressors and the strategies registered in Lightning's ``StrategyRegistry``.

Lightning has no entry point for external strategies, so importing :mod:`lightning_gradcomp` registers
every name here (``Trainer(strategy="terngrad")``). Unknown names fail loudly: a typo never becomes a default.
"""

from collections.abc import Callable
from typing import Any, Optional, Protocol, Union

from lightning_gradcomp.compressors.adacomp import AdaComp
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.int8 import Int8
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.compressors.cast import BF16, FP16
from lightning_gradcomp.compressors.demo import DeMo
from lightning_gradcomp.compressors.onebit import OneBit
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.topk import DGC, TopK
from lightning_gradcomp.validation import did_you_mean  # public here too (presets, the CLI)

#: registered name -> (factory of a fresh compressor, one-line description)
COMPRESSORS: dict[str, tuple[Callable[[], Compressor], str]] = {
    "terngrad": (TernGrad, "TernGrad: stochastic ternary gradients, shared layer-wise scalers, 2.5-sigma clipping"),
    "fp32": (Identity, "fp32 gradients through the gradcomp hook (the identity compressor)"),
    "graddrop": (GradientDropping, "Gradient Dropping: drop the 99% smallest |g| into a residual, send the rest sparse"),
    "adacomp": (AdaComp, "AdaComp: per-bin soft-threshold selection, sign x layer scale, 8/16-bit bin-relative wire"),
    "fp16": (FP16, "fp16 gradients summed by all-reduce (as torch's fp16_compress_hook)"),
    "bf16": (BF16, "bf16 gradients summed by all-reduce (as torch's bf16_compress_hook)"),
    "powersgd": (PowerSGD, "PowerSGD: rank-1 power iteration, warm start, error feedback; no .then() collectives"),
    "topk": (TopK, "Top-k sparsification (0.1% kept) with error feedback"),
    "dgc": (DGC, "Deep Gradient Compression's sampled top-k threshold (0.1% kept), error feedback"),
    "onebit": (OneBit, "1-bit SGD with error feedback: sign + two reconstruction values per row, bit-packed"),
    "qsgd": (QSGD, "QSGD: 7 stochastic levels per 512-element bucket, unbiased, 4 bits per element"),
    "int8": (Int8, "int8 with a scale shared by all ranks, stochastic rounding, summed by an int8 all-reduce (INTELLECT-1)"),
    "demo": (DeMo, "DeMo: decoupled momentum, top-32 DCT coefficients per 64x64 chunk, all-gather; use SignSGD"),
}


def compressor_names() -> list[str]:
    """All registered compressor names."""
    return sorted(COMPRESSORS)


def make_compressor(name: str, argument: str = "compressor") -> Compressor:
    """A fresh compressor with the paper's defaults for a registered name.

    Args:
        name: a registered compressor name (any case).
        argument: the argument ``name`` was given as, named by the error for an unknown name.
    """
    key = name.lower()
    if key not in COMPRESSORS:
        raise ValueError(
            f"Expected `{argument}` to be one of {compressor_names()}, but got {name!r}. "
            f"Fix: {did_you_mean(name, compressor_names())}use a registered name or pass a Compressor instance."
        )
    return COMPRESSORS[key][0]()


def resolve_compressor(value: Union[Compressor, str], argument: str = "compressor") -> Compressor:
    """``value`` itself when it is a :class:`Compressor`, a fresh one for a registered name; an error naming
    ``argument`` (the argument ``value`` was given as) otherwise."""
    compressor = make_compressor(value, argument) if isinstance(value, str) else value
    if not isinstance(compressor, Compressor):
        raise ValueError(
            f"Expected `{argument}` to be a Compressor or a registered name, but got {value!r}. "
            f"Fix: use one of {compressor_names()}."
        )
    return compressor


def register_compressor(name: str, factory: Callable[[], Compressor], description: str) -> None:
    """Add a compressor name; call :func:`register_strategies` afterwards to expose it as a strategy."""
    COMPRESSORS[name.lower()] = (factory, description)


class NamedStrategy(Protocol):
    """A strategy (Trainer or Fabric) whose class carries the name it is registered under by default."""

    strategy_name: str


#: suffix of the fork-started variant of every name, for notebooks (as Lightning's ``ddp_notebook``)
NOTEBOOK_SUFFIX = "_notebook"


def register_preset(name: str, strategy_cls: type, description: str, strategy_registry: Any = None,
                    notebook: bool = True, **init_params: Any) -> None:
    """Register one strategy name with fixed ``init_params``, and its fork-started ``<name>_notebook`` (unless
    ``notebook=False``: a strategy without a ``start_method``), in the Trainer's ``StrategyRegistry`` (default) or
    the one given."""
    if strategy_registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        strategy_registry = StrategyRegistry
    strategy_registry.register(name, strategy_cls, description=description, override=True, **init_params)
    if "preset" in init_params:  # a measured setting's name (lightning_gradcomp.strategies.presets): one of strategy_names()
        _PRESET_NAMES.add(name)
    if notebook:
        strategy_registry.register(name + NOTEBOOK_SUFFIX, strategy_cls, description=f"{description}; processes "
                                   "forked (for notebooks)", override=True, start_method="fork", **init_params)


def register_strategies(strategy_cls: type[NamedStrategy], strategy_registry: Any = None, prefix: str = "",
                        notebook: bool = True) -> None:
    """Register every compressor name as a strategy name (lower-cased, as Lightning looks them up).

    Each name also gets a ``<name>_notebook`` variant with ``start_method="fork"``: the only start method
    Lightning accepts in an interactive session (``spawn`` and ``popen`` re-run a script file).
    ``strategy_registry`` is the Trainer's ``StrategyRegistry`` by default, or Fabric's ``STRATEGY_REGISTRY``.
    ``prefix`` goes before each compressor name (``"sharded_"``: ``"sharded_terngrad"``); ``notebook=False``
    registers no ``_notebook`` variants (a strategy without a ``start_method``).
    """
    if strategy_registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        strategy_registry = StrategyRegistry
    for name, (_, description) in COMPRESSORS.items():
        # the name, not an instance, goes into init_params: each Trainer must get a fresh, unshared compressor
        strategy_registry.register(prefix + name, strategy_cls, description=description, override=True,
                                   compressor=name)
        if notebook:
            strategy_registry.register(
                prefix + name + NOTEBOOK_SUFFIX,
                strategy_cls,
                description=f"{description}; processes forked (for notebooks)",
                override=True,
                compressor=name,
                start_method="fork",
            )
    # the class's own name (GradCompStrategy.strategy_name): the class with its defaults
    strategy_registry.register(
        strategy_cls.strategy_name, strategy_cls, description=f"{strategy_cls.__name__} with its defaults", override=True
    )


#: strategy names this package registers besides the compressor names (each but "gradcomp" also as `*_notebook`)
#: the presets' names, as lightning_gradcomp.strategies.presets registers them at import
_PRESET_NAMES: set[str] = set()
_OWN_STRATEGIES = ("gradcomp", "weightgrad", "diloco", "streaming_diloco", "onebit_adam", "zero_one_adam")


#: prefix of the sharded strategies' names (``"sharded_terngrad"``, ``"sharded_diloco"``; no ``*_notebook`` variants)
SHARDED_PREFIX = "sharded_"


def strategy_names() -> list[str]:
    """The strategy names ``import lightning_gradcomp`` registers in Lightning's ``StrategyRegistry``."""
    sharded = {SHARDED_PREFIX + n for n in (*COMPRESSORS, "gradcomp", "diloco", "streaming_diloco")}
    return sorted({*COMPRESSORS, *_OWN_STRATEGIES, *sharded, *_PRESET_NAMES})


def lightning_strategy_registry(fabric: bool) -> Any:
    """Lightning's strategy registry: Fabric's ``STRATEGY_REGISTRY`` or the Trainer's ``StrategyRegistry``."""
    if fabric:
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        return STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    return StrategyRegistry


def fabric_strategy_names() -> list[str]:
    """This package's strategy names that ``Fabric(strategy=name)`` runs (its ``_notebook`` variants aside), as
    registered in Fabric's registry: the Trainer-only names are registered there too, as a function that raises."""
    fabric = lightning_strategy_registry(fabric=True)
    return [n for n in strategy_names() if n in fabric and isinstance(fabric[n]["strategy"], type)]


def strategy_name_error(name: str, fabric: bool = False) -> Optional[str]:
    """Why ``Trainer(strategy=name)`` (``Fabric(strategy=name)`` with ``fabric``) would fail, with the fix; ``None``
    when Lightning accepts the name.

    Lightning's own error lists only Lightning's names; this names ours too, suggests the closest name, and says when
    one of ours is used before ``import lightning_gradcomp`` registered it.
    """
    known = lightning_strategy_registry(fabric).available_strategies()
    if name.lower() == "auto" or name.lower() in known:  # Lightning looks the name up lower-cased
        return None
    if name.lower().removesuffix(NOTEBOOK_SUFFIX) in strategy_names():
        return (
            f"Expected `strategy` to be a registered name, but {name!r} is not registered yet. "
            f"Fix: `import lightning_gradcomp` before creating the {'Fabric' if fabric else 'Trainer'} (the import "
            f"registers {strategy_names()})."
        )
    # our `*_notebook` variants are ours too, not Lightning's
    lightning = sorted(n for n in known if n.removesuffix(NOTEBOOK_SUFFIX) not in strategy_names())
    ours = fabric_strategy_names() if fabric else strategy_names()
    # suggestions: every name that works here (under Fabric, not the Trainer-only ones), `*_notebook` variants too
    usable = sorted({*ours, *(n for n in known if n in lightning or n.removesuffix(NOTEBOOK_SUFFIX) in ours)})
    return (
        f"Expected `strategy` to be a registered strategy name, but got {name!r}. "
        f"Fix: {did_you_mean(name.lower(), usable)}use one of gradcomp's {ours} "
        f"(or `<name>{NOTEBOOK_SUFFIX}` for a notebook) or Lightning's {lightning}."
    )
