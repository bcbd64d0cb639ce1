"""What crosses the WAN: per-layer ternary weight updates with a scale, their exact byte encoding, and the compressor
that makes them (:class:`WanMessage`).

The ternary values come from compressors (:class:`~lightning_gradcomp.compressors.loss_aware.LossAwareTernary`,
Hou et al.'s loss-aware ternarization; :class:`~lightning_gradcomp.compressors.TernGrad`'s stochastic rounding at scale
``max|x|``); this module encodes them, and :class:`WanMessage` is that encoding as a group-level compressor, so a WAN
round is a call of the hook's exchange (:func:`~lightning_gradcomp.exchange.hook.gradcomp_hook`).

Encoding (:func:`encode`/:func:`decode`): a message is an int32 header of ``(kind, count)`` per layer followed
by each non-empty layer's body. Per layer the smaller of a dense and a sparse body is chosen, so an update
whose significant part is small costs little: dense ternary ``4 + ceil(n/4)`` bytes (fp32 scale + 2-bit
codes), sparse ternary ``4 + 4k`` bytes (scale + one int32 per non-zero: ``2*index + (value < 0)``); without
quantization dense fp32 ``4n`` or sparse ``8k`` (int32 index + fp32 value); an all-zero layer costs only its
header. A message's bytes are attributed to its layers as each layer's header entry and body.
"""

from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes, unpack_ternary

EMPTY, DENSE_TERNARY, SPARSE_TERNARY, DENSE_FP32, SPARSE_FP32 = 0, 1, 2, 3, 4
#: bytes of one layer's ``(kind, count)`` entry in the header
HEADER_ENTRY_BYTES = 8


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _body_nbytes(kind: int, count: int, numel: int, layer: int = 0) -> int:
    """Bytes of a layer's body of ``kind`` (``count`` non-zeros of ``numel`` values): the one statement of the sizes,
    which the encoder's dense-or-sparse choice, the decoder's slicing and :func:`layer_nbytes` read."""
    if kind == EMPTY:
        return 0
    if kind == DENSE_TERNARY:
        return 4 + packed_nbytes(numel, "2bit")
    if kind == SPARSE_TERNARY:
        return 4 + 4 * count
    if kind == DENSE_FP32:
        return 4 * numel
    if kind == SPARSE_FP32:
        return 8 * count
    raise ValueError(
        f"Expected a layer kind between {EMPTY} and {SPARSE_FP32} in the WeightGrad message's header but got {kind} "
        f"for layer {layer}. Fix: decode a message made by `encode`, with the sizes of the layers it was encoded from."
    )


def encode(layers: Sequence[tuple[Optional[Tensor], Tensor]]) -> Tensor:
    """Encode per-layer updates into one uint8 message.

    Args:
        layers: per layer, ``(scale, b)`` with ``b`` int8 ternary values (quantized), or ``(None, x)`` with ``x``
            float32 values (unquantized).
    """
    return _encode(layers)[0]


def _encode(layers: Sequence[tuple[Optional[Tensor], Tensor]]) -> tuple[Tensor, list[int]]:
    """:func:`encode`'s message and its header as host integers (``kind, count`` per layer), which the encoder
    already holds: the sizes per layer come from it without reading the message back."""
    header: list[int] = []
    bodies: list[Tensor] = []
    for scale, values in layers:
        flat = values.reshape(-1)
        idx = torch.nonzero(flat).reshape(-1)
        k, n = idx.numel(), flat.numel()
        if k == 0:
            header += [EMPTY, 0]
            continue
        if scale is not None:
            s = _as_bytes(scale.reshape(1).float())
            if _body_nbytes(SPARSE_TERNARY, k, n) < _body_nbytes(DENSE_TERNARY, k, n):
                codes = (idx.to(torch.int32) * 2 + (flat[idx] < 0).to(torch.int32)).to(torch.int32)
                header += [SPARSE_TERNARY, k]
                bodies += [s, _as_bytes(codes)]
            else:
                header += [DENSE_TERNARY, n]
                bodies += [s, pack_ternary(flat, "2bit")]
        else:
            if _body_nbytes(SPARSE_FP32, k, n) < _body_nbytes(DENSE_FP32, k, n):
                header += [SPARSE_FP32, k]
                bodies += [_as_bytes(idx.to(torch.int32)), _as_bytes(flat[idx].float())]
            else:
                header += [DENSE_FP32, n]
                bodies.append(_as_bytes(flat.float()))
    head = _as_bytes(torch.tensor(header, dtype=torch.int32))
    return (torch.cat([head, *bodies]) if bodies else head), header


