"""What crosses the WAN: per-layer ternary weight updates with a scale, and their exact byte encoding.

The ternary values come from compressors (:class:`~lightning_gradcomp.compressors.loss_aware.LossAwareTernary`,
Hou et al.'s loss-aware ternarization; :class:`~lightning_gradcomp.compressors.TernGrad`'s stochastic rounding at scale
``max|x|``); this module only encodes them.

Encoding (:func:`encode`/:func:`decode`): a message is an int32 header of ``(kind, count)`` per layer followed
by each non-empty layer's body. Per layer the smaller of a dense and a sparse body is chosen, so an update
whose significant part is small costs little: dense ternary ``4 + ceil(n/4)`` bytes (fp32 scale + 2-bit
codes), sparse ternary ``4 + 4k`` bytes (scale + one int32 per non-zero: ``2*index + (value < 0)``); without
quantization dense fp32 ``4n`` or sparse ``8k`` (int32 index + fp32 value); an all-zero layer costs only its
header.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes, unpack_ternary

EMPTY, DENSE_TERNARY, SPARSE_TERNARY, DENSE_FP32, SPARSE_FP32 = 0, 1, 2, 3, 4


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def encode(layers: Sequence[tuple[Optional[Tensor], Tensor]]) -> Tensor:
    """Encode per-layer updates into one uint8 message.

    Args:
        layers: per layer, ``(scale, b)`` with ``b`` int8 ternary values (quantized), or ``(None, x)`` with ``x``
            float32 values (unquantized).
    """
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
            if 4 * k < packed_nbytes(n, "2bit"):
                codes = (idx.to(torch.int32) * 2 + (flat[idx] < 0).to(torch.int32)).to(torch.int32)
                header += [SPARSE_TERNARY, k]
                bodies += [s, _as_bytes(codes)]
            else:
                header += [DENSE_TERNARY, n]
                bodies += [s, pack_ternary(flat, "2bit")]
        else:
            if 8 * k < 4 * n:
                header += [SPARSE_FP32, k]
                bodies += [_as_bytes(idx.to(torch.int32)), _as_bytes(flat[idx].float())]
            else:
                header += [DENSE_FP32, n]
                bodies.append(_as_bytes(flat.float()))
    head = _as_bytes(torch.tensor(header, dtype=torch.int32))
    return torch.cat([head, *bodies]) if bodies else head


def _take(raw: Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> tuple[Tensor, int]:
    # a slice of a byte buffer may be misaligned for wider dtypes: copy before reinterpreting
    chunk = raw[offset : offset + nbytes]
    return (chunk if dtype == torch.uint8 else chunk.clone().view(dtype)), offset + nbytes


def decode(message: Tensor, numels: Sequence[int]) -> list[Tensor]:
    """Decode a message of :func:`encode` into dense float32 tensors of the given sizes (flat)."""
    num = len(numels)
    header, offset = _take(message, 0, 8 * num, torch.int32)
    out: list[Tensor] = []
    for i, n in enumerate(numels):
        kind, count = int(header[2 * i]), int(header[2 * i + 1])
        dense = torch.zeros(n, dtype=torch.float32, device=message.device)
        if kind == DENSE_TERNARY:
            scale, offset = _take(message, offset, 4, torch.float32)
            packed, offset = _take(message, offset, packed_nbytes(n, "2bit"), torch.uint8)
            dense = unpack_ternary(packed, n, "2bit").float() * scale
        elif kind == SPARSE_TERNARY:
            scale, offset = _take(message, offset, 4, torch.float32)
            codes, offset = _take(message, offset, 4 * count, torch.int32)
            signs = 1.0 - 2.0 * (codes % 2).float()
            dense[(codes // 2).long()] = signs * scale
        elif kind == DENSE_FP32:
            dense, offset = _take(message, offset, 4 * n, torch.float32)
        elif kind == SPARSE_FP32:
            idx, offset = _take(message, offset, 4 * count, torch.int32)
            vals, offset = _take(message, offset, 4 * count, torch.float32)
            dense[idx.long()] = vals
        elif kind != EMPTY:
            raise ValueError(f"Corrupt WeightGrad message: unknown layer kind {kind} for layer {i}.")
        out.append(dense)
    return out
