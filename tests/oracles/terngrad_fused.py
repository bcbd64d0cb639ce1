"""Test oracle: TernGrad's per-layer fused code (one layer per call of the per-layer kernels of
:mod:`tests.oracles.terngrad_kernels`), the bit-for-bit reference the group code
(:mod:`lightning_gradcomp.compressors.terngrad_group`) is checked against.

Differences from the torch backend, and why they are safe:

* Random stream: a counter-based hash of (seed, rank, parameter name, per-name counter, element index)
  instead of ``torch.Generator``. Same Bernoulli probabilities (``u * s < min(|g|, clip)`` with a 24-bit
  uniform u), different draws. Its whole state is the per-name counters.
* sigma from one float64 pass (sum and sum of squares) instead of ``torch.std``: agrees to ~1e-6 relative;
  the scaler is max-reduced over ranks anyway, so a rank's own rounding never desynchronises replicas.
* Decoding gives exactly the torch backend's bits, so ranks on different backends still agree.
* ``local_statistic`` keeps the statistics it computed for ``compress`` (keyed by name, checked against the
  tensor's identity and version), so the hook's statistic + compress reads the gradient twice, not three times.

It reads TernGrad's settings through :class:`TernGradSettings`, at each call.
"""

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.streams import CounterStreams
from lightning_gradcomp.compressors.terngrad_group import TernGradSettings
from tests.oracles import terngrad_kernels as kernels
from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes


class FusedTernGrad:
    """TernGrad's fused code path, given TernGrad's settings and its counter-based random streams.

    Args:
        settings: the compressor's settings, read at each call.
        sigma_noise: a chunk whose sigma is at most this times its max |g| counts as constant (not clipped).
        streams: the random streams (their counters are the generator's state, checkpointed by the compressor).
    """

    def __init__(self, settings: TernGradSettings, sigma_noise: float, streams: CounterStreams) -> None:
        self.settings = settings
        self.sigma_noise = sigma_noise
        self.streams = streams
        self._pending: dict[str, tuple[Tensor, int, Tensor, Optional[Tensor]]] = {}

    def decodes(self, packet: Packet) -> bool:
        """Whether this path decodes ``packet`` (2-bit packed payloads; exact, so any backend's packet)."""
        return self.settings.packing == "2bit" and packet.payload.dtype == torch.uint8 and packet.numel > 0

    def forget(self) -> None:
        """Drop the statistics kept between ``local_statistic`` and ``compress`` (the state was replaced)."""
        self._pending = {}

    # -- compress ---------------------------------------------------------------------------------------
    def _bucket(self, numel: int) -> int:
        return self.settings.bucket_size or max(numel, 1)

    def _scaler_and_clip(self, tensor: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        bucket = self._bucket(tensor.numel())
        return kernels.terngrad_scale_clip(tensor, bucket, self.settings.clip_factor, self.settings.clip_mode, self.sigma_noise)

    def _take(self, tensor: Tensor, name: str) -> tuple[Tensor, Optional[Tensor]]:
        cached = self._pending.pop(name, None)
        if cached is not None and cached[0] is tensor and cached[1] == tensor._version:
            return cached[2], cached[3]
        return self._scaler_and_clip(tensor)

    def local_statistic(self, tensor: Tensor, name: str) -> Tensor:
        scaler, clip = self._scaler_and_clip(tensor)
        self._pending[name] = (tensor, tensor._version, scaler, clip)
        return scaler

    def ternarize(self, tensor: Tensor, name: str, scaler: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        local, clip = self._take(tensor, name)
        s = local if scaler is None else scaler.reshape(-1).to(local.device, torch.float32)
        values, _ = kernels.ternarize_int8(tensor, s, clip, self._bucket(tensor.numel()), self.streams.key(name))
        return values, s

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor], aggregation: Aggregation) -> Packet:
        """One packet travelling as ``aggregation`` (int8 ternaries to sum, or a packed payload to gather)."""
        n = tensor.numel()
        local, clip = self._take(tensor, name)
        s = local
        if shared is not None and self.settings.scaler_share == "max":
            s = shared.reshape(-1).to(local.device, torch.float32)
        bucket, key = self._bucket(n), self.streams.key(name)
        ctx: dict[str, Any] = {"scale": s}
        if aggregation is Aggregation.SUM:
            payload, nonzero = kernels.ternarize_int8(tensor, s, clip, bucket, key)
        elif self.settings.packing == "2bit":
            payload, nonzero = kernels.ternarize_pack(tensor, s, clip, bucket, key)
        else:
            values, nonzero = kernels.ternarize_int8(tensor, s, clip, bucket, key)
            payload = pack_ternary(values, self.settings.packing)
        if self.settings.scaler_share != "max":
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
