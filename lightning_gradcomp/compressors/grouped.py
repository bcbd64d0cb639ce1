"""What the batched dense baselines (QSGD, 1-bit SGD) share: layouts derived from a group once, and its payload.

Both send, per layer, fixed-width codes bit-packed to whole bytes followed by float32 values (QSGD's bucket norms,
1-bit's reconstruction values). A group's payload is those per-layer payloads back to back, byte for byte what the
per-layer packets would put on the wire, built and split in a fixed number of ops (:class:`PackedPayload`).
Everything derived from a group's layout (bit paddings, byte permutations, bucket and row layouts) is built on
first use and kept as long as the group's :class:`~lightning_gradcomp.flat.Segments` lives (:func:`derived`):
the hook makes one per group and reuses it every step.
"""

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_gradcomp.wire.bits import bit_padding, pack_bits_segments, unpack_bits_segments

from lightning_gradcomp.flat import Segments

T = TypeVar("T")

_DERIVED: "weakref.WeakKeyDictionary[Segments, dict[Hashable, Any]]" = weakref.WeakKeyDictionary()


def derived(segments: Segments, key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, made once per ``segments`` and ``key`` and kept while ``segments`` lives (what it builds must
    not refer to ``segments``, or neither would ever be freed)."""
    cache = _DERIVED.setdefault(segments, {})
    if key not in cache:
        cache[key] = build()
    value: T = cache[key]
    return value


class PackedPayload:
    """A group's payload: per layer, ``width``-bit codes packed to whole bytes then ``floats[s]`` float32 values.

    Args:
        segments: the group's layout.
        width: bits per code.
        floats: float32 values per layer.
    """

    def __init__(self, segments: Segments, width: int, floats: Sequence[int]) -> None:
        self.numel = segments.total
        self.width = width
        self.bits = bit_padding(segments, width)
        code_bytes = [n // 8 for n in self.bits.numels]
        float_bytes = [4 * f for f in floats]
        self.float_bytes = sum(float_bytes)
        #: bytes each layer puts on the wire, as its per-layer packet does
        self.layer_nbytes: tuple[int, ...] = tuple(c + f for c, f in zip(code_bytes, float_bytes))
        # payload byte j is byte order[j] of cat(all floats, all codes): the floats first, so that splitting leaves
        # them at byte 0 of a fresh tensor, aligned for a float32 view
        parts, code_at, float_at = [], self.float_bytes, 0
        for c, f in zip(code_bytes, float_bytes):
            parts += [torch.arange(code_at, code_at + c), torch.arange(float_at, float_at + f)]
            code_at, float_at = code_at + c, float_at + f
        order = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        self._order = order
        self._inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _indices(self, device: torch.device) -> tuple[Tensor, Tensor]:
        cached = self._on.get(device)
        if cached is None:
            cached = self._on[device] = (self._order.to(device), self._inverse.to(device))
        return cached

    def join(self, codes: Tensor, floats: Tensor) -> Tensor:
        """uint8 payload of the codes (``[total]``, integers below ``2**width``) and floats (float32, layer after
        layer)."""
        source = torch.cat((floats.reshape(-1).view(torch.uint8), pack_bits_segments(codes, self.width, self.bits)))
        return source.index_select(0, self._indices(codes.device)[0])

    def split(self, payload: Tensor) -> tuple[Tensor, Tensor]:
        """(int32 codes ``[total]``, float32 values) of a payload :meth:`join` made (any rank's: same layout)."""
        source = payload.view(torch.uint8).index_select(0, self._indices(payload.device)[1])
        floats = source[: self.float_bytes].view(torch.float32)
        codes = unpack_bits_segments(source[self.float_bytes :], self.numel, self.width, self.bits)
        return codes, floats


__all__ = ["PackedPayload", "derived"]
