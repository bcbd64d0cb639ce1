"""A counter-based random stream: a keyed integer hash of (seed, rank, counter, element index).

Element ``i`` of the ``counter``-th tensor a rank ternarizes draws ``lowbias32(lowbias32(i + k0) ^ k1)``,
where ``(k0, k1)`` are derived from ``(seed, rank, counter)`` with SplitMix64. ``lowbias32`` is Chris
Wellons' 32-bit integer hash (a bijection with low avalanche bias). The stream is a pure function of its
inputs, so the whole generator state is ``(seed, counter)``; any element can be drawn independently of the
others (vectorisable, parallel, identical on CPU, in the torch-ops fallback and on CUDA); and a tensor
shorter than 2**32 elements never repeats a draw. The uniform is the top 24 bits, the resolution of
``torch.rand`` for float32.
"""

import hashlib

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
#: largest tensor the stream indexes without repeating (element indices are 32-bit)
MAX_NUMEL = 2**32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, rank: int, counter: int, stream: int = 0) -> tuple[int, int]:
    """The two 32-bit keys for draw number ``counter`` of ``stream`` (e.g. a parameter) of ``rank``."""
    x = _splitmix64(seed & MASK64)
    for part in (rank, stream, counter):
        x = _splitmix64(x ^ (part & MASK64))
    return x & MASK32, x >> 32


def stream_id(name: str) -> int:
    """A 64-bit stream number for a name (a parameter's), the same in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _mul32(x: Tensor, c: int) -> Tensor:
    # x * c mod 2**32 on int64 without overflow: split c into 16-bit halves (every product < 2**48)
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def lowbias32(x: Tensor) -> Tensor:
    """Wellons' lowbias32 hash of int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_index(index: Tensor, k0: "int | Tensor", k1: "int | Tensor") -> Tensor:
    """The 32-bit draws (as int64) of the given element indices; the keys are one stream's, or int64 tensors of one
    key per element (several streams drawn in one pass: a group of layers)."""
    return lowbias32(lowbias32((index + k0) & MASK32) ^ k1)


def to_uniform(bits: Tensor) -> Tensor:
    """float32 uniforms in [0, 1) with 24 random bits from 32-bit draws (:func:`hash_index`'s)."""
    return (bits >> 8).to(torch.float32) * (2.0**-24)


def uniform(index: Tensor, k0: "int | Tensor", k1: "int | Tensor") -> Tensor:
    """float32 uniforms in [0, 1) with 24 random bits, one per element index."""
    return to_uniform(hash_index(index, k0, k1))


def positions(size: int, numel: int, key: tuple[int, int], device: torch.device) -> Tensor:
    """int64 ``[size]`` positions in [0, numel), uniform with replacement: draw ``i`` is ``hash_index(i) mod numel``
    (the compiled kernels' arithmetic, ``selection.cpp``'s ``sample_abs``)."""
    return hash_index(torch.arange(size, dtype=torch.int64, device=device), *key) % numel
