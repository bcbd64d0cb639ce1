"""The hook's per-parameter error-feedback sequence in one process, for unit tests of compressors with memory."""

from typing import Optional

from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, Packet
from lightning_gradcomp.memory import ResidualMemory


def feedback_step(
    compressor: Compressor, memory: ResidualMemory, grad: Tensor, name: str
) -> tuple[Optional[Tensor], Tensor, Packet, Tensor]:
    """What :func:`~lightning_gradcomp.hook.gradcomp_hook` does for one parameter, in the same order.

    Returns the old residual (``None`` on the first step), the compensated tensor, the packet and what it sent.
    """
    old = memory.residuals.get(name)
    old = None if old is None else old.clone()
    compressor.observe_gradient(grad, name)
    x = memory.compensate(grad, name)
    packet = compressor.compress(x, name)
    sent = compressor.sent(x, packet)
    memory.update(name, x, sent)
    return old, x, packet, sent
