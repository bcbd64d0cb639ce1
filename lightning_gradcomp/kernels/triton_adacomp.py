"""AdaComp's group kernels for CUDA in Triton: bin maxima, selection and the wire's element words, and the decode.

They compute what :mod:`~lightning_gradcomp.compressors.adacomp_group`'s torch ops compute (the CUDA path of a group
before these kernels, still its path without Triton), bit for bit:

* :func:`bin_maxima`: each bin's max |G| (``scatter_reduce`` amax over bin ids, NaN propagated);
* :func:`select`: the selection |H| >= gmax(bin) and G != 0 (and 2|G| >= the layer scale, ternary) with H = G +
  (scale_factor - 1) dW computed in the kernel, each bin's count and first and last sent offset (what the markers
  are derived from), and the wire's element words written into their word slots with whether each byte is sent.
  The markers and scales (a few words per bin and layer) fill the remaining slots with torch ops, and
  :func:`~lightning_gradcomp.kernels.triton_compact.compact` keeps the sent bytes: ``masked_select``'s result.
* :func:`decode_add`: one rank's payload decoded and added into a dense float32 tensor (``decode_group_words`` and
  ``index_add_``): tiles of each layer's word bytes, the running bin (markers, implicit advances) a scan in two
  launches; a decoder calls it once per rank, in rank order, so each element's sum keeps that order.

A program holds ``BINS`` whole bins of one layer (a ``[BINS, LPAD]`` block, ``LPAD`` the group's longest L_T
rounded up to a power of two), so a bin's maximum and selection are one program's reductions and the grid covers
a group of any layer sizes in one launch. The layer scale stays :func:`~lightning_gradcomp.compressors.adacomp_group.bin_mean`
(a sequential sum per layer; the kernels take its result).
"""

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from lightning_gradcomp.kernels.triton_launch import bodies, launch, tiles

#: elements a program holds at most (whole bins; one bin when L_T is longer)
ELEMENTS = 2048
#: payload bytes a decoding program takes
BYTES = 1024


def _jit() -> ModuleType:
    return bodies("_triton_adacomp_jit")


class Tables:
    """The per-layer and per-tile tables of one group of layers on one device.

    Args:
        numels: elements of each layer.
        bin_sizes: L_T of each layer.
        word_bytes: bytes per word of each layer (1 or 2).
        device: where the kernels run.
    """

    def __init__(
        self, numels: Sequence[int], bin_sizes: Sequence[int], word_bytes: Sequence[int], device: torch.device
    ) -> None:
        bins = [-(-n // s) for n, s in zip(numels, bin_sizes)]
        offset = first_bin = first_slot = 0
        rows = []
        for n, size, nb, width in zip(numels, bin_sizes, bins, word_bytes):
            rows.append((offset, n, size, first_bin, nb, 8 * width - 2, width, first_slot))
            offset, first_bin, first_slot = offset + n, first_bin + nb, first_slot + 2 + n + nb
        #: int64 ``[layers, 8]``: offset, numel, L_T, first bin, bins, field bits, word bytes, first word slot
        self.meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, 8).to(device)
        self.lpad = max(16, 1 << (max(bin_sizes, default=1) - 1).bit_length())
        self.bins_per_tile = max(1, ELEMENTS // self.lpad)
        self.tiles = tiles(bins, self.bins_per_tile).to(device)
        self.bins = first_bin
        self.slots = first_slot
        # the decode's tiles: each layer's word bytes at most (a word per element, a marker per bin), BYTES each;
        # those past a rank's actual bytes do nothing
        self.byte_block = BYTES
        word_tiles = tiles([w * (n + nb) for n, nb, w in zip(numels, bins, word_bytes)], BYTES)
        first_tile = torch.zeros(len(numels), dtype=torch.int64)
        per_layer = torch.bincount(word_tiles[:, 0], minlength=len(numels))
        first_tile[1:] = per_layer.cumsum(0)[:-1]
        self.word_tiles = word_tiles.to(device)
        #: int64 ``[word tiles]``: the first word tile of each tile's layer
        self.first_word_tile = first_tile[word_tiles[:, 0]].to(device)


def _launch(kernel: object, tables: Tables, *args: object, **constants: object) -> None:
    launch(kernel, tables.tiles.shape[0], *args, BINS=tables.bins_per_tile, LPAD=tables.lpad, **constants)


def bin_maxima(g: Tensor, tables: Tables) -> Tensor:
    """float32 ``[bins]``: max |G| of each bin of the contiguous flat ``g``."""
    gmax = torch.empty(tables.bins, dtype=torch.float32, device=g.device)
    _launch(_jit().bin_max_kernel, tables, g, tables.meta, tables.tiles, gmax)
    return gmax


def select(
    g: Tensor, dw: Tensor, factor: float, gmax: Tensor, scale: Tensor, tables: Tables, ternary: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The selection of every bin and the wire's element words.

    Args:
        g: G, contiguous flat float32.
        dw: dW, as ``g``.
        factor: H = G + ``factor`` dW (``scale_factor - 1``).
        gmax: :func:`bin_maxima`.
        scale: float32 ``[layers]`` layer scales (read only when ``ternary``).
        tables: the group's tables on ``g``'s device.
        ternary: the ternary quantizer (entries that round to 0 are not sent).

    Returns:
        int64 ``[bins]`` sent counts, first and last sent offsets (meaningless for a bin that sends nothing), and
        uint8 ``[slots, 2]`` word bytes and whether each is sent, filled at the element slots only.
    """
    device = g.device
    counts, first, last = (torch.empty(tables.bins, dtype=torch.int64, device=device) for _ in range(3))
    words, used = (torch.empty(tables.slots, 2, dtype=torch.uint8, device=device) for _ in range(2))
    _launch(_jit().select_kernel, tables, g, dw, factor, tables.meta, tables.tiles, gmax, scale, counts, first, last,
            words, used, TERNARY=ternary)
    return counts, first, last, words, used


def decode_add(payload: Tensor, nbytes: Tensor, tables: Tables, out: Tensor) -> Tensor:
    """One rank's payload (uint8, the layers' bytes back to back, ``nbytes`` int64 ``[layers]`` each) decoded and
    added into the contiguous float32 ``out`` ``[total]``: ``out.index_add_`` of its entries, the rest unchanged.

    A scan in two launches: each tile's advance of its layer's running bin, their sums before it within the layer
    (torch ops over tiles), then each tile decoded from there."""
    starts = nbytes.cumsum(0) - nbytes
    sums = torch.empty(tables.word_tiles.shape[0], dtype=torch.int64, device=out.device)
    args = (payload, starts, nbytes, tables.meta, tables.word_tiles)
    launch(_jit().advance_kernel, sums.numel(), *args, sums, BLOCK=tables.byte_block)
    before = sums.cumsum(0) - sums
    carry = before - before.index_select(0, tables.first_word_tile)
    launch(_jit().decode_add_kernel, sums.numel(), *args, carry, out, BLOCK=tables.byte_block)
    return out


__all__ = ["BYTES", "ELEMENTS", "Tables", "bin_maxima", "decode_add", "select"]
