"""Names for compressors and the strategies registered in Lightning's ``StrategyRegistry``.

Lightning has no entry point for external strategies, so importing :mod:`lightning_gradcomp` registers
every name here (``Trainer(strategy="terngrad")``). Unknown names fail loudly: a typo never becomes a default.
"""

from collections.abc import Callable
from typing import Any

from lightning_gradcomp.compressors.adacomp import AdaComp
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.compressors.cast import BF16, FP16
from lightning_gradcomp.compressors.demo import DeMo
from lightning_gradcomp.compressors.onebit import OneBit
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.topk import DGC, TopK

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
    "demo": (DeMo, "DeMo: decoupled momentum, top-32 DCT coefficients per 64x64 chunk, all-gather; use SignSGD"),
}


def compressor_names() -> list[str]:
    """All registered compressor names."""
    return sorted(COMPRESSORS)


def make_compressor(name: str) -> Compressor:
    """A fresh compressor with the paper's defaults for a registered name."""
    key = name.lower()
    if key not in COMPRESSORS:
        raise ValueError(
            f"Expected `compressor` to be one of {compressor_names()}, but got {name!r}. "
            f"Fix: use a registered name or pass a Compressor instance."
        )
    return COMPRESSORS[key][0]()


def register_compressor(name: str, factory: Callable[[], Compressor], description: str) -> None:
    """Add a compressor name; call :func:`register_strategies` afterwards to expose it as a strategy."""
    COMPRESSORS[name.lower()] = (factory, description)


def register_strategies(strategy_cls: type, strategy_registry: Any = None) -> None:
    """Register every compressor name as a Lightning strategy name (lower-cased, as Lightning looks them up)."""
    if strategy_registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        strategy_registry = StrategyRegistry
    for name, (_, description) in COMPRESSORS.items():
        # the name, not an instance, goes into init_params: each Trainer must get a fresh, unshared compressor
        strategy_registry.register(name, strategy_cls, description=description, override=True, compressor=name)
