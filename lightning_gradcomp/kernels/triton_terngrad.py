"""TernGrad's group kernels for CUDA in Triton: ternarize (and pack), decode-and-average, one launch per group.

They compute what :class:`~lightning_gradcomp.compressors.terngrad_group.FlatTernGrad`'s torch ops compute (its
CUDA path before these kernels, still its path without Triton), bit for bit:

* :func:`ternarize`: per element the counter-based uniform of :mod:`lightning_gradcomp.kernels.rng` (keys per
  layer from an int64 ``[layers, 2]`` tensor, the element's index within its layer), the clip, the scaler of its
  chunk, the int8 ternary (the all-reduce form); and each layer's nonzero count.
* :func:`ternarize_pack`: the same ternaries packed per layer as ``FlatTernGrad.pack`` packs them (codes t + 1,
  ``per`` parts per byte, padding 1), written at each layer's place in the payload (the all-gather form).
* :func:`decode`: every rank's packed payload decoded in rank order, scaled (the integer sum scaled once with a
  shared scaler; each rank's ternaries times its own scalers, summed in rank order, otherwise) and divided by the
  number of ranks as ``Tensor.div_`` by an int rounds on that device: a true division on the CPU, a multiplication
  by the float32 reciprocal on CUDA (ATen's ``div_true_kernel_cuda`` for a scalar divisor).
* :func:`scale_int8`: int8 values (ternaries or their sum over ranks) times their chunks' scalers.

Where the torch ops read an int64 index per element (segment ids, index within the layer), these kernels read a
table of tiles (:class:`GroupTables`): each program takes ``BLOCK`` elements (or packed bytes) of one layer, so a
kernel reads the gradient once and writes its output once.

Triton is imported on first use (:mod:`~lightning_gradcomp.kernels.triton_launch` says whether it imports, and
launches); under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors in Triton's interpreter.
"""

from collections.abc import Sequence
from types import ModuleType
from typing import Optional

import numpy
import torch
from torch import Tensor

from lightning_gradcomp.kernels.triton_launch import bodies, launch, tiles

#: elements per program of the element kernels; packed bytes per program of the packing and decoding kernels
ELEMENT_BLOCK = 1024
BYTE_BLOCK = 256


def _jit() -> ModuleType:
    return bodies("_triton_terngrad_jit")


class GroupTables:
    """The per-layer and per-tile tables the kernels read for one group of layers, on one device.

    Args:
        numels: elements of each layer.
        chunks: chunks (scalers) of each layer (none for an empty layer).
        packed: packed bytes of each layer.
        starts: where each layer's packed bytes start in the payload.
        device: where the kernels run.
    """

    def __init__(
        self, numels: Sequence[int], chunks: Sequence[int], packed: Sequence[int], starts: Sequence[int],
        device: torch.device,
    ) -> None:
        offsets = [0]
        first_chunk = [0]
        for n, c in zip(numels, chunks):
            offsets.append(offsets[-1] + n)
            first_chunk.append(first_chunk[-1] + c)
        columns = (offsets[:-1], list(numels), list(packed), list(starts), first_chunk[:-1])
        #: int64 ``[layers, 5]``: offset, numel, packed bytes, payload start, first chunk of each layer
        self.meta = torch.tensor(list(zip(*columns)), dtype=torch.int64).reshape(-1, 5).to(device)
        self.elements = tiles(numels, ELEMENT_BLOCK).to(device)
        self.bytes = tiles(packed, BYTE_BLOCK).to(device)
        self.layers = len(numels)
        self.total = offsets[-1]


def _bucket(bucket: Optional[int]) -> tuple[int, bool]:
    """The kernels' chunk length and whether layers have several chunks (``None``: one chunk per layer)."""
    return (bucket, True) if bucket else (1, False)


def _launch_tiles(kernel: object, table: Tensor, *args: object, **constants: object) -> None:
    launch(kernel, table.shape[0], *args, **constants)  # one program per row of the tile table


def _packing(per: int, radix: int) -> dict[str, int]:
    return {"PER": per, "PER_P2": 1 << (per - 1).bit_length(), "RADIX": radix}


