"""The hook's error-feedback sequence for one layer, in one process, for unit tests of compressors with memory.

The hook runs the same sequence per group of layers with the flat methods; ``tests/unit/test_flat_*.py`` compare
each compressor's group path with its per-layer methods, which this helper drives.
"""

from typing import Optional

from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.compressors.per_tensor import per_tensor


def feedback_step(
    compressor: Compressor, memory: ResidualMemory, grad: Tensor, name: str
) -> tuple[Optional[Tensor], Tensor, Packet, Tensor]:
    """What :func:`~lightning_gradcomp.exchange.hook.gradcomp_hook` does for a group, for one parameter, in the same order.

    Returns the old residual (``None`` on the first step), the compensated tensor, the packet and what it sent.
    """
    old = memory.residuals.get(name)
    old = None if old is None else old.clone()
    per_tensor(compressor).observe_gradient(grad, name)
    x = memory.compensate(grad, name)
    packet = per_tensor(compressor).compress(x, name)
    sent = per_tensor(compressor).sent(x, packet)
    memory.update(name, x, sent)
    return old, x, packet, sent
