"""TernGrad's fused backend: the same maths as :class:`~lightning_gradcomp.compressors.TernGrad` through
:mod:`lightning_gradcomp.kernels`.

Differences from the torch backend, and why they are safe:

* Random stream: a counter-based hash of (seed, rank, parameter name, per-name counter, element index)
  instead of ``torch.Generator``. Same Bernoulli probabilities (``u * s < min(|g|, clip)`` with a 24-bit
  uniform u), different draws. Its whole state is the per-name counters.
* sigma from one float64 pass (sum and sum of squares) instead of ``torch.std``: agrees to ~1e-6 relative;
  the scaler is max-reduced over ranks anyway, so a rank's own rounding never desynchronises replicas.
* Decoding gives exactly the torch backend's bits, so ranks on different backends still agree.
* ``local_statistic`` keeps the statistics it computed for ``compress`` (keyed by name, checked against the
  tensor's identity and version), so the hook's statistic + compress reads the gradient twice, not three times.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.base import Aggregation, Packet
from lightning_gradcomp.kernels.rng import stream_id, stream_key
from lightning_gradcomp.wire import pack_ternary, packed_nbytes

if TYPE_CHECKING:
    from lightning_gradcomp.compressors.terngrad import TernGrad


class FusedTernGrad:
    """The fused code path of one :class:`TernGrad` instance (reads its settings, keeps its RNG counters)."""

    def __init__(self, owner: "TernGrad") -> None:
        self.owner = owner
        #: draws made so far per parameter name: the counter-based generator's state (with the seed)
        self.counters: dict[str, int] = {}
        self._pending: dict[str, tuple[Tensor, int, Tensor, Optional[Tensor]]] = {}

    # -- when -------------------------------------------------------------------------------------------
    def enabled(self, device: torch.device) -> bool:
        """Whether compression of a tensor on ``device`` takes the fused path."""
        backend = self.owner.backend
        if backend != "auto":
            return backend == "fused"
        return device.type == "cpu" and kernels.fused_available()

    def decodes(self, packet: Packet) -> bool:
        """Whether this path decodes ``packet`` (2-bit packed payloads; exact, so any backend's packet)."""
        return (
            self.owner.packing == "2bit"
            and packet.payload.dtype == torch.uint8
            and packet.numel > 0
            and self.enabled(packet.payload.device)
        )

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = dict(state.get("counters", {}))
        self._pending = {}

    # -- compress ---------------------------------------------------------------------------------------
    def _bucket(self, numel: int) -> int:
        return self.owner.bucket_size or max(numel, 1)

    def _scaler_and_clip(self, tensor: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        from lightning_gradcomp.compressors.terngrad import _SIGMA_NOISE  # the owner's module imports this one

        owner = self.owner
        return kernels.terngrad_scale_clip(tensor, self._bucket(tensor.numel()), owner.clip_factor, owner.clip_mode, _SIGMA_NOISE)

    def _take(self, tensor: Tensor, name: str) -> tuple[Tensor, Optional[Tensor]]:
        cached = self._pending.pop(name, None)
        if cached is not None and cached[0] is tensor and cached[1] == tensor._version:
            return cached[2], cached[3]
        return self._scaler_and_clip(tensor)

    def _key(self, name: str) -> tuple[int, int]:
        counter = self.counters.get(name, 0)
        self.counters[name] = counter + 1
        return stream_key(self.owner.seed, self.owner.rank, counter, stream_id(name))

    def local_statistic(self, tensor: Tensor, name: str) -> Tensor:
        scaler, clip = self._scaler_and_clip(tensor)
        self._pending[name] = (tensor, tensor._version, scaler, clip)
        return scaler

    def ternarize(self, tensor: Tensor, name: str, scaler: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        local, clip = self._take(tensor, name)
        s = local if scaler is None else scaler.reshape(-1).to(local.device, torch.float32)
        values, _ = kernels.ternarize_int8(tensor, s, clip, self._bucket(tensor.numel()), self._key(name))
        return values, s

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor]) -> Packet:
        owner = self.owner
        n = tensor.numel()
        local, clip = self._take(tensor, name)
        s = local
        if shared is not None and owner.scaler_share == "max":
            s = shared.reshape(-1).to(local.device, torch.float32)
        bucket, key = self._bucket(n), self._key(name)
        ctx: dict[str, Any] = {"scale": s}
        if owner.aggregation_for(owner.world_size) is Aggregation.SUM:
            payload, nonzero = kernels.ternarize_int8(tensor, s, clip, bucket, key)
        elif owner.packing == "2bit":
            payload, nonzero = kernels.ternarize_pack(tensor, s, clip, bucket, key)
        else:
            values, nonzero = kernels.ternarize_int8(tensor, s, clip, bucket, key)
            payload = pack_ternary(values, owner.packing)
        if owner.scaler_share != "max":
            payload = torch.cat((payload, s.contiguous().view(torch.uint8)))
            ctx = {}
        stats = {"sparsity": 1.0 - nonzero.reshape(()).float() / max(n, 1), "scaler": s.max()}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, ctx=ctx, stats=stats)

    # -- decompress -------------------------------------------------------------------------------------
    def _packed_and_scale(self, packet: Packet) -> tuple[Tensor, Tensor]:
        if "scale" in packet.ctx:
            return packet.payload, packet.ctx["scale"]
        nbytes = packed_nbytes(packet.numel, "2bit")
        return packet.payload[:nbytes], packet.payload[nbytes:].clone().view(torch.float32)

    def decompress(self, packet: Packet) -> Tensor:
        packed, scale = self._packed_and_scale(packet)
        out = kernels.decode(packed, packet.numel, scale, self._bucket(packet.numel))
        return out.to(packet.dtype).view(packet.shape)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        first = packets[0]
        out = kernels.decode_sum([p.payload for p in packets], first.numel, first.ctx["scale"], self._bucket(first.numel))
        return out.to(first.dtype).view(first.shape)

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor, divisor: int = 1) -> Tensor:
        first = packets[0]
        if out.dtype != torch.float32 or not out.is_contiguous():  # the kernel writes flat float32 only
            total = self.decompress_sum(packets)
            return out.copy_(total.div_(divisor) if divisor != 1 else total)
        flat = out.view(-1)
        kernels.decode_sum(
            [p.payload for p in packets], first.numel, first.ctx["scale"], self._bucket(first.numel), out=flat,
            divisor=divisor,
        )
        return out
