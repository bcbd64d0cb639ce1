"""1-bit SGD with error feedback (Seide et al., Interspeech 2014).

Each element is sent as its sign (one bit); the receiver reconstructs a positive element as the mean of the
group's non-negative values and a negative one as minus the mean magnitude of its negative values, the two
reconstruction values that minimise the squared quantization error for the given signs. What the bit did not
carry is kept per rank and added to the next gradient (error feedback), which is what makes 1 bit converge.

Groups: each row of the tensor viewed as ``[shape[0], -1]`` (``granularity="row"``, the default: one output
unit of a linear/conv layer; Seide et al. quantize per column of their weight matrices, i.e. per output unit
in their layout), or the whole tensor (``"tensor"``: fewer bytes, and on the digits benchmark clearly worse).

On the wire (exact): ``ceil(n / 8)`` bytes of signs plus two float32 reconstruction values per group.
"""

from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp.bits import pack_bits, packed_bits_nbytes, unpack_bits
from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet
from lightning_gradcomp.validation import check_choice

Granularity = Literal["tensor", "row"]


class OneBit(Compressor):
    """Sign plus two reconstruction values per group, bit-packed, with error feedback.

    Args:
        granularity: ``"row"`` (two values per row of ``tensor.view(shape[0], -1)``) or ``"tensor"`` (two values
            per tensor); 1-D tensors are one group either way.
    """

    aggregation = Aggregation.GATHER
    uses_memory = True

    def __init__(self, granularity: Granularity = "row") -> None:
        super().__init__()
        check_choice("granularity", granularity, ("tensor", "row"))
        self.granularity: Granularity = granularity

    def _groups(self, tensor: Tensor) -> Tensor:
        flat = tensor.detach().float()
        if self.granularity == "row" and flat.dim() > 1:
            return flat.reshape(flat.shape[0], -1)
        return flat.reshape(1, -1)

    def _num_groups(self, shape: torch.Size) -> int:
        return shape[0] if self.granularity == "row" and len(shape) > 1 else 1

    def payload_nbytes(self, numel: int, num_groups: int = 1) -> int:
        """Exact bytes of one packet: the sign bits and two float32 values per group."""
        return packed_bits_nbytes(numel, 1) + 8 * num_groups

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        groups = self._groups(tensor)
        positive = groups >= 0
        count_pos = positive.sum(dim=1)
        count_neg = groups.shape[1] - count_pos
        sum_pos = torch.where(positive, groups, 0.0).sum(dim=1)
        sum_neg = torch.where(positive, 0.0, -groups).sum(dim=1)
        # an empty side never gets decoded; clamp the count only to avoid 0/0
        mean_pos = sum_pos / count_pos.clamp(min=1)
        mean_neg = sum_neg / count_neg.clamp(min=1)
        scales = torch.stack((mean_pos, mean_neg), dim=1).reshape(-1)  # [pos0, neg0, pos1, neg1, ...]
        payload = torch.cat((pack_bits(positive, 1), scales.view(torch.uint8)))
        stats = {"scale": torch.maximum(mean_pos, mean_neg).max()}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    def decompress(self, packet: Packet) -> Tensor:
        n = packet.numel
        nbits = packed_bits_nbytes(n, 1)
        positive = unpack_bits(packet.payload[:nbits], n, 1).bool()
        # clone: a slice at an odd byte offset cannot be reinterpreted as float32 in place
        scales = packet.payload[nbits:].clone().view(torch.float32).view(-1, 2)
        groups = positive.view(scales.shape[0], -1)
        out = torch.where(groups, scales[:, :1], -scales[:, 1:])
        return out.to(packet.dtype).view(packet.shape)

    def describe(self) -> dict[str, Any]:
        return {"compressor": "OneBit", "granularity": self.granularity}
