"""One tensor at a time: the per-tensor calls on any compressor, and compressors written per tensor.

The compressor contract (:class:`~lightning_gradcomp.compressors.base.Compressor`) is written for a group of layers,
as the hook runs it. This module serves the two needs that are about one tensor, as torch keeps ``powerSGD_hook``
beside ``batched_powerSGD_hook``:

* :class:`LayerLoop`: a compressor written per tensor (``compress``/``decompress`` of one tensor) served to the
  group contract by a loop over the group's layers (per-layer packets kept in ``FlatPacket.layers``), for a user's
  compressor or a reference implementation; the registered compressors are all written for groups.
* :func:`per_tensor` (:class:`PerTensor`, the same loop): ``compress(tensor)``, ``decompress(packet)`` and the other
  per-tensor calls on a compressor written for groups: a single tensor is a group of one, so the call runs the group
  code unchanged.
"""

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, GradientObserver, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Packet, Segments


def layer_segments(compressor: Compressor, name: str, shape: torch.Size) -> Segments:
    """The group of one layer. Kept per (name, shape) on the compressor, so the group code's layouts and index
    tensors, cached per group layout, are built once per layer as in the hook."""
    groups: dict[tuple[str, torch.Size], Segments] = compressor.__dict__.setdefault("_groups_of_one", {})
    key = (name, torch.Size(shape))
    group = groups.get(key)
    if group is None:
        group = groups[key] = Segments([name], [shape])
    return group


def _layer_packet(group: FlatPacket) -> Packet:
    """The packet of a group of one (its statistics as 0-d tensors); a looping group's own layer packet."""
    if group.layers is not None:
        return group.layers[0]
    return Packet(group.payload, group.segments.shapes[0], group.dtype, dict(group.ctx),
                  {k: v.reshape(()) for k, v in group.stats.items()})


def layer_group_packet(compressor: Compressor, packet: Packet) -> FlatPacket:
    """A one-tensor packet as the group of one it came from (the layer's name plays no part in decoding)."""
    return FlatPacket(packet.payload, layer_segments(compressor, "", packet.shape), packet.dtype, (packet.nbytes,),
                      dict(packet.ctx))


