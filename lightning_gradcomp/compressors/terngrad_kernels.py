"""TernGrad's kernel providers: the operations of its group step (:class:`~.terngrad_group.TernGradKernels`) on torch
ops, on the compiled CPU kernels (one call per group, looping over its layers inside: ``terngrad_scale_clip_flat``,
``terngrad_ternarize_flat``, ``terngrad_decode_sum_flat``, ``terngrad_scale_int8_flat``) and on Triton's
(:mod:`lightning_gradcomp.kernels.triton_terngrad`). All three give the same bits; a form a kernel set has no kernel
for (base-3 packing in the compiled kernels, per-worker scalers of another dtype than float32 in Triton's mean)
runs the torch ops, which each provider inherits.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.backends import Kernels
from lightning_gradcomp.compressors.terngrad_group import ZERO_CODE, FlatTernGrad, PackLayout
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.kernels import extension_for, terngrad_scaler, triton_terngrad


class TorchTernGrad:
    """TernGrad's group step in torch ops (the reference the other providers equal bit for bit).

    Args:
        group: the compressor's group code: layouts, settings, random streams.
    """

    name: Kernels = "torch"

    def __init__(self, group: FlatTernGrad) -> None:
        self.group = group

    def scale_clip(self, x: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's scaler per chunk and the clip threshold per chunk of float32 ``x`` (``None``: no clipping)."""
        g, s = self.group, self.group.settings
        chunks = g.chunk_layout(segments)
        absmax = chunks.chunks.reduce(x.abs(), "amax")
        if s.clip_factor == 0.0:
            return absmax, None
        d = x.to(torch.float64)
        lengths = chunks.lengths(x.device)
        mean = chunks.chunks.reduce(d, "sum") / lengths
        var = (chunks.chunks.reduce(d * d, "sum") / lengths - mean * mean).clamp_min(0.0)
        return terngrad_scaler(var.sqrt().to(torch.float32), absmax, s.clip_factor, s.clip_mode, g.sigma_noise)

    def encode(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """int8 ``[total]`` ternaries (the stream's next draws) and the nonzero count of each layer."""
        ternary = self.group.ternarize(flat, segments, scale, clip)
        return ternary, segments.reduce((ternary != 0).to(torch.int32), "sum")

    def encode_payload(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The group's packed payload, every layer's bytes where the wire has them (per-worker scaler bytes still to
        be written), and the nonzero count of each layer."""
        layout = self.group.pack_layout(segments)
        ternary, nonzero = self.encode(flat, segments, scale, clip)
        return self.group.place(self.group.pack(ternary, layout), layout), nonzero

    def scale_int8(self, packet: FlatPacket) -> Tensor:
        """float32 ``[total]``: the int8 form's values (ternaries, or their sum over ranks) times their scalers."""
        return self.group.scaled(packet.payload, packet.ctx["scale"], packet.segments)

    def decode(self, packet: FlatPacket, scale: Tensor) -> Tensor:
        """float32 ``[total]``: one packed payload decoded with its scalers ``scale``."""
        return self.group.scaled(self.group.values(packet), scale, packet.segments)

    def mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean of packed payloads into ``out``: the ranks' sum divided by their number, bit for bit
        (:meth:`~.terngrad_group.FlatTernGrad.decompress_sum`)."""
        g, first, ranks = self.group, packets[0], len(packets)
        if "scale" not in first.ctx:  # per-worker scalers: decode each rank, sum the decoded in rank order
            total = g.decompress(first)
            for packet in packets[1:]:
                total.add_(g.decompress(packet))
            return out.copy_(total).div_(ranks)
        # one shared scaler: the exact integer sum over ranks, scaled once
        scale = first.ctx["scale"]
        layout = g.pack_layout(first.segments)
        payloads = torch.stack([p.payload for p in packets])
        sums = g.codes(payloads, layout).sum(0, dtype=torch.int32).view(-1)
        values = sums.index_select(0, layout.scatter(sums.device)).sub_(ranks * ZERO_CODE)
        if out.dtype == torch.float32 and out.is_contiguous():
            g.scaled(values, scale, first.segments, out=out.view(-1))
        else:
            out.copy_(g.scaled(values, scale, first.segments).to(first.dtype))
        return out.div_(ranks)


class CompiledTernGrad(TorchTernGrad):
    """TernGrad's group step in the compiled CPU kernels, one call per group; the torch ops where the kernels cannot
    run (off the CPU, no compiler: :func:`~lightning_gradcomp.kernels.extension_for`) and for base-3 packing."""

    name: Kernels = "fused"

    def scale_clip(self, x: Tensor, segments: Segments) -> tuple[Tensor, Optional[Tensor]]:
        ext = extension_for(x)
        if ext is None:
            return super().scale_clip(x, segments)
        g, s = self.group, self.group.settings
        mode = 0 if s.clip_factor == 0.0 else {"paper": 1, "code": 2}[s.clip_mode]
        scale, clip = ext.terngrad_scale_clip_flat(
            x.contiguous(), g.chunk_layout(segments).offsets(), g.bucket(), s.clip_factor, mode, g.sigma_noise
        )
        return scale, clip if mode == 1 else None

    def _ternarize(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor], packed: bool
    ) -> tuple[Tensor, Tensor]:
        g = self.group
        x = flat.detach().reshape(-1).to(torch.float32).contiguous()
        no_clip = x.new_empty(0)
        ext = extension_for(x)
        assert ext is not None, "the compiled kernels ternarize only where they run"
        return ext.terngrad_ternarize_flat(
            x, g.chunk_layout(segments).offsets(), g.bucket(), scale.contiguous(),
            no_clip if clip is None else clip.contiguous(), g.keys(segments), packed,
        )

    def encode(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        if extension_for(flat) is None:
            return super().encode(flat, segments, scale, clip)
        return self._ternarize(flat, segments, scale, clip, packed=False)

    def encode_payload(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        # the kernels pack 2 bits: base 3 packs the kernels' ternaries
        if self.group.settings.packing != "2bit" or extension_for(flat) is None:
            return super().encode_payload(flat, segments, scale, clip)
        packed, nonzero = self._ternarize(flat, segments, scale, clip, packed=True)
        return self.group.place(packed, self.group.pack_layout(segments)), nonzero

    def scale_int8(self, packet: FlatPacket) -> Tensor:
        g, payload = self.group, packet.payload
        ext = extension_for(payload)
        if ext is None:
            return super().scale_int8(packet)
        return ext.terngrad_scale_int8_flat(
            payload.contiguous(), g.chunk_layout(packet.segments).offsets(), g.bucket(),
            packet.ctx["scale"].to(torch.float32).contiguous(), payload.new_empty(0, dtype=torch.float32),
        )

    def _decodes(self, packets: Sequence[FlatPacket]) -> bool:
        """Whether the kernels decode these packets (2-bit packed payloads, where the kernels run)."""
        first = packets[0].payload
        return first.dtype == torch.uint8 and self.group.settings.packing == "2bit" and extension_for(first) is not None

    def _decode_sum(self, packets: Sequence[FlatPacket], scale: Tensor, out: Optional[Tensor], divisor: int) -> Tensor:
        """float32 flat: the integer sum of the packets' ternaries, scaled once, divided by ``divisor`` (one call)."""
        g, first = self.group, packets[0]
        layout = g.pack_layout(first.segments)
        ext = extension_for(first.payload)
        assert ext is not None, "decoded by the kernels only where they run (_decodes)"
        return ext.terngrad_decode_sum_flat(
            [p.payload.contiguous() for p in packets], g.chunk_layout(first.segments).offsets(), layout.starts(),
            g.bucket(), scale.to(torch.float32).contiguous(),
            first.payload.new_empty(0, dtype=torch.float32) if out is None else out, divisor,
        )

    def decode(self, packet: FlatPacket, scale: Tensor) -> Tensor:
        if not self._decodes([packet]):
            return super().decode(packet, scale)
        return self._decode_sum([packet], scale, None, 1)

    def mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        first, ranks = packets[0], len(packets)
        if "scale" not in first.ctx or not self._decodes(packets):
            return super().mean_into(packets, out)
        # divides in the pass that writes, as the per-layer kernels do
        scale = first.ctx["scale"]
        if out.dtype == torch.float32 and out.is_contiguous():
            self._decode_sum(packets, scale, out.view(-1), ranks)
            return out
        return out.copy_(self._decode_sum(packets, scale, None, ranks))


class TritonTernGrad(TorchTernGrad):
    """TernGrad's group step in Triton kernels: ternarize and pack, decode-and-average, decode of the int8 form (the
    statistics stay torch ops); per-worker scalers of another dtype than float32 average by the torch ops."""

    name: Kernels = "triton"

    def _encode(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor], packed: bool
    ) -> tuple[Tensor, Tensor]:
        """The ternaries (int8, or the payload with its packed bytes in place: in either packing, a per-worker
        payload's scaler bytes still to be written) and the nonzero count of each layer."""
        g = self.group
        x = flat.detach().reshape(-1).contiguous()
        tables = g.tables(segments, x.device)
        keys = g.keys_on(segments, x.device)
        scale, clip = scale.contiguous(), None if clip is None else clip.contiguous()
        bucket = g.settings.bucket_size
        if not packed:
            return triton_terngrad.ternarize(x, tables, keys, scale, clip, bucket)
        layout = g.pack_layout(segments)
        payload = torch.empty(sum(layout.layer_nbytes), dtype=torch.uint8, device=x.device)
        nonzero = triton_terngrad.ternarize_pack(x, tables, keys, scale, clip, bucket, layout.per, layout.radix, payload)
        return payload, nonzero

    def encode(self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return self._encode(flat, segments, scale, clip, packed=False)

    def encode_payload(
        self, flat: Tensor, segments: Segments, scale: Tensor, clip: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        return self._encode(flat, segments, scale, clip, packed=True)

    def scale_int8(self, packet: FlatPacket) -> Tensor:
        values = packet.payload.reshape(-1).contiguous()
        tables = self.group.tables(packet.segments, values.device)
        scale = packet.ctx["scale"].to(values.device, torch.float32).contiguous()
        return triton_terngrad.scale_int8(values, tables, scale, self.group.settings.bucket_size)

    def _decode(
        self, first: FlatPacket, base: Tensor, stride: int, ranks: int, scale: Tensor, out: Optional[Tensor]
    ) -> Tensor:
        """float32 ``[total]``: ``ranks`` packed payloads (from ``base``, ``stride`` bytes apart; laid out as
        ``first``'s) decoded in one Triton launch, summed (shared ``scale`` ``[chunks]``: the integer sum scaled
        once; per-worker ``[ranks, chunks]``: in rank order), divided by ``ranks`` into ``out`` (float32, contiguous)
        when given, else not divided."""
        g = self.group
        layout: PackLayout = g.pack_layout(first.segments)
        target = torch.empty(first.segments.total, dtype=torch.float32, device=base.device) if out is None else out
        return triton_terngrad.decode(
            base, stride, ranks, g.tables(first.segments, base.device),
            scale.to(base.device, torch.float32).contiguous(), "scale" in first.ctx, g.settings.bucket_size,
            layout.per, layout.radix, target, out is not None,
        )

    def decode(self, packet: FlatPacket, scale: Tensor) -> Tensor:
        return self._decode(packet, packet.payload.contiguous(), 0, 1, scale, None)

    def mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """One Triton launch, the same ops after it as the torch path has (per-worker scalers of another dtype round
        each rank's decoded tensor: the torch path)."""
        first, ranks = packets[0], len(packets)
        shared = "scale" in first.ctx
        if not shared and first.dtype != torch.float32:
            return super().mean_into(packets, out)
        base, stride = _rank_rows([p.payload for p in packets])
        if shared:
            scale = first.ctx["scale"]
        else:  # every rank's scalers from its payload: [ranks, chunks]
            layout = self.group.pack_layout(first.segments)
            rows = base.as_strided((ranks, sum(layout.layer_nbytes)), (stride, 1))
            scale = rows.index_select(1, layout.payload_index(base.device)[1]).view(torch.float32)
        if out.dtype == torch.float32 and out.is_contiguous():
            self._decode(first, base, stride, ranks, scale, out.view(-1))
            return out
        total = self._decode(first, base, stride, ranks, scale, None)
        # as the torch path: a shared scaler's scaled sum in the packet's dtype; per worker, the float32 sum
        return out.copy_(total.to(first.dtype) if shared else total).div_(ranks)


def _rank_rows(payloads: Sequence[Tensor]) -> tuple[Tensor, int]:
    """The ranks' uint8 payloads as (rank 0's, stride in bytes to the next rank's): the gathered buffer's rows as
    they are when evenly spaced in one storage (the hook's all-gather), else stacked (one copy)."""
    first = payloads[0]
    if len(payloads) == 1:
        return first.contiguous(), 0
    step = payloads[1].data_ptr() - first.data_ptr()
    rows = all(
        p.is_contiguous() and p.numel() == first.numel()
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.data_ptr() - first.data_ptr() == r * step
        for r, p in enumerate(payloads)
    )
    if rows and step >= first.numel():
        return first, step
    return torch.stack([p.reshape(-1) for p in payloads]), first.numel()


#: TernGrad's provider of each kernel set
TERNGRAD_KERNELS: dict[Kernels, type[TorchTernGrad]] = {
    "torch": TorchTernGrad,
    "fused": CompiledTernGrad,
    "triton": TritonTernGrad,
}

__all__ = ["TERNGRAD_KERNELS", "CompiledTernGrad", "TorchTernGrad", "TritonTernGrad"]
