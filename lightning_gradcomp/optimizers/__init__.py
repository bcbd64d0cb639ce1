"""Optimizers torch does not ship that a method prescribes.

* :class:`SignSGD`: DeMo's sign update.
* :class:`OneBitAdam` and :class:`ZeroOneAdam`: Adam with a frozen variance whose momentum (1-bit Adam) or
  accumulated update (0/1 Adam) is exchanged at one bit per element; they complete the ``"onebit_adam"`` and
  ``"zero_one_adam"`` strategies (:mod:`lightning_gradcomp.onebit_adam`).
"""

from lightning_gradcomp.optimizers.frozen_adam import OneBitAdam, ZeroOneAdam
from lightning_gradcomp.optimizers.sign import SignSGD

__all__ = ["OneBitAdam", "SignSGD", "ZeroOneAdam"]
