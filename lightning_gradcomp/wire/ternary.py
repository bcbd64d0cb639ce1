"""Bit packing of ternary values, with exact byte counts.

Ternary values t in {-1, 0, +1} are stored as codes c = t + 1 in {0, 1, 2}.

* ``2bit``: four codes per byte, in TernGrad's original quarter-split layout: the flat tensor is padded to a
  multiple of 4 and split into 4 contiguous quarters q1..q4, byte k = q1[k] + 4*q2[k] + 16*q3[k] + 64*q4[k].
  Contiguous quarters keep both encode and decode to strided, vectorisable loads. Exactly ceil(n/4) bytes
  (the original code pads 4 extra elements when n % 4 == 0; we do not).
* ``base3``: five codes per byte as base-3 digits (3**5 = 243 <= 256), ceil(n/5) bytes, 1.6 bits per value,
  the same fifth-split layout.
"""

from typing import Literal

import torch
from torch import Tensor

Packing = Literal["2bit", "base3"]
PACKINGS: tuple[str, ...] = ("2bit", "base3")

_PER_BYTE = {"2bit": 4, "base3": 5}
_ZERO_CODE = 1


def packed_nbytes(numel: int, packing: Packing) -> int:
    """Exact number of bytes :func:`pack_ternary` produces for ``numel`` values."""
    per = _PER_BYTE[packing]
    return -(-numel // per)


def _codes(ternary: Tensor, per: int) -> Tensor:
    n = ternary.numel()
    m = -(-n // per)
    codes = torch.full((per * m,), _ZERO_CODE, dtype=torch.uint8, device=ternary.device)
    codes[:n] = (ternary.reshape(-1) + 1).to(torch.uint8)
    return codes.view(per, m)


def pack_ternary(ternary: Tensor, packing: Packing = "2bit") -> Tensor:
    """Pack a tensor of values in {-1, 0, +1} (any integer or float dtype) into a flat uint8 tensor."""
    per = _PER_BYTE[packing]
    codes = _codes(ternary, per)
    if packing == "2bit":
        return codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6)
    out = codes[4].clone()
    for j in (3, 2, 1, 0):  # Horner: ((c4*3 + c3)*3 + ...)
        out.mul_(3).add_(codes[j])
    return out


_BASE3_TABLES: dict[torch.device, Tensor] = {}


def _base3_table(device: torch.device) -> Tensor:
    table = _BASE3_TABLES.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int16)
        digits = [(values // 3**j) % 3 for j in range(5)]
        table = torch.stack(digits, dim=0).to(torch.int8).to(device)  # [5, 256]
        _BASE3_TABLES[device] = table
    return table


def unpack_ternary(packed: Tensor, numel: int, packing: Packing = "2bit") -> Tensor:
    """Inverse of :func:`pack_ternary`: an int8 tensor of ``numel`` values in {-1, 0, +1}."""
    if packing == "2bit":
        b = packed.to(torch.uint8)
        codes = torch.stack((b & 3, (b >> 2) & 3, (b >> 4) & 3, b >> 6), dim=0)
    else:
        codes = _base3_table(packed.device)[:, packed.long()]
    return codes.reshape(-1)[:numel].to(torch.int8) - 1
