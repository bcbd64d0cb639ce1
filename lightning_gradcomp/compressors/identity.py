"""The identity compressor: fp32 gradients through our hook, the baseline every compressor is measured against."""

from typing import Optional

from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet


class Identity(Compressor):
    """Sends the gradient unchanged (summed by all-reduce), exactly like DDP's default hook.

    Also the path for tensors a strategy keeps in float (``exclude`` patterns, ``min_numel``).
    """

    aggregation = Aggregation.SUM

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        return Packet(payload=tensor.detach().reshape(-1), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, packet: Packet) -> Tensor:
        return packet.payload.view(packet.shape)

    def sent(self, tensor: Tensor, packet: Packet) -> Tensor:
        return tensor
