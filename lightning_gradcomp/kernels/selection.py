"""Selection kernels for the sparse compressors (Gradient Dropping, AdaComp) and sparse decoding.

Standalone functions with one job each, so a compressor can adopt them piecewise:

* :func:`sample_abs` + :func:`sample_threshold`: the threshold that drops the ``drop_ratio`` smallest |x|,
  estimated from a strided or random sample (Aji & Heafield sample 0.1%).
* :func:`select_above`: compaction of |x| > threshold (and NaN) into (int32 index, float32 value).
* :func:`bin_absmax`, :func:`adacomp_select`: AdaComp's per-bin max|G| (bin length L, last bin partial)
  and selection |H| >= gmax(bin), with bin-relative indices.
* :func:`sparse_decode_sum`: the dense sum of several ranks' sparse payloads, in rank order.

Every function gives the same result on the compiled CPU path and on the torch-ops path (CPU fallback,
CUDA): the same sample, the same order statistic, the same selected set in ascending index order, and
the same float sums (scatter-adds happen payload by payload in the given order).
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp.kernels import rng
from lightning_gradcomp.kernels._build import extension_for
from lightning_gradcomp.validation import check_choice, check_int, check_number

SampleMode = Literal["strided", "random"]



def _flat32(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1).to(torch.float32).contiguous()


def sample_abs(
    tensor: Tensor, size: int, mode: SampleMode = "strided", key: tuple[int, int] = (0, 0)
) -> Tensor:
    """|x| at ``min(size, numel)`` positions: every ``numel // size``-th element, or hashed random positions.

    Args:
        tensor: the values (flattened).
        size: sample size wanted.
        mode: ``"strided"`` (positions i * (numel // size)) or ``"random"`` (hash(i) mod numel, with
            replacement, from the counter-based stream keyed by ``key``).
        key: stream key for ``"random"`` (see :func:`lightning_gradcomp.kernels.rng.stream_key`).
    """
    check_int("size", size, minimum=1)
    check_choice("mode", mode, ("strided", "random"))
    flat = _flat32(tensor)
    n = flat.numel()
    if n == 0:
        raise ValueError("Expected `tensor` to be non-empty, but got 0 elements.")
    if n >= rng.MAX_NUMEL:
        raise ValueError(f"Expected `tensor` to have fewer than 2**32 elements, but got {n}.")
    size = min(size, n)
    ext = extension_for(flat)
    if ext is not None:
        return ext.sample_abs(flat, size, 0 if mode == "strided" else 1, key[0], key[1])
    if mode == "strided":
        pos = torch.arange(size, dtype=torch.int64, device=flat.device) * max(1, n // size)
    else:
        pos = rng.positions(size, n, key, flat.device)
    return flat[pos].abs()


def quantile_rank(size: int, drop_ratio: float) -> int:
    """0-based rank in the sorted sample of the threshold that drops ``drop_ratio`` of the entries."""
    return min(int(drop_ratio * size), size - 1)


def sample_threshold(sample: Tensor, drop_ratio: float) -> Tensor:
    """The ``quantile_rank``-th smallest value of ``sample`` (an exact order statistic), as a 0-d float32.

    Keeping |x| > threshold drops about ``drop_ratio`` of the entries (exactly, when the sample is the
    whole tensor and values are distinct).
    """
    check_number("drop_ratio", drop_ratio, minimum=0.0, maximum=1.0, max_open=True, fix="e.g. 0.99 drops 99%")
    k = quantile_rank(sample.numel(), drop_ratio)
    ext = extension_for(sample)
    if ext is not None:
        return torch.tensor(ext.kth_smallest(_flat32(sample), k), dtype=torch.float32)
    return torch.kthvalue(sample.reshape(-1).float(), k + 1).values


def kth_smallest(sample: Tensor, k: int) -> Tensor:
    """The ``k``-th smallest (0-based) value of ``sample`` (an exact order statistic), as a 0-d float32.

    :func:`sample_threshold` with a rank chosen by the caller (Gradient Dropping's floor(R * m)-th value).
    """
    flat = _flat32(sample)
    check_int("k", k, minimum=0)
    if k >= flat.numel():
        raise ValueError(f"Expected `k` below the sample size {flat.numel()}, but got {k}.")
    ext = extension_for(flat)
    if ext is not None:
        return torch.tensor(ext.kth_smallest(flat, k), dtype=torch.float32)
    return torch.kthvalue(flat, k + 1).values


def select_above(tensor: Tensor, threshold: "Tensor | float", inclusive: bool = False) -> tuple[Tensor, Tensor]:
    """(int32 indices, float32 values) of the entries not at or below ``threshold``, in ascending index order.

    That is |x| > ``threshold`` (``inclusive``: |x| >= ``threshold``), or NaN: a NaN compares false with every
    number, so it is never "at or below" (Gradient Dropping sends it: NaN in, NaN out). The count is
    ``indices.numel()``.
    """
    flat = _flat32(tensor)
    ext = extension_for(flat)
    if ext is not None:
        index, values = ext.select_above(flat, float(threshold), inclusive)
        return index, values
    thr = threshold.to(flat.device) if isinstance(threshold, Tensor) else threshold  # no host sync on CUDA
    magnitudes = flat.abs()
    index = torch.nonzero(~(magnitudes < thr) if inclusive else ~(magnitudes <= thr)).reshape(-1)
    return index.to(torch.int32), flat[index]


def bin_absmax(tensor: Tensor, bin_len: int) -> Tensor:
    """max|x| over each bin of ``bin_len`` consecutive elements (the last bin may be shorter)."""
    check_int("bin_len", bin_len, minimum=1)
    flat = _flat32(tensor)
    ext = extension_for(flat)
    if ext is not None:
        return ext.bin_absmax(flat, bin_len)
    n = flat.numel()
    bins = -(-n // bin_len)
    padded = torch.cat((flat.abs(), flat.new_zeros(bins * bin_len - n)))
    return padded.view(bins, bin_len).amax(dim=1)


@dataclass(frozen=True)
class AdaCompSelection:
    """What :func:`adacomp_select` found (a dataclass, not a NamedTuple: a tuple's ``index`` method would shadow the
    field of that name). Iterates over its fields in order, as the tuple did.

    Attributes:
        gmax: max|G| of each bin (float32, one per bin).
        counts: entries selected in each bin (int32, one per bin).
        index: absolute indices of the selected entries (int32, ascending).
        bin_index: the same entries' offsets within their bins (int32, < bin length; narrow to 8 or 16 bits
            on the wire as the paper does).
        values: G at the selected entries (float32).
    """

    gmax: Tensor
    counts: Tensor
    index: Tensor
    bin_index: Tensor
    values: Tensor

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.gmax, self.counts, self.index, self.bin_index, self.values))


def adacomp_select(G: Tensor, H: Tensor, bin_len: int) -> AdaCompSelection:
    """AdaComp's local selection (Chen et al. 2018, Algorithm 2): per bin of length L, send the entries with
    |H| >= max|G| over the bin.

    Args:
        G: residual plus gradient (the accumulated gradient).
        H: G plus the gradient once more (the "soft threshold" look-ahead).
        bin_len: L, the bin length (the last bin may be shorter).
    """
    check_int("bin_len", bin_len, minimum=1)
    g, h = _flat32(G), _flat32(H)
    if g.numel() != h.numel():
        raise ValueError(f"Expected `H` to have as many elements as `G` ({g.numel()}), but got {h.numel()}.")
    ext = extension_for(g, h)
    if ext is not None:
        gmax, counts, index, values = ext.adacomp_select(g, h, bin_len)
    else:
        gmax = bin_absmax(g, bin_len)
        n = g.numel()
        bin_of = torch.arange(n, device=g.device) // bin_len
        mask = h.abs() >= gmax[bin_of]
        index64 = torch.nonzero(mask).reshape(-1)
        counts = torch.bincount(bin_of[index64], minlength=gmax.numel()).to(torch.int32)
        index, values = index64.to(torch.int32), g[index64]
    return AdaCompSelection(gmax, counts, index, index % bin_len, values)


def sparse_decode_sum(
    numel: int, indices: Sequence[Tensor], values: Sequence[Tensor], out: Optional[Tensor] = None
) -> Tensor:
    """Dense float32 sum of sparse payloads: ``values[r]`` scatter-added at ``indices[r]``, r in the given order.

    Every rank passes the payloads in rank order, so the float sums, and hence the result, are bit-identical
    on every rank. ``out`` (contiguous float32, ``numel`` elements) is overwritten if given.
    """
    check_int("numel", numel, minimum=0)
    if len(indices) != len(values):
        raise ValueError(f"Expected as many `values` as `indices` ({len(indices)}), but got {len(values)}.")
    device = indices[0].device if indices else (out.device if out is not None else torch.device("cpu"))
    if out is not None and not (out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel):
        raise ValueError(f"Expected `out` to be a contiguous float32 tensor of {numel} elements, but got {out.dtype} "
                         f"{tuple(out.shape)}. Pass None to allocate one.")
    ext = extension_for(*indices, *values) if indices else None
    if ext is not None:
        buffer = torch.empty(0, dtype=torch.float32) if out is None else out
        return ext.sparse_decode_sum(numel, list(indices), list(values), buffer)
    out = torch.zeros(numel, dtype=torch.float32, device=device) if out is None else out.zero_()
    for index, vals in zip(indices, values):
        out.index_add_(0, index.reshape(-1).long(), vals.reshape(-1).float())
    return out


def graddrop_group_sample(flat: Tensor, offsets: Tensor, sizes: Tensor, modes: Tensor, keys: Tensor) -> Tensor:
    """Every layer's threshold sample of |x| for a group of layers laid out back to back, in one call.

    Layer ``s`` (elements ``offsets[s]`` to ``offsets[s + 1]``) gives ``sizes[s]`` values: ``modes[s]`` 2 the whole
    layer, 0 at Marian's stride, 1 at random positions keyed by ``keys[s]`` (as :func:`sample_abs` draws them).
    ``offsets``, ``sizes``, ``modes``: int64 CPU tensors; ``keys``: int64 CPU ``[layers, 2]``. The compiled kernel
    loops over the layers inside the call; the torch-ops fallback loops in Python.
    """
    x = _flat32(flat)
    ext = extension_for(x)
    if ext is not None:
        return ext.graddrop_group_sample(x, offsets.contiguous(), sizes.contiguous(), modes.contiguous(), keys.contiguous())
    parts = [x[:0].abs()]
    for start, end, size, mode, key in zip(offsets[:-1].tolist(), offsets[1:].tolist(), sizes.tolist(), modes.tolist(),
                                           keys.tolist()):
        layer = x[start:end]
        if mode == 2 or size == 0:
            parts.append(layer.abs())
        else:
            parts.append(sample_abs(layer, size, "strided" if mode == 0 else "random", (key[0], key[1])))
    return torch.cat(parts)


def graddrop_group_kth(samples: Tensor, sample_offsets: Tensor, ranks: Tensor) -> Tensor:
    """float32 ``[layers]``: each layer's ``ranks[s]``-th smallest (1-based) sampled value, as :func:`kth_smallest`
    ranks (NaN last); 0 where the rank is 0. Layer ``s``'s sample is ``samples[sample_offsets[s]:sample_offsets[s + 1]]``."""
    values = _flat32(samples)
    ext = extension_for(values)
    if ext is not None:
        return ext.graddrop_group_kth(values, sample_offsets.contiguous(), ranks.contiguous())
    out = [
        kth_smallest(values[start:end], k - 1).to(values.device) if k else values.new_zeros(())
        for start, end, k in zip(sample_offsets[:-1].tolist(), sample_offsets[1:].tolist(), ranks.tolist())
    ]
    return torch.stack(out) if out else values.new_zeros(0)


def graddrop_group_select(
    flat: Tensor, offsets: Tensor, thresholds: Tensor, fp16: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradient Dropping's survivors for every layer of a group laid out back to back, in one call.

    Layer ``s`` (elements ``offsets[s]`` to ``offsets[s + 1]``, an int64 CPU tensor) keeps what :func:`select_above`
    keeps under ``thresholds[s]`` (float32), or its ties when nothing is above a positive threshold; with ``fp16``,
    survivors beyond fp16's range stay behind, counted. The compiled kernel loops over the layers inside the call
    (the thresholds never become Python floats); the torch-ops fallback loops in Python.

    Returns:
        (int32 indices from the group's start (ascending), float32 values, int64 counts ``[layers]``, float32
        overflow counts ``[layers]``).
    """
    x = _flat32(flat)
    thr = thresholds.detach().to(torch.float32).contiguous()
    ext = extension_for(x, thr)
    if ext is not None:
        index, values, counts, overflow = ext.graddrop_group_select(x, offsets.contiguous(), thr, fp16)
        return index, values, counts, overflow
    parts = []
    for s, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        layer = x[start:end]
        idx, kept = select_above(layer, thr[s])
        if idx.numel() == 0 and thr[s] > 0:  # nothing above it: every |x| ties with it, send the ties
            idx, kept = select_above(layer, thr[s], inclusive=True)
        fits = ~(kept.abs() > torch.finfo(torch.float16).max) if fp16 else torch.ones_like(kept, dtype=torch.bool)
        parts.append(((idx[fits] + start).to(torch.int32), kept[fits], (~fits).sum().float()))
    device = x.device
    return (
        torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, dtype=torch.int32, device=device),
        torch.cat([p[1] for p in parts]) if parts else x.new_zeros(0),
        torch.tensor([p[0].numel() for p in parts], dtype=torch.int64, device=device),
        torch.stack([p[2] for p in parts]) if parts else x.new_zeros(0),
    )
