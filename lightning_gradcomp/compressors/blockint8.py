"""Blockwise int8: each block of a layer travels as int8 codes rounded to nearest, with its own fp32 scale.

ZeRO++'s qgZ quantizes the gradient pieces of its hierarchical reduce-scatter this way: a block of ``block_size``
elements maps its largest magnitude to 127, so a block of small values keeps its precision beside a block of large
ones. Each rank's scale travels with its codes, so packets are gathered and decoded one by one (the owner of a piece
sums the decoded pieces); what the rounding dropped is kept as the residual of the error feedback.

Not a registered name: the compressed reduce-scatter across nodes
(:class:`~lightning_gradcomp.strategies.fsdp_collectives.CompressedReduceScatter`) runs it for ``"int8"``.
"""

from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.validation import check_int

#: the largest int8 code: a block's largest magnitude maps to it
INT8_MAX = 127
#: bytes of one block's scale (fp32)
_SCALE_BYTES = 4


class BlockInt8(Compressor):
    """Int8 codes rounded to nearest, one fp32 scale per block of ``block_size`` elements of each layer.

    Args:
        block_size: elements per scale; a layer's last block may be shorter, a layer smaller than a block is one.
        error_feedback: keep what the rounding dropped and add it back to the next gradient.
    """

    aggregation = Aggregation.GATHER

    def __init__(self, block_size: int = 256, error_feedback: bool = True) -> None:
        super().__init__()
        check_int("block_size", block_size, minimum=1, fix="use e.g. 256 elements per int8 scale")
        self.block_size = block_size
        self.uses_memory = bool(error_feedback)

    def blocks(self, numel: int) -> int:
        """Blocks (scales) of a layer of ``numel`` elements."""
        return -(-numel // self.block_size)

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of one layer's packet: a code per element and a scale per block."""
        return numel + _SCALE_BYTES * self.blocks(numel)

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        x = flat.detach().float()
        parts = []
        for n, start in zip(segments.numels, segments.offsets):
            codes, scales = self._quantize(x[start : start + n])
            parts += [codes.view(torch.uint8), scales.view(torch.uint8)]
        payload = torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.uint8)
        sizes = tuple(self.payload_nbytes(n) for n in segments.numels)
        return FlatPacket(payload, segments, flat.dtype, sizes)

    def _quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """int8 codes ``[n]`` and fp32 scales ``[blocks]`` of one layer (a non-finite block's scale is non-finite:
        its decode is too, as the dense gradient would be)."""
        n, block = x.numel(), self.block_size
        padded = self.blocks(n) * block
        blocks = torch.nn.functional.pad(x, (0, padded - n)).view(-1, block)
        scales = blocks.abs().amax(dim=1)
        inverse = torch.where(scales > 0, INT8_MAX / scales.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        codes = torch.round(blocks * inverse.unsqueeze(1)).to(torch.int8)
        return codes.view(-1)[:n], scales

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        payload, parts, offset = packet.payload, [], 0
        for n in packet.segments.numels:
            nb = self.blocks(n)
            codes = payload[offset : offset + n].view(torch.int8)
            # the scales may sit at any byte offset of a received buffer: copied before they are read as fp32
            scales = payload[offset + n : offset + n + _SCALE_BYTES * nb].clone().view(torch.float32)
            step = (scales / INT8_MAX).repeat_interleave(self.block_size)[:n]
            parts.append(codes.float() * step)
            offset += n + _SCALE_BYTES * nb
        out = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else payload.new_zeros(0, dtype=torch.float32)
        return out.to(packet.dtype)

    @override
    def describe(self) -> dict[str, Any]:
        return {"compressor": type(self).__name__, "block_size": self.block_size, "error_feedback": self.uses_memory}
