"""Int8 with a shared scale, summed by all-reduce: INTELLECT-1's pseudo-gradient quantization, made summable.

INTELLECT-1 (arXiv 2412.01152) all-reduces its DiLoCo pseudo-gradients in int8. For the sum of the ranks'
int8 codes to stay in int8 (and so travel by a plain all-reduce, one byte per element on the wire), every rank
uses the same scale and at most ``L = 127 // world_size`` levels per side: the scale is the max over ranks of
``max|x|`` (one small max all-reduce per bucket, as TernGrad's shared scaler), and each element is rounded
stochastically to one of ``-L .. L`` (unbiased: ``E[q] * scale / L == x``). With 2 ranks that is 63 levels, with
4 ranks 31, with 8 ranks 15: fewer levels as the group grows, which is the price of summing in int8.

Written once, for a group of layers (a single tensor is a group of one). The rounding draws come from counter-based
streams, one per parameter name (:class:`CounterStreams`): a group draws in one call exactly what its layers draw one
by one (``tests/oracles/dense.py`` holds the per-layer reference), and the state that a checkpoint keeps is one
counter per name.
"""

from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.streams import CounterStreams, load_counters
from lightning_gradcomp.validation import check_int

_INT8_MAX = 127


class Int8(Compressor):
    """Unbiased stochastic int8 quantization with a scale shared by all ranks, summed by an int8 all-reduce.

    Args:
        seed: seed of the stochastic rounding; rank r draws from seed and r, one stream per parameter name.
    """

    aggregation = Aggregation.SUM
    batched = True

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        check_int("seed", seed, minimum=0)
        self.seed = seed
        self._streams = CounterStreams(seed)

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        if world_size > _INT8_MAX:
            raise ValueError(
                f"Expected at most {_INT8_MAX} ranks for Int8 (the int8 sum needs one level per side and rank), but "
                f"got world_size={world_size}. Fix: use QSGD or TernGrad(collective='allgather') for larger groups."
            )
        super().setup(rank, world_size, device)
        self._streams.reset(rank)

    @property
    def levels(self) -> int:
        """L: codes run over ``-L .. L`` so that the sum over the group's ranks fits in int8."""
        return _INT8_MAX // max(1, self.world_size)

    @override
    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return SharedStatistic(_amax_flat(flat, segments), (1,) * len(segments))

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        x = flat.detach().float()
        scale = shared.values if shared is not None else _amax_flat(x, segments)
        rnd = self._streams.uniform_flat(segments, x.device)
        codes = self._round(x, segments.expand(self._inverse(scale)), rnd)
        return FlatPacket(codes, segments, flat.dtype, segments.numels, ctx={"scale": scale}, stats={"scaler": scale})

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        step = packet.segments.expand(packet.ctx["scale"] / self.levels)
        return (packet.payload.float() * step).to(packet.dtype)

    def _inverse(self, scale: Tensor) -> Tensor:
        """L / scale (0 where the scale is 0: an all-zero tensor on every rank sends zeros), without a host read."""
        return torch.where(scale > 0, self.levels / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)

    def _round(self, flat: Tensor, inverse: Tensor, rnd: Tensor) -> Tensor:
        """int8 codes of ``flat``: |x| / scale * L in [0, L] rounded up with probability its fraction, signed."""
        y = flat.abs().mul_(inverse)
        low = y.floor()
        return (low + (rnd < (y - low)).float()).clamp_(max=self.levels).mul_(torch.sign(flat)).to(torch.int8)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_counters(self._streams, state.get("streams", {}), type(self).__name__)

    def describe(self) -> dict[str, Any]:
        return {"compressor": type(self).__name__, "levels": self.levels, "seed": self.seed}


def _amax_flat(flat: Tensor, segments: Segments) -> Tensor:
    """The largest magnitude of every layer of a group (0 for an empty layer), ``[layers]`` float32: the scales
    every rank shares."""
    return segments.reduce(flat.detach().abs().float(), "amax")
