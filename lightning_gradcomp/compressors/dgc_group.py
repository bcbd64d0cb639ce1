"""DGC's selection: :func:`select_segment` states it for one layer (:func:`select_loop` runs it layer by layer, a
CPU's form); :func:`select` for a whole group of layers in a fixed number of ops, one data-dependent op (the final
``nonzero``) and no host read (a GPU's form; :func:`select_mask` with Triton's kernels).

Per layer, DGC takes the ``top_k_samples``-th largest of a strided sample as threshold ``t0``, then tries
``t0, t0 * lb, t0 * lb**2, ...`` (at most ``max_adaptation_iters`` times) until the count ``c`` of ``|x| >= t``
is above ``k`` (then an exact top-k of those if ``c > ub * k``) or at least ``lb * k``, and keeps the first ``k``
survivors by position. In :func:`select` every layer's samples are sorted at once (:meth:`Segments.sort`), the counts of
all the thresholds ``t_j`` are one histogram of each element's "level" (how many of its layer's thresholds it
reaches), the stopping rule is evaluated for every layer at once on those ``[layers, iters + 1]`` counts, and
the exact top-k (for the layers that need it) is a segmented radix select
(:func:`~lightning_gradcomp.kernels.segmented.kth_largest`). "The first k survivors" is a segmented prefix count.

Every form selects the same set when the same sample offsets are drawn (the per-name counter streams all use); ties
at a top-k layer's k-th largest magnitude are broken by position (the per-layer oracle's ``torch.topk`` breaks them
as its kernel happens to).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.compressors import topk_group
from lightning_gradcomp.compressors.topk_group import SparseLayout
from lightning_gradcomp.kernels import segmented, triton_topk
from lightning_gradcomp.flat import Segments


@dataclass
class DGCPlan:
    """What a group's shapes and DGC's settings fix about its selection (made once per group and settings).

    Attributes:
        layout: the group's wire layout; ``layout.counts`` are each layer's k.
        strides: each sparse layer's sample stride (1: the whole layer, no adaptation; 0 for other layers).
        top_samples: each sparse layer's ``top_k_samples`` (before the cap by the drawn sample's size).
        lower_bound, upper_bound, iters: DGC's adaptation settings.
    """

    layout: SparseLayout
    strides: tuple[int, ...]
    top_samples: tuple[int, ...]
    lower_bound: float
    upper_bound: float
    iters: int
    samples: Segments = field(init=False)
    _tensors: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        seg, device = self.layout.segments, self.layout.device
        lengths = [-(-n // s) if s else 0 for n, s in zip(seg.numels, self.strides)]
        self.samples = Segments(seg.names, [torch.Size([n]) for n in lengths])
        # sample j of layer l sits at offset_l + stride_l * j (before this step's random start is added)
        owner = self.samples.ids(torch.device("cpu"))
        starts = torch.tensor(seg.offsets[:-1], dtype=torch.int64)
        within = torch.arange(self.samples.total) - torch.tensor(self.samples.offsets[:-1]).index_select(0, owner)
        base = starts.index_select(0, owner) + torch.tensor(self.strides).index_select(0, owner) * within
        limit = (starts + torch.tensor(seg.numels)).index_select(0, owner)
        k = self.layout.counts
        last = max(0, self.samples.total - 1)
        t = {
            "base": base,
            "limit": limit,
            "sample_starts": torch.tensor([min(o, last) for o in self.samples.offsets[:-1]], dtype=torch.int64),
            "k": torch.tensor(k, dtype=torch.int64),
            "upper": torch.tensor([self.upper_bound * c for c in k], dtype=torch.float64),
            "lower": torch.tensor([self.lower_bound * c for c in k], dtype=torch.float64),
            "exact": torch.tensor([s <= 1 for s in self.strides], dtype=torch.bool),
        }
        self._tensors = {name: v.to(device) for name, v in t.items()}

    @property
    def drawn(self) -> list[int]:
        """The layers whose sample starts at a random offset (stride > 1), in group order."""
        return [i for i, s in enumerate(self.strides) if s > 1]

    def top_in_sample(self, starts: Sequence[int]) -> list[int]:
        """Each layer's ``top_k_samples`` capped by its drawn sample's size (``len(range(start, n, stride))``)."""
        return [min(t, len(range(a, n, s))) if s else 0
                for t, a, n, s in zip(self.top_samples, starts, self.layout.segments.numels, self.strides)]


def select_segment(magnitudes: Tensor, k: int, stride: int, start: int, top: int, plan: DGCPlan) -> Tensor:
    """DGC's selection of one layer (the official code's): int64 positions, ascending, within ``magnitudes``.

    The ``top``-th largest of the sample ``magnitudes[start::stride]`` is the threshold (NaN when a NaN is among
    the top: nothing is sent); with a sample (``stride > 1``) it is adapted up to ``plan.iters`` times: more than
    ``k`` survivors stop it (an exact top-k of them, :func:`~lightning_gradcomp.compressors.topk_group.top_k_segment`,
    when more than ``upper_bound * k``), at least ``lower_bound * k`` too, else the threshold is multiplied by
    ``lower_bound``. The first ``k`` survivors by position are sent.

    Args:
        magnitudes: ``|x|`` of the layer.
        k: the most elements sent (the layer's top-k count).
        stride: the sample's stride (1: the whole layer, no adaptation).
        start: the sample's offset drawn this step.
        top: the rank in the sample of the threshold (capped by the sample's size).
        plan: the adaptation settings.
    """
    samples = magnitudes if stride == 1 else magnitudes[start::stride]
    threshold = torch.topk(samples, top, sorted=False).values.min()
    survivors = torch.nonzero(magnitudes >= threshold).reshape(-1)
    if stride > 1:
        for _ in range(plan.iters):
            count = survivors.numel()
            if count > k:
                if count > plan.upper_bound * k:
                    survivors = survivors[topk_group.top_k_segment(magnitudes.index_select(0, survivors), k)]
                break
            if count >= plan.lower_bound * k:
                break
            threshold = threshold * plan.lower_bound
            survivors = torch.nonzero(magnitudes >= threshold).reshape(-1)
    return survivors[:k]


def select_loop(plan: DGCPlan, magnitudes: Tensor, starts: Sequence[int]) -> tuple[Tensor, tuple[int, ...]]:
    """:func:`select` as one :func:`select_segment` per layer (a CPU's fastest: a few partial selections and
    compactions per layer instead of the batched form's passes over the group per threshold): ``(int64 flat
    positions in ascending order, host counts per layer)``."""
    seg = plan.layout.segments
    parts, counts = [], []
    for o, n, k, stride, start, top in zip(seg.offsets, seg.numels, plan.layout.counts, plan.strides, starts,
                                          plan.top_in_sample(starts)):
        if not k:
            counts.append(0)
            continue
        part = select_segment(magnitudes[o : o + n], k, stride, start, top, plan)
        parts.append(part.add_(o))
        counts.append(part.numel())
    positions = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=magnitudes.device)
    return positions, tuple(counts)


def _thresholds(plan: DGCPlan, source: Tensor, starts: Sequence[int], absolute: bool) -> tuple[Tensor, Tensor]:
    """The sampled threshold ``[layers]`` and float32 ``[layers, iters + 1]``: each layer's ladder of thresholds (the
    top-th largest sample, NaN when a NaN is among the top as topk's min is, then times ``lower_bound`` again and
    again), from the magnitudes, or from the values with ``absolute`` (only the samples' taken)."""
    seg, t = plan.layout.segments, plan._tensors
    n = len(seg)
    per_step = segmented.host_to_device([*starts, *plan.top_in_sample(starts)], source.device)
    start, top = per_step[:n], per_step[n:]
    positions = t["base"] + plan.samples.expand(start)
    valid = positions < t["limit"]
    picked = source.index_select(0, positions.clamp(max=seg.total - 1))
    if absolute:
        picked = picked.abs()
    ordered, _ = plan.samples.sort(torch.where(valid, picked, -1.0), descending=True)
    head = ordered.index_select(0, t["sample_starts"])
    kth = ordered.index_select(0, (t["sample_starts"] + top - 1).clamp(min=0, max=plan.samples.total - 1))
    ladder = [torch.where(head.isnan(), head, kth)]
    for _ in range(plan.iters):
        ladder.append(ladder[-1] * plan.lower_bound)
    return ladder[0], torch.stack(ladder, 1)


def _rule(plan: DGCPlan, hist: Tensor, thresholds: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """DGC's stopping rule for every layer from the level histograms (int32 ``[layers, iters + 2]``): ``(top_k, the
    threshold, its count)`` per layer, ``top_k`` where an exact top-k of the survivors follows."""
    t = plan._tensors
    n = len(plan.layout.segments)
    at_least = hist.view(n, plan.iters + 2).to(torch.int64).flip(1).cumsum(1).flip(1)
    counts = at_least[:, 1:].flip(1)  # counts[:, j] = elements reaching t_j
    k, exact = t["k"], t["exact"]
    if plan.iters:
        tried = counts[:, : plan.iters]
        stop = (tried > k.unsqueeze(1)) | (tried >= t["lower"].unsqueeze(1))
        stopped = stop.any(1) & ~exact
        chosen = torch.where(stopped, stop.to(torch.uint8).argmax(1), torch.where(exact, 0, plan.iters))
    else:
        stopped = torch.zeros_like(exact)
        chosen = torch.zeros_like(k)
    count = counts.gather(1, chosen.unsqueeze(1)).squeeze(1)
    threshold = thresholds.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return stopped & (count > t["upper"]), threshold, count


def select(plan: DGCPlan, magnitudes: Tensor, starts: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``DGC.select`` of every layer: ``(int64 flat positions in ascending order, int64 [layers] counts)``.

    Args:
        plan: the group's plan.
        magnitudes: ``|x|`` of the group, ``[segments.total]``.
        starts: each layer's sample offset drawn this step (0 where the stride is 1 or the layer is not sampled).
    """
    seg, t = plan.layout.segments, plan._tensors
    n = len(seg)
    if plan.samples.total == 0:  # no sparse layer with elements: nothing selected
        return torch.zeros(0, dtype=torch.int64, device=magnitudes.device), t["k"] * 0
    sampled, thresholds = _thresholds(plan, magnitudes, starts, absolute=False)

    # count[l, j] = #{|x| >= t_j} of layer l, from each element's level (thresholds only decrease)
    reach = seg.expand(sampled)
    narrow = torch.uint8 if plan.iters < 255 else torch.int32  # levels reach iters + 1: a byte a pass when it fits
    level = (magnitudes >= reach).to(narrow)
    for _ in range(plan.iters):
        reach = reach * plan.lower_bound  # the same float32 products as the ladder's
        level += magnitudes >= reach
    width = plan.iters + 2
    ids = seg.ids(level.device)
    hist = torch.zeros(n * width, dtype=torch.int32, device=level.device)
    hist.index_add_(0, ids * width + level, torch.ones_like(level, dtype=torch.int32))
    top_k, threshold, count = _rule(plan, hist, thresholds)

    # top-k layers keep what is above their k-th largest and, of the ties with it, the first ones by position;
    # the others keep the first k of |x| >= threshold
    k = t["k"]
    finite = torch.where(magnitudes.isnan(), -1.0, magnitudes)  # topk ranks only |x| >= t: never NaN
    kth_value, ties = segmented.kth_largest(finite, seg, k.clamp(min=1))
    lower = torch.where(top_k, kth_value, threshold)
    upper = torch.where(top_k, kth_value, math.inf)
    quota = torch.where(top_k, ties, k)
    upper_all = seg.expand(upper)
    candidate = (magnitudes >= seg.expand(lower)) & (magnitudes <= upper_all)
    rank = segmented.cumsum(candidate.to(torch.int64), seg)
    keep = (magnitudes > upper_all) | (candidate & (rank <= seg.expand(quota)))
    return torch.nonzero(keep).reshape(-1), torch.minimum(count, k)


def select_mask(plan: DGCPlan, x: Tensor, starts: Sequence[int]) -> tuple[Tensor, Tensor]:
    """:func:`select` by the Triton kernels (:mod:`~lightning_gradcomp.kernels.triton_topk`): ``(uint8 [total] mask
    of the selected elements, int64 [layers] counts)``, the same selection. The level histogram and the exact top-k
    (a radix select ranking NaN below +0.0, as :func:`select`'s -1) are kernels, the rule and the samples' sort
    (``sample_ratio`` of the elements) torch ops on ``[layers]`` tensors.

    Args:
        plan: the group's plan.
        x: the group's values, float32 ``[segments.total]``, contiguous.
        starts: as :func:`select`'s.
    """
    t = plan._tensors
    mask = torch.zeros(plan.layout.segments.total, dtype=torch.uint8, device=x.device)
    if plan.samples.total == 0:
        return mask, t["k"] * 0
    tables = plan.layout.select_tables()
    _, thresholds = _thresholds(plan, x, starts, absolute=True)
    top_k, threshold, count = _rule(plan, triton_topk.level_counts(x, tables, thresholds.contiguous()), thresholds)
    state = triton_topk.kth_largest(x, tables, nan_first=False)  # the k-th largest key (its bits + 1) and the ties
    kth_value = (state[:, 0] - 1).to(torch.int32).view(torch.float32)
    k = t["k"]
    bounds = torch.stack((torch.where(top_k, kth_value, threshold), torch.where(top_k, kth_value, math.inf)), 1)
    state[:, 1] = torch.where(top_k, state[:, 1], k)
    triton_topk.mark(x, tables, state, mask, bounds=bounds)
    return mask, torch.minimum(count, k)


__all__ = ["DGCPlan", "select", "select_loop", "select_mask", "select_segment"]
