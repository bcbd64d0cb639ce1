"""1-bit SGD with error feedback (Seide et al., Interspeech 2014).

Each element is sent as its sign (one bit); the receiver reconstructs a positive element as the mean of the
group's non-negative values and a negative one as minus the mean magnitude of its negative values, the two
reconstruction values that minimise the squared quantization error for the given signs. What the bit did not
carry is kept per rank and added to the next gradient (error feedback), which is what makes 1 bit converge.

Groups: each row of the tensor viewed as ``[shape[0], -1]`` (``granularity="row"``, the default: one output
unit of a linear/conv layer; Seide et al. quantize per column of their weight matrices, i.e. per output unit
in their layout), or the whole tensor (``"tensor"``: fewer bytes, and on the digits benchmark clearly worse).

On the wire (exact): ``ceil(n / 8)`` bytes of signs plus two float32 reconstruction values per group.

One implementation for a layer and for a group of layers (the hook's batched path): the groups of all layers are
segments of the flat tensor, their counts and sums one ``scatter_reduce`` each (each group summed element after
element, so a layer gets the same means alone or in a group), the payload the per-layer payloads back to back.

Momentum: error feedback sends at most the group's mean magnitude per element and step, so a large entry's
remainder arrives over several steps; heavy optimizer momentum integrates those late arrivals into overshoot.
With SGD momentum >= 0.8 OneBit needs a smaller learning rate than fp32 at the same lr/(1 - momentum) (it
diverges where fp32 converges; the encoding itself is exact: ``docs/baselines.md``,
``benchmarks/onebit_momentum.py``), so :meth:`OneBit.check_optimizers` warns.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.wire.bits import packed_bits_nbytes
from lightning_gradcomp.compressors.base import Aggregation, OptimizerCheck, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.grouped import PackedPayload, derived
from lightning_gradcomp.validation import check_choice

Granularity = Literal["tensor", "row"]

#: SGD momentum from which OneBit's error feedback needs a smaller learning rate than fp32 (measured by
#: ``benchmarks/onebit_momentum.py``: at lr / (1 - momentum) = 0.5, 0.7 matches fp32, 0.8 lags, 0.9 diverges)
HEAVY_MOMENTUM = 0.8


class OneBit(OptimizerCheck):
    """Sign plus two reconstruction values per group, bit-packed, with error feedback.

    Args:
        granularity: ``"row"`` (two values per row of ``tensor.view(shape[0], -1)``) or ``"tensor"`` (two values
            per tensor); 1-D tensors are one group either way.
    """

    aggregation = Aggregation.GATHER
    uses_memory = True
    batched = True

    def __init__(self, granularity: Granularity = "row") -> None:
        super().__init__()
        check_choice("granularity", granularity, ("tensor", "row"))
        self.granularity: Granularity = granularity

    def _num_groups(self, shape: torch.Size) -> int:
        if shape.numel() == 0:  # nothing to reconstruct: no group, no reconstruction values, 0 bytes
            return 0
        return shape[0] if self.granularity == "row" and len(shape) > 1 else 1

    def payload_nbytes(self, numel: int, num_groups: int = 1) -> int:
        """Exact bytes of one packet: the sign bits and two float32 values per group."""
        return packed_bits_nbytes(numel, 1) + 8 * num_groups

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        groups = self._layout(segments)
        x = flat.detach().float()
        positive = x >= 0
        count_pos = groups.rows.reduce(positive.to(torch.int64), "sum")
        count_neg = groups.lengths(x.device) - count_pos
        # summed element after element (a scatter), so in float64: float32 would drift by ~1e-5 over 1e6 elements
        wide = x.double()
        sum_pos = groups.rows.reduce(torch.where(positive, wide, 0.0), "sum")
        sum_neg = groups.rows.reduce(torch.where(positive, 0.0, -wide), "sum")
        # an empty side never gets decoded; clamp the count only to avoid 0/0
        mean_pos = (sum_pos / count_pos.clamp(min=1)).float()
        mean_neg = (sum_neg / count_neg.clamp(min=1)).float()
        payload = groups.payload.join(positive, torch.stack((mean_pos, mean_neg), dim=1))  # [pos0, neg0, pos1, ...]
        stats = {"scale": groups.per_layer.reduce(torch.maximum(mean_pos, mean_neg), "amax")}
        return FlatPacket(payload, segments, flat.dtype, groups.payload.layer_nbytes, stats=stats)

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        groups = self._layout(packet.segments)
        positive, scales = groups.payload.split(packet.payload)
        per_element = groups.rows.expand(scales.view(-1, 2))
        return torch.where(positive.bool(), per_element[:, 0], -per_element[:, 1]).to(packet.dtype)

    def _layout(self, segments: Segments) -> "_Groups":
        return derived(segments, ("onebit", self.granularity), lambda: _Groups(segments, self._num_groups))

    def check_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Warn when an optimizer applies SGD momentum of :data:`HEAVY_MOMENTUM` or more (see the module docs)."""
        for optimizer in optimizers:
            for index, group in enumerate(optimizer.param_groups):
                momentum = group.get("momentum", 0.0)
                if momentum >= HEAVY_MOMENTUM:
                    warnings.warn(
                        f"OneBit with momentum={momentum} (param group {index} of {type(optimizer).__name__}): 1-bit "
                        f"error feedback delivers large entries over several steps and heavy momentum turns that into "
                        f"overshoot; at the learning rate that suits fp32 it can diverge. Fix: divide the learning rate "
                        f"by 2-5 (or use momentum <= 0.7 at the same lr / (1 - momentum)); see docs/baselines.md.",
                        UserWarning,
                        stacklevel=2,
                    )

    def describe(self) -> dict[str, Any]:
        return {"compressor": "OneBit", "granularity": self.granularity}


class _Groups:
    """The reconstruction groups of a group of layers (rows or whole layers), as segments of its flat tensor.

    Args:
        segments: the layers.
        num_groups: groups of a layer of a given shape (its elements split evenly among them).
    """

    def __init__(self, segments: Segments, num_groups: Callable[[torch.Size], int]) -> None:
        counts = [num_groups(shape) for shape in segments.shapes]
        sizes = [torch.Size([n // g]) for n, g in zip(segments.numels, counts) for _ in range(g)]
        #: every group of every layer, in flat order
        self.rows = Segments([name for name, g in zip(segments.names, counts) for _ in range(g)], sizes)
        #: the groups of each layer, to reduce a per-group value to a per-layer one
        self.per_layer = Segments(segments.names, [torch.Size([g]) for g in counts])
        self.payload = PackedPayload(segments, 1, [2 * g for g in counts])
        self._lengths: dict[torch.device, Tensor] = {}

    def lengths(self, device: torch.device) -> Tensor:
        """int64 ``[groups]``: elements per group."""
        cached = self._lengths.get(device)
        if cached is None:
            cached = self._lengths[device] = torch.tensor(self.rows.numels, dtype=torch.int64).to(device)
        return cached
