"""Test oracle: the dense baselines one layer at a time, as they were written before their group code became the one
implementation.

:class:`LayerQSGD` and :class:`LayerInt8` are :class:`~lightning_gradcomp.compressors.QSGD` and
:class:`~lightning_gradcomp.compressors.int8.Int8` with their per-layer methods written per layer (one tensor's
buckets, norms, scale and rounding), drawing from the same counter-based streams; :class:`LayerCast` and
:class:`LayerIdentity` cast or pass one tensor. Their group methods are the base class's loop over these per-layer
methods, so ``LayerQSGD(...).compress_flat`` is the looping reference of a group: the group code must equal it bit for
bit, per-layer bytes and statistics included.
"""

from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import max_or_zero
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.cast import Cast
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.int8 import Int8
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.wire.bits import pack_bits, packed_bits_nbytes, unpack_bits
from tests.oracles.layer_loop import LayerLoop


class LayerQSGD(LayerLoop, QSGD):
    """QSGD per layer (the oracle); same options as :class:`~lightning_gradcomp.compressors.QSGD`."""

    def _buckets(self, flat: Tensor) -> Tensor:
        pad = (-flat.numel()) % self.bucket_size
        if pad:  # zero padding changes no norm and decodes to nothing
            flat = torch.cat((flat, flat.new_zeros(pad)))
        return flat.view(-1, self.bucket_size)

    def quantize(self, tensor: Tensor, name: str = "") -> tuple[Tensor, Tensor, Tensor]:
        """Signs (bool, negative), levels (int32 in [0, s]) and bucket norms (float32) of ``tensor``."""
        flat = tensor.detach().reshape(-1).float()
        buckets = self._buckets(flat)
        norms = torch.linalg.vector_norm(buckets, dim=1, dtype=torch.float64).float()
        scaled = buckets.abs() * self._inverse(norms)[:, None]
        n = flat.numel()
        level = self._round(scaled.reshape(-1)[:n], self._streams.uniform(name, n, flat.device))
        return (buckets < 0).reshape(-1)[:n], level, norms

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        negative, level, norms = self.quantize(tensor, name)
        codes = level * 2 + negative.to(torch.int32)
        payload = torch.cat((pack_bits(codes, self.width), norms.view(torch.uint8)))
        stats = {"sparsity": (level == 0).float().mean().nan_to_num(0.0), "norm": max_or_zero(norms)}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    def decompress(self, packet: Packet) -> Tensor:
        n = packet.numel
        ncodes = packed_bits_nbytes(n, self.width)
        codes = unpack_bits(packet.payload[:ncodes], n, self.width)
        norms = packet.payload[ncodes:].clone().view(torch.float32)
        magnitude = (codes >> 1).float() * (norms.repeat_interleave(self.bucket_size)[:n] / self.levels)
        out = torch.where((codes & 1).bool(), -magnitude, magnitude)
        return out.to(packet.dtype).view(packet.shape)


def _amax(tensor: Tensor) -> Tensor:
    return tensor.detach().abs().amax().float().reshape(1) if tensor.numel() else tensor.new_zeros(1, dtype=torch.float32)


class LayerInt8(LayerLoop, Int8):
    """Int8 per layer (the oracle): one scale per tensor, agreed through the per-layer statistic."""

    def local_statistic(self, tensor: Tensor, name: str) -> Optional[Tensor]:
        return _amax(tensor)

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1).float()
        scale = (shared if shared is not None else _amax(tensor)).reshape(()).float()
        rnd = self._streams.uniform(name, flat.numel(), flat.device)
        codes = self._round(flat, self._inverse(scale), rnd)
        stats = {"scaler": max_or_zero(scale.reshape(1))}
        return Packet(payload=codes, shape=tensor.shape, dtype=tensor.dtype, ctx={"scale": scale}, stats=stats)

    def decompress(self, packet: Packet) -> Tensor:
        step = packet.ctx["scale"] / self.levels
        return (packet.payload.float() * step).to(packet.dtype).view(packet.shape)


class LayerCast(LayerLoop, Cast):
    """A 16-bit cast per layer (the oracle)."""

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        return Packet(payload=self._cast(tensor.detach().reshape(-1)), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, packet: Packet) -> Tensor:
        return self._uncast(packet.payload, packet.dtype).view(packet.shape)


class LayerIdentity(LayerLoop, Identity):
    """Each layer unchanged (the oracle)."""

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        return Packet(payload=tensor.detach().reshape(-1), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, packet: Packet) -> Tensor:
        return packet.payload.view(packet.shape)
