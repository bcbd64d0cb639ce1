"""What every per-layer oracle shares: its group methods are the base class's loop over its per-layer methods.

An oracle subclasses the library's compressor (for its settings and state) and puts :class:`LayerLoop` first, so
the library's group code is bypassed and a group is compressed, decoded and fed back one layer at a time.
"""

from collections.abc import Sequence
from typing import Optional

from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Packet, Segments


class LayerLoop(Compressor):
    """The group methods of :class:`Compressor` (a loop over the layers), ahead of a subclass's group code."""

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return Compressor.flat_statistic(self, flat, segments)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        return Compressor.compress_flat(self, flat, segments, shared)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        return Compressor.decompress_flat(self, packet)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        return Compressor.decompress_flat_mean_into(self, packets, out)

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return Compressor.sent_flat(self, flat, packet)

    def sent(self, tensor: Tensor, packet: Packet) -> Tensor:
        return self.decompress(packet)