class LayerLoop(GradientObserver):
    """A compressor written per tensor: implement :meth:`compress` and :meth:`decompress` (and, where needed,
    :meth:`local_statistic`, :meth:`observe_gradient`, :meth:`sent`, :meth:`decompress_sum`); the group contract
    loops over a group's layers with them, keeping the per-layer packets in ``FlatPacket.layers``.
    """

    # -- one tensor ----------------------------------------------------------------------------------------------
    def local_statistic(self, tensor: Tensor, name: str) -> Optional[Tensor]:
        """A small float32 tensor to be max-reduced over ranks before :meth:`compress`, or ``None`` (default)."""
        return None

    def observe_gradient(self, grad: Tensor, name: str) -> None:
        """This rank's gradient of ``name`` before its residual is added (compressors with memory); default: nothing."""

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        """Compress ``tensor`` (the gradient of parameter ``name``; not modified) into a packet.

        Args:
            tensor: the gradient.
            name: the parameter's name.
            shared: the max over ranks of :meth:`local_statistic`; ``None`` uses the local statistic.
        """
        raise NotImplementedError(f"Expected {type(self).__name__} to implement `compress` but got none. "
                                  f"Fix: implement `compress` and `decompress` of one tensor.")

    def decompress(self, packet: Packet) -> Tensor:
        """Decode one packet to a dense tensor of ``packet.shape`` and ``packet.dtype`` (linear in the payload for
        ``Aggregation.SUM``)."""
        raise NotImplementedError(f"Expected {type(self).__name__} to implement `decompress` but got none. "
                                  f"Fix: implement it beside `compress`.")

    def sent(self, tensor: Tensor, packet: Packet) -> Tensor:
        """What this rank contributed for ``tensor`` (default: its own packet decoded)."""
        return self.decompress(packet)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        """The sum of the decoded packets in rank order (override with a cheaper exact equivalent)."""
        total = self.decompress(packets[0]).clone()
        for packet in packets[1:]:
            total.add_(self.decompress(packet))
        return total

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """:meth:`decompress_sum` written into ``out`` (bit for bit); returns ``out``."""
        return out.copy_(self.decompress_sum(packets))

    def decompress_mean_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """The ranks' mean into ``out``: ``decompress_sum_into(packets, out) / len(packets)``, bit for bit."""
        return self.decompress_sum_into(packets, out).div_(len(packets))

    # -- the group contract, a loop over the layers --------------------------------------------------------------
    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        local = [self.local_statistic(x, name) for name, x in segments.items(flat)]
        if all(s is None for s in local):
            return None
        present = [s.reshape(-1).float() for s in local if s is not None]
        return SharedStatistic(torch.cat(present), tuple(-1 if s is None else s.numel() for s in local))

    def observe_gradient_flat(self, flat: Tensor, segments: Segments) -> None:
        for name, x in segments.items(flat):
            self.observe_gradient(x, name)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        per_layer = shared.per_layer() if shared is not None else [None] * len(segments)
        packets = [self.compress(x, name, s) for (name, x), s in zip(segments.items(flat), per_layer)]
        dtypes = {p.payload.dtype for p in packets}
        parts = [p.payload.reshape(-1) if len(dtypes) == 1 else p.payload.reshape(-1).view(torch.uint8) for p in packets]
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        return FlatPacket(payload, segments, flat.dtype, tuple(p.nbytes for p in packets), layers=packets)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        parts = [self.decompress(p).reshape(-1) for p in self._layers(packet)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        for i, view in enumerate(packets[0].segments.views(out)):
            self.decompress_mean_into([self._layers(p)[i] for p in packets], view)
        return out

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        parts = [self.sent(x, p).reshape(-1) for x, p in zip(packet.segments.views(flat), self._layers(packet))]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _layers(self, packet: FlatPacket) -> list[Packet]:
        """A group packet's per-layer packets (a group of one made from a lone packet is that packet)."""
        if packet.layers is not None:
            return packet.layers
        assert len(packet.segments) == 1, f"{type(self).__name__} decodes looping packets, not batched ones"
        return [Packet(packet.payload, packet.segments.shapes[0], packet.dtype, dict(packet.ctx))]


class PerTensor(LayerLoop):
    """A compressor written for groups, one tensor at a time: each per-tensor call is its group method on a group of
    one, and (as a :class:`LayerLoop`) its group methods are a loop over the layers with those calls: the looping
    reference a group's batched code is tested against.

    Args:
        compressor: the compressor (set up or not: without ``setup`` it is rank 0 of 1). Its state is this one's.
    """

    def __init__(self, compressor: Compressor) -> None:
        super().__init__()
        self.compressor = compressor
        self.aggregation = compressor.aggregation
        self.uses_memory = compressor.uses_memory
        self.fixed_size = compressor.fixed_size

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        self.compressor.setup(rank, world_size, device)
        super().setup(rank, world_size, device)
        self.aggregation = self.compressor.aggregation

    def state_dict(self) -> dict[str, Any]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return self.compressor.describe()

    def local_statistic(self, tensor: Tensor, name: str = "") -> Optional[Tensor]:
        """The tensor's statistic to be max-reduced over ranks before :meth:`compress`, or ``None``."""
        c = self.compressor
        shared = c.flat_statistic(tensor.reshape(-1), layer_segments(c, name, tensor.shape))
        return None if shared is None else shared.values

    def observe_gradient(self, grad: Tensor, name: str = "") -> None:
        """The fresh gradient of ``name`` before its residual is added (for a compressor with memory), before
        :meth:`compress`."""
        if isinstance(self.compressor, GradientObserver):
            self.compressor.observe_gradient_flat(grad.reshape(-1), layer_segments(self.compressor, name, grad.shape))

    def compress(self, tensor: Tensor, name: str = "", shared: Optional[Tensor] = None) -> Packet:
        """Compress ``tensor`` (the gradient of parameter ``name``; not modified) into a packet.

        Args:
            tensor: the gradient.
            name: the parameter's name, for per-layer settings and state (random streams).
            shared: the max over ranks of :meth:`local_statistic`; ``None`` uses the local statistic.
        """
        c = self.compressor
        statistic = None if shared is None else SharedStatistic(shared.reshape(-1).float(), (shared.numel(),))
        return _layer_packet(c.compress_flat(tensor.reshape(-1), layer_segments(c, name, tensor.shape), statistic))

    def decompress(self, packet: Packet) -> Tensor:
        """Decode one packet to a dense tensor of ``packet.shape`` and ``packet.dtype``."""
        return self.compressor.decompress_flat(layer_group_packet(self.compressor, packet)).view(packet.shape)

    def sent(self, tensor: Tensor, packet: Packet) -> Tensor:
        """What this rank contributed for ``tensor`` (its own packet decoded): ``residual = tensor - sent``."""
        group = layer_group_packet(self.compressor, packet)
        return self.compressor.sent_flat(tensor.reshape(-1), group).view(packet.shape)

    def decompress_mean_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """The ranks' mean of gathered packets, written into ``out`` (the hook's averaging); returns ``out``."""
        flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        self.compressor.decompress_flat_mean_into([layer_group_packet(self.compressor, p) for p in packets], flat)
        return out if flat.data_ptr() == out.data_ptr() else out.copy_(flat.view(out.shape))

    # decompress_sum and decompress_sum_into: LayerLoop's, over this class's decompress


def per_tensor(compressor: Compressor) -> Union[PerTensor, LayerLoop]:
    """The per-tensor calls on ``compressor``: itself when it is written per tensor (:class:`LayerLoop`), else
    :class:`PerTensor` (each call the group code on a group of one)."""
    return compressor if isinstance(compressor, LayerLoop) else PerTensor(compressor)


__all__ = ["LayerLoop", "PerTensor", "layer_group_packet", "layer_segments", "per_tensor"]
