"""Test oracle: TernGrad one layer at a time, as it was written before its group code
(:mod:`lightning_gradcomp.compressors.terngrad_group`) became the one implementation.

:class:`LayerTernGrad` is :class:`~lightning_gradcomp.compressors.TernGrad` with its per-layer methods written per
layer: ``backend="fused"`` runs the per-layer kernels (:class:`~tests.oracles.terngrad_fused.FusedTernGrad`: the
counter-based stream keyed per name, so the group code must equal it bit for bit), ``backend="torch"`` the torch ops
with one ``torch.Generator`` per layer (a statistical reference: other draws). Its group methods are the base class's
loop over these per-layer methods, so ``LayerTernGrad(...).compress_flat`` is the looping reference of a group.
"""

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation, max_or_zero
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.streams import RandomStreams
from lightning_gradcomp.compressors.terngrad import _SIGMA_NOISE, TernGrad
from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes, unpack_ternary
from tests.oracles.terngrad_fused import FusedTernGrad
from tests.oracles.layer_loop import LayerLoop


class LayerTernGrad(LayerLoop, TernGrad):
    """TernGrad per layer (the oracle); same options as :class:`~lightning_gradcomp.compressors.TernGrad`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._streams = RandomStreams(self.seed)
        self._fused = FusedTernGrad(self, sigma_noise=_SIGMA_NOISE, streams=self._keys)

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._streams.reset(rank)
        self._fused.forget()

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._streams.state_dict(), **self._keys.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._streams.load_state_dict(state.get("streams", {}))
        self._fused.forget()

    def _layer_kernels(self, device: torch.device) -> Optional[FusedTernGrad]:
        return self._fused if self.kernels(device).name == "fused" else None

    def _chunked(self, tensor: Tensor) -> Tensor:
        """The flat float32 tensor as [chunks, chunk_len]; a partial last chunk is padded with zeros."""
        flat = tensor.detach().reshape(-1).float()
        if self.bucket_size is None:
            return flat.unsqueeze(0)
        n, b = flat.numel(), self.bucket_size
        pad = self._num_chunks(n) * b - n
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad)))
        return flat.view(-1, b)

    def _sigma(self, chunks: Tensor, numel: int) -> Tensor:
        if self.bucket_size is None or numel % self.bucket_size == 0:
            return chunks.std(dim=1, correction=0)
        # the padded tail chunk must not count its zeros
        counts = torch.full((chunks.shape[0],), float(self.bucket_size), device=chunks.device)
        counts[-1] = numel - (chunks.shape[0] - 1) * self.bucket_size
        mean = chunks.sum(dim=1) / counts
        mask = torch.ones_like(chunks, dtype=torch.bool)
        mask.view(-1)[numel:] = False
        var = (((chunks - mean[:, None]) ** 2) * mask).sum(dim=1) / counts
        return var.sqrt()

    def _clipped_and_scaler(self, tensor: Tensor) -> tuple[Tensor, Tensor]:
        chunks = self._chunked(tensor)
        if self.clip_factor == 0.0:
            return chunks, chunks.abs().amax(dim=1)
        sigma = self._sigma(chunks, tensor.numel())
        maxabs = chunks.abs().amax(dim=1)
        # a constant chunk (e.g. a one-element bias) has sigma = 0: clipping at c*sigma would zero its gradient
        # forever (as the original code does); such a chunk has no outliers, so it is not clipped
        # (sigma below float32 rounding noise of the mean counts as 0)
        constant = sigma <= _SIGMA_NOISE * maxabs
        threshold = torch.where(constant, maxabs, self.clip_factor * sigma)
        if self.clip_mode == "code":
            return chunks, threshold
        clipped = torch.maximum(torch.minimum(chunks, threshold[:, None]), -threshold[:, None])
        return clipped, clipped.abs().amax(dim=1)

    def local_statistic(self, tensor: Tensor, name: str) -> Optional[Tensor]:
        if self.scaler_share != "max":
            return None
        if tensor.numel() == 0:
            return tensor.new_zeros(0, dtype=torch.float32)
        fused = self._layer_kernels(tensor.device)
        if fused is not None:
            return fused.local_statistic(tensor, name)
        return self._clipped_and_scaler(tensor)[1]

    def ternarize(self, tensor: Tensor, scaler: Optional[Tensor] = None, name: str = "") -> tuple[Tensor, Tensor]:
        """Ternary values (int8, the tensor's flat length) and the scalers used (float32, one per chunk).

        Args:
            tensor: the gradient.
            scaler: scalers shared by all ranks (one per chunk); ``None`` uses this rank's own.
            name: the parameter's name, which selects its random stream.
        """
        if tensor.numel() == 0:
            return tensor.new_zeros(0, dtype=torch.int8), tensor.new_zeros(0, dtype=torch.float32)
        fused = self._layer_kernels(tensor.device)
        if fused is not None:
            return fused.ternarize(tensor, name, scaler)
        chunks, local = self._clipped_and_scaler(tensor)
        s = local if scaler is None else scaler.to(chunks.device, torch.float32)
        rnd = torch.rand(chunks.shape, generator=self._streams.get(name, chunks.device), device=chunks.device)
        # b ~ Bernoulli(|g|/s), drawn as U[0,1)*s < |g|: no division, exact at s == 0 (nothing is sent) and
        # |g| >= s always sent (the original code's implicit clipping)
        keep = rnd.mul_(s[:, None]) < chunks.abs()
        ternary = torch.where(keep, torch.sign(chunks), torch.zeros_like(chunks)).to(torch.int8)
        return ternary.reshape(-1)[: tensor.numel()], s

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        fused = self._layer_kernels(tensor.device)
        if fused is not None and tensor.numel() > 0:
            return fused.compress(tensor, name, shared, self.aggregation)
        ternary, s = self.ternarize(tensor, shared if self.scaler_share == "max" else None, name)
        stats = {"sparsity": (ternary == 0).float().mean().nan_to_num(0.0), "scaler": max_or_zero(s)}
        ctx: dict[str, Any] = {}
        if self.aggregation is Aggregation.SUM:
            payload = ternary
            ctx["scale"] = s
        elif self.scaler_share == "max":
            payload = pack_ternary(ternary, self.packing)
            ctx["scale"] = s
        else:
            payload = torch.cat((pack_ternary(ternary, self.packing), s.view(torch.uint8)))
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, ctx=ctx, stats=stats)

    def _values_and_scale(self, packet: Packet) -> tuple[Tensor, Tensor]:
        """Integer values (ternaries, or sums of ternaries) and the scalers of one packet."""
        numel = packet.numel
        if packet.payload.dtype == torch.int8:  # int8 all-reduce form
            return packet.payload, packet.ctx["scale"]
        if "scale" in packet.ctx:
            return unpack_ternary(packet.payload, numel, self.packing), packet.ctx["scale"]
        nbytes = packed_nbytes(numel, self.packing)
        scale = packet.payload[nbytes:].clone().view(torch.float32)
        return unpack_ternary(packet.payload[:nbytes], numel, self.packing), scale

    def _scaled(self, values: Tensor, scale: Tensor, packet: Packet) -> Tensor:
        if self.bucket_size is None:
            out = values.float() * scale
        else:
            per_elem = scale.repeat_interleave(self.bucket_size)[: packet.numel]
            out = values.float() * per_elem
        return out.to(packet.dtype).view(packet.shape)

    def _decoder(self, packets: Sequence[Packet]) -> Optional[FusedTernGrad]:
        """The fused path when it decodes every one of ``packets`` (else the torch ops do)."""
        fused = self._layer_kernels(packets[0].payload.device)
        return fused if fused is not None and all(fused.decodes(p) for p in packets) else None

    def decompress(self, packet: Packet) -> Tensor:
        fused = self._decoder([packet])
        if fused is not None:
            return fused.decompress(packet)
        values, scale = self._values_and_scale(packet)
        return self._scaled(values, scale, packet)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        if "scale" not in packets[0].ctx:
            return LayerLoop.decompress_sum(self, packets)
        fused = self._decoder(packets)
        if fused is not None:
            return fused.decompress_sum(packets)
        # shared scaler: add the integer ternaries exactly, scale once
        total = self._values_and_scale(packets[0])[0].to(torch.int32)
        for packet in packets[1:]:
            total = total + self._values_and_scale(packet)[0]
        return self._scaled(total, packets[0].ctx["scale"], packets[0])

    def _fused_sums(self, packets: Sequence[Packet]) -> Optional[FusedTernGrad]:
        """The fused path when it sums ``packets`` (one shared scaler, packed payloads it decodes)."""
        return self._decoder(packets) if "scale" in packets[0].ctx else None

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        fused = self._fused_sums(packets)
        if fused is not None:
            return fused.decompress_sum_into(packets, out)
        return super().decompress_sum_into(packets, out)

    def decompress_mean_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        # the fused decoder divides in the pass that writes `out`: one sweep over the bucket instead of two
        fused = self._fused_sums(packets)
        if fused is not None:
            return fused.decompress_sum_into(packets, out, divisor=len(packets))
        return super().decompress_mean_into(packets, out)

    def clipped(self, tensor: Tensor) -> Tensor:
        """``tensor`` after this rank's own c*sigma clipping, as float32 (for monitoring; draws no randomness).

        With ``clip_mode="code"`` the clipping is implicit at the shared scaler; this shows it at this rank's
        own c*sigma.
        """
        chunks, threshold = self._clipped_and_scaler(tensor)
        if self.clip_mode == "code" and self.clip_factor:
            chunks = torch.maximum(torch.minimum(chunks, threshold[:, None]), -threshold[:, None])
        return chunks.reshape(-1)[: tensor.numel()].view(tensor.shape)

