"""Test oracle: AdaComp one layer at a time, as it was written before its group code
(:mod:`lightning_gradcomp.compressors.adacomp_group` and the group methods of
:class:`~lightning_gradcomp.compressors.AdaComp`) became the one implementation.

:class:`LayerAdaComp` is :class:`~lightning_gradcomp.compressors.AdaComp` with its per-layer methods written per layer:
the selection on padded bins (``backend="fused"``: the per-layer kernel :func:`~lightning_gradcomp.kernels.adacomp_select`
for the adaptive selection), each layer's wire written alone (``encode_bin_relative`` or the per-layer kernel
:func:`~lightning_gradcomp.kernels.bin_words_encode`; the index32 layout), and the ranks' sums decoded per layer. Its group
methods are the base class's loop over these per-layer methods, so ``LayerAdaComp(...).compress_flat`` is the looping
reference of a group: the group code must equal it bit for bit (payload, sizes, statistics, decoded sums).
"""

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_gradcomp.compressors.adacomp_kernels import CompiledAdaComp
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors.adacomp import AdaComp, layer_kind
from lightning_gradcomp.compressors.adacomp_group import bin_mean
from lightning_gradcomp.flat import Packet, Segments
from lightning_gradcomp.wire.sparse import (
    decode_bin_relative,
    encode_bin_relative,
    pack_codes,
    packed_codes_nbytes,
    unpack_codes,
)
from tests.oracles.layer_loop import LayerLoop


