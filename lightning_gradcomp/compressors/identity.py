"""The identity compressor: fp32 gradients through our hook, the baseline every compressor is measured against."""

from typing import Optional

from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments


class Identity(Compressor):
    """Sends the gradient unchanged (summed by all-reduce), exactly like DDP's default hook.

    Also the path for tensors a strategy keeps in float (``exclude`` patterns, ``min_numel``).
    """

    aggregation = Aggregation.SUM
    batched = True

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        width = flat.element_size()
        return FlatPacket(flat.detach(), segments, flat.dtype, tuple(n * width for n in segments.numels))

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        return packet.payload

    @override
    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return flat