def _view(raw: Tensor, dtype: torch.dtype) -> Tensor:
    # a slice of a byte buffer may be misaligned for wider dtypes: copy before reinterpreting
    return raw if dtype == torch.uint8 else raw.clone().view(dtype)


def _header(message: Tensor, num: int) -> list[int]:
    return _view(message[: HEADER_ENTRY_BYTES * num], torch.int32).tolist()


def _layer_nbytes(header: Sequence[int], numels: Sequence[int]) -> tuple[int, ...]:
    """Each layer's bytes in a message with this header (its header entry and its body; they add up to the message's
    length)."""
    return tuple(HEADER_ENTRY_BYTES + _body_nbytes(header[2 * i], header[2 * i + 1], n, i) for i, n in enumerate(numels))


def decode(message: Tensor, numels: Sequence[int]) -> list[Tensor]:
    """Decode a message of :func:`encode` into dense float32 tensors of the given sizes (flat)."""
    header = _header(message, len(numels))
    offset = HEADER_ENTRY_BYTES * len(numels)
    out: list[Tensor] = []
    for i, n in enumerate(numels):
        kind, count = header[2 * i], header[2 * i + 1]
        end = offset + _body_nbytes(kind, count, n, i)
        body, offset = message[offset:end], end
        dense = torch.zeros(n, dtype=torch.float32, device=message.device)
        if kind == DENSE_TERNARY:
            dense = unpack_ternary(body[4:], n, "2bit").float() * _view(body[:4], torch.float32)
        elif kind == SPARSE_TERNARY:
            codes = _view(body[4:], torch.int32)
            signs = 1.0 - 2.0 * (codes % 2).float()
            dense[(codes // 2).long()] = signs * _view(body[:4], torch.float32)
        elif kind == DENSE_FP32:
            dense = _view(body, torch.float32)
        elif kind == SPARSE_FP32:
            dense[_view(body[: 4 * count], torch.int32).long()] = _view(body[4 * count :], torch.float32)
        out.append(dense)
    return out


class Ternarizer(Protocol):
    """What :class:`WanMessage` asks of its quantizer: ternary values (int8, the tensor's flat length) and the scale
    of one layer, drawn from ``name``'s stream where it draws (:meth:`TernGrad.ternarize
    <lightning_gradcomp.compressors.TernGrad.ternarize>`, :meth:`LossAwareTernary.ternarize
    <lightning_gradcomp.compressors.loss_aware.LossAwareTernary.ternarize>`)."""

    def ternarize(self, tensor: Tensor, *, name: str) -> tuple[Tensor, Tensor]: ...

    def setup(self, rank: int, world_size: int, device: torch.device) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class WanMessage(Compressor):
    """WeightGrad's WAN message as a compressor: a group of layers ternarized per layer with a scale (or sent as
    fp32 values) and encoded into one variable-size message (:func:`encode`), gathered from every site.

    The message carries its own layout (its header), so its packets are ``self_describing``: the exchange sends only
    each message's length ahead of it. No error feedback of its own (``uses_memory`` is off): what a site did not
    send stays the engine's (:attr:`~lightning_gradcomp.outer.engine.OuterSync.memory`).

    Args:
        quantizer: ternarizes each layer with its scale (``None``: every layer as fp32 values). Set up with this
            compressor's :meth:`setup`; its state (random streams) is this compressor's.
        float_names: layers sent as fp32 values even with a quantizer (the strategy's ``exclude`` / ``min_numel``).
    """

    aggregation = Aggregation.GATHER
    fixed_size = False

    def __init__(self, quantizer: Optional[Ternarizer] = None, float_names: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.float_names = frozenset(float_names)

    @override
    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        if self.quantizer is not None:
            self.quantizer.setup(rank, world_size, device)

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        layers: list[tuple[Optional[Tensor], Tensor]] = []
        for name, x in segments.items(flat):
            if self.quantizer is None or name in self.float_names:
                layers.append((None, x.float()))
            else:
                b, scale = self.quantizer.ternarize(x, name=name)
                layers.append((scale.reshape(()), b))
        message, header = _encode(layers)
        return FlatPacket(message, segments, flat.dtype, _layer_nbytes(header, segments.numels), self_describing=True)

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        parts = decode(packet.payload, packet.segments.numels)
        return (torch.cat(parts) if len(parts) > 1 else parts[0]).to(packet.dtype)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.quantizer is None else self.quantizer.state_dict()

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.quantizer is not None:
            self.quantizer.load_state_dict(state)

    @override
    def describe(self) -> dict[str, Any]:
        quantizer = None if self.quantizer is None else type(self.quantizer).__name__
        return {"compressor": "WanMessage", "quantizer": quantizer, "float_names": sorted(self.float_names)}
