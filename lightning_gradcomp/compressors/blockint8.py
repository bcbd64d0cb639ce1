"""Blockwise int8 and int4: each block of a layer travels as codes rounded to nearest, with its own fp32 scale.

ZeRO++'s qgZ quantizes the gradient pieces of its hierarchical reduce-scatter this way (in int4): a block of
``block_size`` elements maps its largest magnitude to the largest code (127 in int8, 7 in int4: symmetric levels), so
a block of small values keeps its precision beside a block of large ones. int4 packs two codes per byte. Each rank's
scale travels with its codes, so packets are gathered and decoded one by one (the owner of a piece sums the decoded
pieces); what the rounding dropped is kept as the residual of the error feedback.

Not a registered name: the compressed reduce-scatter across nodes
(:class:`~lightning_gradcomp.strategies.fsdp_collectives.CompressedReduceScatter`) runs it for ``"int8"``; int4 is
passed as an instance, ``compressor=BlockInt8(bits=4)``.
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
#: the largest int4 code (levels -7 .. 7, symmetric as int8's)
INT4_MAX = 7
#: the largest code of each width
_CODE_MAX = {8: INT8_MAX, 4: INT4_MAX}
#: added to an int4 code to store it as a nibble (0 .. 15)
_NIBBLE_OFFSET = 8
#: bytes of one block's scale (fp32)
_SCALE_BYTES = 4


class BlockInt8(Compressor):
    """Int8 (or int4) codes rounded to nearest, one fp32 scale per block of ``block_size`` elements of each layer.

    Args:
        block_size: elements per scale; a layer's last block may be shorter, a layer smaller than a block is one.
        error_feedback: keep what the rounding dropped and add it back to the next gradient.
        bits: 8 (a code per byte, levels -127 .. 127) or 4 (two codes per byte, levels -7 .. 7: ZeRO++'s qgZ).

    Raises:
        ValueError: ``block_size`` below 1, ``bits`` neither 8 nor 4.
    """

    aggregation = Aggregation.GATHER

    def __init__(self, block_size: int = 256, error_feedback: bool = True, bits: int = 8) -> None:
        super().__init__()
        check_int("block_size", block_size, minimum=1, fix="use e.g. 256 elements per int8 scale")
        if isinstance(bits, bool) or bits not in _CODE_MAX:
            raise ValueError(
                f"Expected `bits` to be 8 or 4 (the width of a code), but got {bits!r}. Fix: pass `bits=8` (int8) or "
                f"`bits=4` (int4, two codes per byte)."
            )
        self.block_size = block_size
        self.uses_memory = bool(error_feedback)
        self.bits = bits
        self.code_max = _CODE_MAX[bits]

    def blocks(self, numel: int) -> int:
        """Blocks (scales) of a layer of ``numel`` elements."""
        return -(-numel // self.block_size)

    def code_nbytes(self, numel: int) -> int:
        """Bytes of one layer's codes: one per element in int8, one per two in int4 (an odd layer's last half
        empty)."""
        return numel if self.bits == 8 else -(-numel // 2)

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of one layer's packet: its codes and a scale per block."""
        return self.code_nbytes(numel) + _SCALE_BYTES * self.blocks(numel)

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        x = flat.detach().float()
        parts = []
        for n, start in zip(segments.numels, segments.offsets):
            codes, scales = self._quantize(x[start : start + n])
            parts += [self._pack(codes), scales.view(torch.uint8)]
        payload = torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.uint8)
        sizes = tuple(self.payload_nbytes(n) for n in segments.numels)
        return FlatPacket(payload, segments, flat.dtype, sizes)

    def _quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """int8 codes ``[n]`` (within the width's levels) and fp32 scales ``[blocks]`` of one layer (a non-finite
        block's scale is non-finite: its decode is too, as the dense gradient would be)."""
        n, block = x.numel(), self.block_size
        padded = self.blocks(n) * block
        blocks = torch.nn.functional.pad(x, (0, padded - n)).view(-1, block)
        scales = blocks.abs().amax(dim=1)
        inverse = torch.where(scales > 0, self.code_max / scales.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        codes = torch.round(blocks * inverse.unsqueeze(1)).to(torch.int8)
        return codes.view(-1)[:n], scales

    def _pack(self, codes: Tensor) -> Tensor:
        """The codes' bytes: as they are in int8; in int4 two nibbles per byte, element ``2i`` in the low one."""
        if self.bits == 8:
            return codes.view(torch.uint8)
        nibbles = (codes + _NIBBLE_OFFSET).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), _NIBBLE_OFFSET)])
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _unpack(self, raw: Tensor, n: int) -> Tensor:
        """The ``n`` codes of :meth:`_pack`'s bytes, as floats."""
        if self.bits == 8:
            return raw.view(torch.int8).float()
        nibbles = torch.stack([raw & 0xF, raw >> 4], dim=1).view(-1)[:n]
        return nibbles.float() - _NIBBLE_OFFSET

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        payload, parts, offset = packet.payload, [], 0
        for n in packet.segments.numels:
            nb, nc = self.blocks(n), self.code_nbytes(n)
            codes = self._unpack(payload[offset : offset + nc], n)
            # the scales may sit at any byte offset of a received buffer: copied before they are read as fp32
            scales = payload[offset + nc : offset + nc + _SCALE_BYTES * nb].clone().view(torch.float32)
            step = (scales / self.code_max).repeat_interleave(self.block_size)[:n]
            parts.append(codes * step)
            offset += nc + _SCALE_BYTES * nb
        out = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else payload.new_zeros(0, dtype=torch.float32)
        return out.to(packet.dtype)

    @override
    def describe(self) -> dict[str, Any]:
        return {"compressor": type(self).__name__, "block_size": self.block_size, "error_feedback": self.uses_memory,
                "bits": self.bits}
