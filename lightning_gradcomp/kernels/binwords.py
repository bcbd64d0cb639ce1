"""AdaComp's bin-relative wire words (:func:`lightning_gradcomp.wire.sparse.encode_bin_relative`), encoded and
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
from lightning_gradcomp.kernels.selection import adacomp_select, sparse_decode_sum
from lightning_gradcomp.wire.sparse import bin_word_bits, decode_bin_relative, encode_bin_relative
from lightning_gradcomp.validation import check_int


def bin_words_encode(indices: Tensor, codes: Tensor, bin_size: int) -> Tensor:
    """:func:`~lightning_gradcomp.wire.sparse.encode_bin_relative`: the words of ascending ``indices`` with value
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
    :func:`~lightning_gradcomp.wire.sparse.decode_bin_relative` and :func:`sparse_decode_sum` of the results.
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


def adacomp_group_encode(
    G: Tensor, H: Tensor, offsets: Tensor, bin_sizes: Tensor, ternary: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """AdaComp's adaptive selection and paper wire for every layer of a group laid out back to back, in one call.

    Per layer ``s`` (elements ``offsets[s]`` to ``offsets[s + 1]``, bin length ``bin_sizes[s]``): the bins' maxima
    of |G|, the scale (their mean, summed in bin order), the entries |H| >= gmax(bin) with G != 0 (ternary: also
    2|G| >= scale), and when any is sent ``[float32 scale][words]`` (:func:`bin_words_encode`); the layers' payloads
    back to back. The compiled kernel loops over the layers inside one call; the torch-ops fallback loops in Python.

    Returns:
        (uint8 payload, int64 bytes per layer, float32 scale per layer, int64 entries sent per layer).
    """
    g, h = G.detach().reshape(-1).float().contiguous(), H.detach().reshape(-1).float().contiguous()
    ext = extension_for(g, h)
    if ext is not None:
        payload, nbytes, scales, counts = ext.adacomp_group_encode(g, h, offsets.contiguous(), bin_sizes.contiguous(), ternary)
        return payload, nbytes, scales, counts
    parts, sizes, scales, counts = [], [], [], []
    for start, end, size in zip(offsets[:-1].tolist(), offsets[1:].tolist(), bin_sizes.tolist()):
        scale = g.new_zeros(())
        idx = torch.zeros(0, dtype=torch.int64, device=g.device)
        codes = idx
        if end > start:
            sel = adacomp_select(g[start:end], h[start:end], size)
            gmax = sel.gmax
            sums = torch.segment_reduce(gmax, "sum", lengths=torch.tensor([gmax.numel()], device=g.device), unsafe=True)
            scale = (sums / gmax.numel()).reshape(())
            keep = sel.values != 0
            if ternary:
                keep &= 2 * sel.values.abs() >= scale
            idx, codes = sel.index[keep].long(), torch.sign(sel.values[keep]).long() + 1
        if idx.numel():
            parts.append(torch.cat((scale.reshape(1).view(torch.uint8), bin_words_encode(idx, codes, size))))
        sizes.append(parts[-1].numel() if idx.numel() else 0)
        scales.append(scale)
        counts.append(idx.numel())
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=g.device)
    return (
        payload,
        torch.tensor(sizes, dtype=torch.int64, device=g.device),
        torch.stack(scales) if scales else g.new_zeros(0),
        torch.tensor(counts, dtype=torch.int64, device=g.device),
    )


def adacomp_group_decode_sum(
    payloads: Sequence[Tensor], nbytes: Sequence[Tensor], offsets: Tensor, bin_sizes: Tensor, out: Optional[Tensor] = None
) -> Tensor:
    """The dense float32 sum, over ranks in the given order, of :func:`adacomp_group_encode`'s payloads, rank r's
    layer s being ``nbytes[r][s]`` bytes of ``payloads[r]``: :func:`bin_words_decode_sum` of every layer at once.
    ``out`` (contiguous float32, the group's size) is overwritten if given."""
    ext = extension_for(*payloads) if payloads else None
    if ext is not None:
        buffer = torch.empty(0, dtype=torch.float32) if out is None else out
        return ext.adacomp_group_decode_sum(
            [p.contiguous() for p in payloads], [n.to(torch.int64) for n in nbytes], offsets.contiguous(),
            bin_sizes.contiguous(), buffer,
        )
    if out is None:
        device = payloads[0].device if payloads else torch.device("cpu")
        out = torch.empty(int(offsets[-1]), dtype=torch.float32, device=device)
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), bin_sizes.tolist()))
    layer_payloads: list[list[Tensor]] = [[] for _ in bounds]
    for payload, sizes in zip(payloads, nbytes):
        at = 0
        for s, n in enumerate(torch.as_tensor(sizes).tolist()):
            layer_payloads[s].append(payload[at : at + n])
            at += n
    for (start, end, size), parts in zip(bounds, layer_payloads):
        bin_words_decode_sum(end - start, parts, size, out=out[start:end])
    return out
