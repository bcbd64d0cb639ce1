"""Fixed-width bit packing of small unsigned integers, with exact byte counts.

Used by the 1-bit SGD and QSGD baselines. Each value occupies exactly ``width`` bits, least significant bit
first, values laid end to end: ``n`` values take ``ceil(n * width / 8)`` bytes, nothing more. Ternary
values have their own denser layouts in :mod:`lightning_gradcomp.wire`.
"""

import torch
from torch import Tensor


def packed_bits_nbytes(numel: int, width: int) -> int:
    """Exact number of bytes :func:`pack_bits` produces for ``numel`` values of ``width`` bits."""
    return -(-numel * width // 8)


def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers below ``2**width`` (any integer dtype) into a flat uint8 tensor.

    Args:
        values: the integers to pack; values outside ``[0, 2**width)`` are a caller bug and are not checked
            (the check would need a host sync).
        width: bits per value, 1 to 16.
    """
    flat = values.reshape(-1).to(torch.int32)
    shifts = torch.arange(width, dtype=torch.int32, device=flat.device)
    bits = ((flat[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)  # value-major, LSB first
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat((bits, bits.new_zeros(pad)))
    return (bits.view(-1, 8) * _bit_weights(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, numel: int, width: int) -> Tensor:
    """Inverse of :func:`pack_bits`: an int32 tensor of ``numel`` values."""
    bits = ((packed.reshape(-1, 1) & _bit_weights(packed.device)) != 0).reshape(-1)[: numel * width]
    weights = torch.ones(width, dtype=torch.int32, device=packed.device) << torch.arange(
        width, dtype=torch.int32, device=packed.device
    )
    return (bits.view(numel, width).to(torch.int32) * weights).sum(dim=1, dtype=torch.int32)
