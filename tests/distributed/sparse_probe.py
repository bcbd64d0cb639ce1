"""A test-only sparse compressor whose payload size varies by rank (rank 1 may send nothing)."""

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.compressors.per_tensor import LayerLoop
from lightning_gradcomp.flat import Packet


class RankSparseProbe(LayerLoop):
    """Sends (int32 index, float32 value) pairs of the entries above a rank-dependent threshold."""

    aggregation = Aggregation.GATHER
    fixed_size = False

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1).float()
        threshold = float("inf") if self.rank == 1 else 0.0  # rank 1 sends an empty payload
        idx = torch.nonzero(flat.abs() > threshold).reshape(-1).to(torch.int32)
        payload = torch.cat((idx.view(torch.uint8), flat[idx.long()].view(torch.uint8)))
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, packet: Packet) -> Tensor:
        k = packet.payload.numel() // 8
        idx = packet.payload[: 4 * k].clone().view(torch.int32).long()
        val = packet.payload[4 * k :].clone().view(torch.float32)
        out = torch.zeros(packet.numel, dtype=torch.float32)
        out[idx] = val
        return out.to(packet.dtype).view(packet.shape)
