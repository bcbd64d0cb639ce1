"""AdaComp's bin-relative wire words (:func:`lightning_gradcomp.sparse.encode_bin_relative`), encoded and
decoded-and-summed in one sequential pass each.

The words are a running code (the decoder's current bin moves with every marker and every offset that does not
increase), so the torch-ops form needs a dozen vectorised passes over int64 copies of the K sent entries; for
AdaComp, which sends ~10% of the entries of a fresh gradient, that cost more than the selection itself. Both
functions give exactly the torch-ops results (the same bytes; the same float sums, payload by payload in
rank order), which is also their fallback without the compiled extension and on CUDA.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.kernels._build import extension_for
from lightning_gradcomp.kernels.selection import sparse_decode_sum
from lightning_gradcomp.sparse import bin_word_bits, decode_bin_relative, encode_bin_relative
from lightning_gradcomp.validation import check_int


def bin_words_encode(indices: Tensor, codes: Tensor, bin_size: int) -> Tensor:
    """:func:`~lightning_gradcomp.sparse.encode_bin_relative`: the words of ascending ``indices`` with value
    ``codes`` in {0, 1, 2}, bit-identical."""
    bits = bin_word_bits(bin_size)  # validates bin_size
    ext = extension_for(indices, codes)
    if ext is None:
        return encode_bin_relative(indices, codes, bin_size)
    return ext.bin_words_encode(indices.reshape(-1), codes.reshape(-1), bin_size, bits)


def bin_words_decode_sum(
    numel: int, payloads: Sequence[Tensor], bin_size: int, out: Optional[Tensor] = None
) -> Tensor:
    """The dense float32 sum of AdaComp payloads in the paper's wire format, in the given (rank) order.

    Each payload is ``[float32 scale][bin-relative words]`` (empty: nothing sent); an entry with value code c
    contributes ``(c - 1) * scale``. Equal, bit for bit, to decoding each payload with
    :func:`~lightning_gradcomp.sparse.decode_bin_relative` and :func:`sparse_decode_sum` of the results.
    ``out`` (contiguous float32, ``numel`` elements) is overwritten if given.
    """
    check_int("numel", numel, minimum=0)
    bits = bin_word_bits(bin_size)
    ext = extension_for(*payloads) if payloads else None
    if ext is not None:
        buffer = torch.empty(0, dtype=torch.float32) if out is None else out
        return ext.bin_words_decode_sum(numel, [p.contiguous() for p in payloads], bin_size, bits, buffer)
    indices, values = [], []
    for payload in payloads:
        if payload.numel() == 0:
            continue
        scale = payload[:4].clone().view(torch.float32)
        idx, code = decode_bin_relative(payload[4:], bin_size)
        indices.append(idx)
        values.append((code - 1).float() * scale)
    if out is None:
        device = payloads[0].device if payloads else torch.device("cpu")
        out = torch.empty(numel, dtype=torch.float32, device=device)
    return sparse_decode_sum(numel, indices, values, out=out)
