"""A test-only top-k compressor with error feedback and a per-layer schedule: state that a resume must restore."""

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.compressors.per_tensor import LayerLoop
from lightning_gradcomp.flat import Packet


class MemoryProbe(LayerLoop):
    """Sends the largest entries (a fraction that shrinks after the first steps) as (int32 index, float32 value).

    Deterministic on purpose: with error feedback, a resume that lost the residuals or the per-layer step
    counts would send different entries, so exact-resume tests see it.
    """

    aggregation = Aggregation.GATHER
    uses_memory = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def _k(self, name: str, numel: int) -> int:
        fraction = 0.5 if self.calls.get(name, 0) < 3 else 0.1  # a schedule driven by per-layer state
        return max(1, int(numel * fraction))

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1).float()
        k = self._k(name, flat.numel())
        self.calls[name] = self.calls.get(name, 0) + 1
        idx = flat.abs().topk(k, sorted=True).indices.to(torch.int32)
        payload = torch.cat((idx.view(torch.uint8), flat[idx.long()].view(torch.uint8)))
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, packet: Packet) -> Tensor:
        k = packet.payload.numel() // 8
        idx = packet.payload[: 4 * k].clone().view(torch.int32).long()
        val = packet.payload[4 * k :].clone().view(torch.float32)
        out = torch.zeros(packet.numel, dtype=torch.float32, device=packet.payload.device)
        out[idx] = val
        return out.to(packet.dtype).view(packet.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = dict(state.get("calls", {}))