class LayerAdaComp(LayerLoop, AdaComp):
    """AdaComp per layer (the oracle); same options as :class:`~lightning_gradcomp.compressors.AdaComp`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gradients: dict[str, Tensor] = {}

    # a loop over layers is not a fixed number of ops per group (the group methods: LayerLoop's)
    @property
    def batched(self) -> bool:
        return False

    def observe_gradient_flat(self, flat: Tensor, segments: Segments) -> None:
        LayerLoop.observe_gradient_flat(self, flat, segments)

    # -- the algorithm, per layer -------------------------------------------------------------------------
    @staticmethod
    def _bins(flat: Tensor, size: int) -> Tensor:
        """``flat`` as [bins, size]; the last, partial bin is padded with zeros (which are never sent)."""
        n = flat.numel()
        pad = -(-n // size) * size - n
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad)))
        return flat.view(-1, size)

    def observe_gradient(self, grad: Tensor, name: str) -> None:
        self._gradients[name] = grad

    def select(self, g: Tensor, dw: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Algorithm 2 on a flat layer: the sent indices, their ternary values and the layer scale."""
        n = g.numel()
        if n == 0:
            return g.new_zeros(0, dtype=torch.long), g.new_zeros(0, dtype=torch.long), g.new_zeros(())
        ops = self.kernels(g.device)
        if self.selection == "adaptive" and isinstance(ops, CompiledAdaComp):
            return ops.select_layer(g, dw, size)
        bins = self._bins(g, size)
        mag = bins.abs()
        gmax = mag.amax(dim=1)
        scale = bin_mean(gmax, torch.tensor([gmax.numel()], device=g.device)).reshape(())
        if self.selection == "adaptive":
            h = self._bins(g + (self.scale_factor - 1.0) * dw, size)
            send = h.abs() >= gmax[:, None]
        else:
            k = min(self.local_count, size)
            top = torch.topk(mag, k, dim=1).indices
            send = torch.zeros_like(mag, dtype=torch.bool).scatter_(1, top, True)
        send &= bins != 0
        if self.quantizer == "ternary":
            send &= 2 * mag >= scale  # nearest of {-s, 0, s} is not 0
        idx = torch.nonzero(send.reshape(-1)[:n]).reshape(-1)
        values = torch.sign(g[idx]).long()
        return idx, values, scale

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        dw_raw = self._gradients.pop(name, None)
        if dw_raw is None:
            raise RuntimeError(f"call `observe_gradient(grad, {name!r})` before `compress`")
        g = tensor.detach().reshape(-1).float()
        dw = dw_raw.detach().reshape(-1).float()
        size = self.bin_size(name, tensor.shape)
        self.layer_kinds[name] = layer_kind(name, tensor.shape)
        self.layer_bin_sizes[name] = size
        idx, values, scale = self.select(g, dw, size)
        payload = self._encode(idx, values, scale, size)
        n = g.numel()
        num_bins = -(-n // size)
        dev = g.device
        stats = {
            "sparsity": torch.tensor(1.0 - idx.numel() / max(n, 1), device=dev),
            "sent_per_bin": torch.tensor(idx.numel() / max(num_bins, 1), device=dev),
            "scale": scale.detach().reshape(()),
            "bin_size": torch.tensor(float(size), device=dev),
            "compression_rate": torch.tensor(4.0 * n / max(payload.numel(), 1), device=dev),
        }
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, ctx={"bin_size": size}, stats=stats)

    # -- wire, per layer ----------------------------------------------------------------------------------
    def _encode(self, idx: Tensor, values: Tensor, scale: Tensor, size: int) -> Tensor:
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=scale.device)
        head = scale.float().reshape(1).view(torch.uint8)
        if self.wire == "paper":
            if self.kernels(idx.device).name == "fused":
                return torch.cat((head, kernels.bin_words_encode(idx, values + 1, size)))
            return torch.cat((head, encode_bin_relative(idx, values + 1, size)))
        count = torch.tensor([idx.numel()], dtype=torch.int32, device=idx.device).view(torch.uint8)
        return torch.cat((count, head, idx.to(torch.int32).view(torch.uint8), pack_codes((values > 0).long(), 1)))

    def _decode(self, payload: Tensor, size: int) -> tuple[Tensor, Tensor]:
        if self.wire == "paper":
            scale = payload[:4].clone().view(torch.float32)
            idx, codes = decode_bin_relative(payload[4:], size)
            return idx, (codes - 1).float() * scale
        k = int(payload[:4].clone().view(torch.int32)[0])
        scale = payload[4:8].clone().view(torch.float32)
        idx = payload[8 : 8 + 4 * k].clone().view(torch.int32).long()
        signs = unpack_codes(payload[8 + 4 * k : 8 + 4 * k + packed_codes_nbytes(k, 1)], k, 1)
        return idx, torch.where(signs == 1, 1.0, -1.0) * scale

    def decompress(self, packet: Packet) -> Tensor:
        if self.wire == "paper" and packet.payload.numel() > 0 and self.kernels(packet.payload.device).name == "fused":
            decoded = kernels.bin_words_decode_sum(packet.numel, [packet.payload], packet.ctx["bin_size"])
            return decoded.to(packet.dtype).view(packet.shape)
        out = torch.zeros(packet.numel, dtype=torch.float32, device=packet.payload.device)
        if packet.payload.numel() > 0:
            idx, val = self._decode(packet.payload, packet.ctx["bin_size"])
            out[idx] = val
        return out.to(packet.dtype).view(packet.shape)

    # -- the ranks' sums, per layer (the fused backend decodes them in one pass per payload) -------------
    def _fused_sum(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        first = packets[0]
        if self.wire == "paper":
            flat = out.view(-1)
            kernels.bin_words_decode_sum(first.numel, [p.payload for p in packets], first.ctx["bin_size"], out=flat)
            return out.view(first.shape)
        pairs = [self._decode(p.payload, p.ctx["bin_size"]) for p in packets if p.payload.numel() > 0]
        flat = out.view(-1)
        kernels.sparse_decode_sum(first.numel, [i for i, _ in pairs], [v for _, v in pairs], out=flat)
        return out.view(first.shape)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        first = packets[0]
        if first.dtype != torch.float32 or self.kernels(first.payload.device).name != "fused":
            return LayerLoop.decompress_sum(self, packets)
        return self._fused_sum(packets, torch.empty(first.numel, dtype=torch.float32, device=first.payload.device))

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        first = packets[0]
        writes_into = (first.dtype == torch.float32 and out.dtype == torch.float32 and out.is_contiguous()
                       and out.numel() == first.numel)
        if not writes_into or self.kernels(first.payload.device).name != "fused":
            return LayerLoop.decompress_sum_into(self, packets, out)
        self._fused_sum(packets, out)
        return out


__all__ = ["LayerAdaComp"]
