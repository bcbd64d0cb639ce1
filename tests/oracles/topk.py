"""Test oracle: top-k and DGC one layer at a time, as they were written before their group code
(:mod:`lightning_gradcomp.compressors.topk_group`, :mod:`lightning_gradcomp.compressors.dgc_group`) became the one
implementation.

:class:`LayerTopK` and :class:`LayerDGC` are :class:`~lightning_gradcomp.compressors.TopK` and
:class:`~lightning_gradcomp.compressors.DGC` with their per-layer methods written per layer: ``torch.topk`` per
tensor, and a per-layer payload ``values | int32 indices`` (int2: ``scale | int32 indices | 2-bit codes``) in the
order the selection gives. Their group methods are the base class's loop over these per-layer methods, so
``LayerTopK(...).compress_flat`` is the looping reference of a group: the group code must send the same elements,
the same bytes per layer, and decode to the same bits. Where the k-th largest magnitude ties, ``torch.topk`` chooses
among the ties as its kernel happens to, the group code by the lowest position: compare them on values without ties.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors import topk_group
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.topk import DGC, TopK
from lightning_gradcomp.wire.bits import pack_bits, packed_bits_nbytes, unpack_bits
from tests.oracles.layer_loop import LayerLoop

_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class LayerTopK(LayerLoop, TopK):
    """Top-k per layer (the oracle); same options as :class:`~lightning_gradcomp.compressors.TopK`."""

    batched = False

    def select(self, importance: Tensor, name: str = "") -> Tensor:
        """Indices (int64) of the elements to send, given their magnitudes."""
        k = min(self.num_selects(importance.numel()), importance.numel())
        return torch.topk(importance, k, sorted=False).indices

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1)
        if self.is_dense(tensor.shape):
            payload = flat.float().view(torch.uint8)
            return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats={"density": flat.new_ones(())})
        # an empty tensor selects nothing (the samplers' order statistics need a value)
        indices = self.select(flat.abs(), name) if flat.numel() else flat.new_zeros(0, dtype=torch.long)
        index_bytes = indices.to(torch.int32).view(torch.uint8)
        if self.value_dtype == "int2":
            values = flat[indices].float()
            scale = values.abs().amax().reshape(1) / topk_group.INT2_HALF_RANGE if values.numel() else values.new_zeros(1)
            codes = topk_group.int2_codes(values, scale)
            payload = torch.cat((scale.view(torch.uint8), index_bytes, pack_bits(codes, 2)))
        else:
            values = flat[indices].to(_VALUE_DTYPES[self.value_dtype])
            payload = torch.cat((values.view(torch.uint8), index_bytes))
        stats = {"density": flat.new_tensor(indices.numel() / max(1, flat.numel()), dtype=torch.float32)}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    def _values_indices(self, packet: Packet) -> tuple[Tensor, Tensor]:
        if self.value_dtype == "int2":
            return _int2_values_indices(packet.payload)
        value_size = _VALUE_DTYPES[self.value_dtype].itemsize
        k = packet.payload.numel() // (value_size + 4)
        # clone: slices at odd byte offsets cannot be reinterpreted as wider dtypes in place
        values = packet.payload[: k * value_size].clone().view(_VALUE_DTYPES[self.value_dtype])
        indices = packet.payload[k * value_size :].clone().view(torch.int32).long()
        return values, indices

    def decompress(self, packet: Packet) -> Tensor:
        if self.is_dense(packet.shape):
            return packet.payload.clone().view(torch.float32).to(packet.dtype).view(packet.shape)
        values, indices = self._values_indices(packet)
        out = torch.zeros(packet.numel, dtype=packet.dtype, device=packet.payload.device)
        out[indices] = values.to(packet.dtype)
        return out.view(packet.shape)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        if self.is_dense(packets[0].shape):
            return LayerLoop.decompress_sum(self, packets)
        first = packets[0]
        out = torch.zeros(first.numel, dtype=first.dtype, device=first.payload.device)
        for packet in packets:  # rank order, identical on every rank
            values, indices = self._values_indices(packet)
            out.index_add_(0, indices, values.to(first.dtype))
        return out.view(first.shape)



def _int2_values_indices(payload: Tensor) -> tuple[Tensor, Tensor]:
    """Values and indices of an int2 payload ``scale (4 B) | k int32 indices | k 2-bit codes``."""
    total = payload.numel() - 4
    k = max(0, total * 4 // 17 - 1)  # 4k + ceil(k / 4) == total: start just below and step up
    while 4 * k + packed_bits_nbytes(k, 2) < total:
        k += 1
    scale = payload[:4].clone().view(torch.float32)
    indices = payload[4 : 4 + 4 * k].clone().view(torch.int32).long()
    codes = unpack_bits(payload[4 + 4 * k :], k, 2).float()
    return topk_group.int2_values(codes, scale), indices


class LayerDGC(LayerTopK, DGC):
    """DGC per layer (the oracle); same options as :class:`~lightning_gradcomp.compressors.DGC`, the same sample
    offsets (the per-name counter streams)."""

    def select(self, importance: Tensor, name: str = "") -> Tensor:
        numel = importance.numel()
        num_selects = min(self.num_selects(numel), numel)
        stride, num_samples, top_k_samples = self.sampling(numel)
        if stride == 1:
            samples = importance
        else:
            samples = importance[self._start(name, stride) :: stride]
        top_k_samples = min(top_k_samples, samples.numel())
        threshold = torch.topk(samples, top_k_samples, sorted=False).values.min()
        indices = torch.nonzero(importance >= threshold).view(-1)
        if stride > 1:
            for _ in range(self.max_adaptation_iters):
                count = indices.numel()
                if count > num_selects:
                    if count > self.upper_bound * num_selects:
                        top = torch.topk(importance[indices], num_selects, sorted=False).indices
                        indices = indices[top]
                    break
                if count >= self.lower_bound * num_selects:
                    break
                threshold = threshold * self.lower_bound
                indices = torch.nonzero(importance >= threshold).view(-1)
        return indices[:num_selects]

