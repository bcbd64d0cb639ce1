"""Fixed-width bit packing of small unsigned integers, with exact byte counts.

Used by the 1-bit SGD and QSGD baselines. Each value occupies exactly ``width`` bits, least significant bit
first, values laid end to end: ``n`` values take ``ceil(n * width / 8)`` bytes, nothing more. A group of layers
packs in a fixed number of ops with :func:`pack_bits_segments`, each layer's bits padded to whole bytes as
:func:`pack_bits` pads them. Ternary values have their own denser layouts in :mod:`lightning_gradcomp.wire.ternary`.
"""

import torch
from torch import Tensor

from lightning_gradcomp.flat import Padding, Segments


def packed_bits_nbytes(numel: int, width: int) -> int:
    """Exact number of bytes :func:`pack_bits` produces for ``numel`` values of ``width`` bits."""
    return -(-numel * width // 8)


def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def _bits(values: Tensor, width: int) -> Tensor:
    """uint8 ``[numel * width]``: the bits of every value, value after value, least significant first."""
    flat = values.reshape(-1).to(torch.int32)
    shifts = torch.arange(width, dtype=torch.int32, device=flat.device)
    return ((flat[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)


def _bytes_of_bits(bits: Tensor) -> Tensor:
    """uint8: every 8 bits (a multiple of 8 of them), least significant first, as one byte."""
    return (bits.view(-1, 8) * _bit_weights(bits.device)).sum(dim=1, dtype=torch.uint8)


def _bits_of_bytes(packed: Tensor) -> Tensor:
    """bool ``[8 * bytes]``: inverse of :func:`_bytes_of_bits`."""
    return ((packed.reshape(-1, 1) & _bit_weights(packed.device)) != 0).reshape(-1)


def _values_of_bits(bits: Tensor, numel: int, width: int) -> Tensor:
    """int32 ``[numel]``: inverse of :func:`_bits`."""
    weights = torch.ones(width, dtype=torch.int32, device=bits.device) << torch.arange(
        width, dtype=torch.int32, device=bits.device
    )
    return (bits.view(numel, width).to(torch.int32) * weights).sum(dim=1, dtype=torch.int32)


def pack_bits(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers below ``2**width`` (any integer dtype) into a flat uint8 tensor.

    Args:
        values: the integers to pack; values outside ``[0, 2**width)`` are a caller bug and are not checked
            (the check would need a host sync).
        width: bits per value, 1 to 16.
    """
    bits = _bits(values, width)  # value-major, LSB first
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat((bits, bits.new_zeros(pad)))
    return _bytes_of_bits(bits)


def unpack_bits(packed: Tensor, numel: int, width: int) -> Tensor:
    """Inverse of :func:`pack_bits`: an int32 tensor of ``numel`` values."""
    return _values_of_bits(_bits_of_bytes(packed)[: numel * width], numel, width)


def pack_bits_segments(values: Tensor, width: int, bits: Padding) -> Tensor:
    """:func:`pack_bits` of every segment of ``values``, back to back, in a fixed number of ops.

    Args:
        values: the integers of a group of layers (flat, ``[total]``).
        width: bits per value.
        bits: the layout of the segments' bit streams (``numel * width`` bits each) padded to whole bytes
            (:func:`bit_padding`).
    """
    return _bytes_of_bits(bits.pad(_bits(values, width)))


def unpack_bits_segments(packed: Tensor, numel: int, width: int, bits: Padding) -> Tensor:
    """Inverse of :func:`pack_bits_segments`: int32 ``[numel]`` (``numel``: the group's total)."""
    return _values_of_bits(bits.unpad(_bits_of_bytes(packed)), numel, width)


def bit_padding(segments: Segments, width: int) -> Padding:
    """The bit streams of ``segments`` at ``width`` bits per element, each padded to whole bytes: the layout
    :func:`pack_bits_segments` packs (build once per group and width; its index tensors are cached on it)."""
    streams = Segments(segments.names, [torch.Size([n * width]) for n in segments.numels])
    return streams.padding(8)