def ternarize(
    x: Tensor, tables: GroupTables, keys: Tensor, scale: Tensor, clip: Optional[Tensor], bucket: Optional[int]
) -> tuple[Tensor, Tensor]:
    """int8 ``[total]`` ternaries of the flat float32 ``x`` and int32 ``[layers]`` nonzero counts.

    Args:
        x: the group's gradients, contiguous (float32, or a float type read as float32).
        tables: the group's tables on ``x``'s device.
        keys: int64 ``[layers, 2]``: each layer's stream keys (k0, k1) on ``x``'s device.
        scale: float32 ``[chunks]`` scalers.
        clip: float32 ``[chunks]`` clip thresholds, or ``None`` (no clipping).
        bucket: the chunk length (``None``: one chunk per layer).
    """
    out = torch.empty(tables.total, dtype=torch.int8, device=x.device)
    nonzero = torch.zeros(tables.layers, dtype=torch.int32, device=x.device)
    length, chunked = _bucket(bucket)
    _launch_tiles(
        _jit().ternarize_kernel, tables.elements, x, tables.meta, tables.elements, keys, scale,
        scale if clip is None else clip, out, nonzero, length,
        HAS_CLIP=clip is not None, CHUNKED=chunked, BLOCK=ELEMENT_BLOCK,
    )
    return out, nonzero


def ternarize_pack(
    x: Tensor, tables: GroupTables, keys: Tensor, scale: Tensor, clip: Optional[Tensor], bucket: Optional[int],
    per: int, radix: int, out: Tensor,
) -> Tensor:
    """The ternaries of :func:`ternarize` packed ``per`` codes a byte in base ``radix``, each layer's bytes written into
    the uint8 ``out`` from its payload start on (the bytes between, e.g. scalers, are left as they are); returns the
    int32 ``[layers]`` nonzero counts."""
    nonzero = torch.zeros(tables.layers, dtype=torch.int32, device=x.device)
    length, chunked = _bucket(bucket)
    _launch_tiles(
        _jit().ternarize_pack_kernel, tables.bytes, x, tables.meta, tables.bytes, keys, scale,
        scale if clip is None else clip, out, nonzero, length,
        HAS_CLIP=clip is not None, CHUNKED=chunked, BLOCK=BYTE_BLOCK, **_packing(per, radix),
    )
    return nonzero


def reciprocal_division(device: torch.device) -> bool:
    """Whether ``Tensor.div_`` of float32 by a Python int multiplies by the float32 reciprocal on ``device`` (CUDA,
    ATen's ``div_true_kernel_cuda``) rather than dividing (the CPU)."""
    return device.type == "cuda"


def decode(
    payloads: Tensor, rank_stride: int, ranks: int, tables: GroupTables, scale: Tensor, shared: bool,
    bucket: Optional[int], per: int, radix: int, out: Tensor, divide: bool,
) -> Tensor:
    """Decode ``ranks`` packed payloads into the float32 contiguous ``out`` ``[total]``: their mean when ``divide``,
    else their sum.

    Args:
        payloads: rank 0's uint8 payload; rank r's starts ``r * rank_stride`` bytes after it, in the same storage.
        rank_stride: bytes from one rank's payload to the next.
        ranks: payloads decoded.
        tables: the group's tables on the payloads' device.
        scale: float32 ``[chunks]`` scalers shared by the ranks (``shared``), else ``[ranks, chunks]`` contiguous.
        shared: whether the ranks share one scaler per chunk (then the integer sum is scaled once).
        bucket: the chunk length (``None``: one chunk per layer).
        per: codes per byte.
        radix: 4 (2-bit codes) or 3 (base 3).
        out: float32 contiguous ``[total]``.
        divide: divide by ``ranks`` as ``Tensor.div_`` rounds on ``out``'s device (see :func:`reciprocal_division`).
    """
    length, chunked = _bucket(bucket)
    mode = 0 if not divide else 2 if reciprocal_division(out.device) else 1
    # the float32 reciprocal (correctly rounded, on the host) to multiply by, or the ranks to divide by
    divisor = float(numpy.float32(1.0) / numpy.float32(ranks)) if mode == 2 else float(ranks)
    _launch_tiles(
        _jit().decode_kernel, tables.bytes, payloads, rank_stride, ranks, tables.meta, tables.bytes, scale,
        0 if shared else scale.shape[-1], out, length, divisor,
        SHARED=shared, DIVIDE=mode, CHUNKED=chunked, BLOCK=BYTE_BLOCK, **_packing(per, radix),
    )
    return out


def scale_int8(values: Tensor, tables: GroupTables, scale: Tensor, bucket: Optional[int]) -> Tensor:
    """float32 ``[total]``: the int8 ``values`` times the scalers of their chunks."""
    out = torch.empty(tables.total, dtype=torch.float32, device=values.device)
    length, chunked = _bucket(bucket)
    _launch_tiles(
        _jit().scale_int8_kernel, tables.elements, values, tables.meta, tables.elements, scale, out, length,
        CHUNKED=chunked, BLOCK=ELEMENT_BLOCK,
    )
    return out


__all__ = [
    "BYTE_BLOCK", "ELEMENT_BLOCK", "GroupTables", "decode", "reciprocal_division", "scale_int8", "ternarize",
    "ternarize_pack",
]
