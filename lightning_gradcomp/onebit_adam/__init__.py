"""1-bit Adam and 0/1 Adam: strategies, and the two-stage compressed all-reduce their optimizers exchange through.

``Trainer(strategy="onebit_adam")`` with :class:`~lightning_gradcomp.optimizers.OneBitAdam`, or
``strategy="zero_one_adam"`` with :class:`~lightning_gradcomp.optimizers.ZeroOneAdam` (see ``docs/onebit_adam.md``).
"""

from lightning_gradcomp.onebit_adam.exchange import CompressedAllReduce
from lightning_gradcomp.onebit_adam.strategy import OneBitAdamStrategy, ZeroOneAdamStrategy

__all__ = ["CompressedAllReduce", "OneBitAdamStrategy", "ZeroOneAdamStrategy"]
