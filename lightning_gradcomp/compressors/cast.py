"""Half-precision casting baselines: fp16 and bf16 gradients summed by all-reduce.

As torch's ``fp16_compress_hook`` / ``bf16_compress_hook``: each rank divides its gradient by the world size
*before* casting, so the all-reduce sums values already scaled to the mean and fp16 does not overflow where
the fp32 sum would not. The payload is the cast tensor (2 bytes per element), summed in the cast dtype.
"""

from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation, Compressor, SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments


class Cast(Compressor):
    """Send gradients cast to a 16-bit float dtype; the sum over ranks is taken in that dtype.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    aggregation = Aggregation.SUM
    batched = True

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"Expected `dtype` to be torch.float16 or torch.bfloat16, but got {dtype!r}. "
                f"Fix: use the 'fp16' or 'bf16' compressor, or 'fp32' for uncompressed gradients."
            )
        self.dtype = dtype

    @override
    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        width = torch.finfo(self.dtype).bits // 8
        return FlatPacket(self._cast(flat.detach()), segments, flat.dtype, tuple(n * width for n in segments.numels))

    @override
    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        return self._uncast(packet.payload, packet.dtype)

    def _cast(self, flat: Tensor) -> Tensor:
        # pre-divide (as torch's compress hooks do) so the summed payload is the mean and stays in range
        return (flat / self.world_size).to(self.dtype)

    def _uncast(self, payload: Tensor, dtype: torch.dtype) -> Tensor:
        # linear in the payload; the hook divides the decoded sum by the world size again
        return payload.to(dtype) * self.world_size

    def describe(self) -> dict[str, Any]:
        return {"compressor": type(self).__name__, "dtype": str(self.dtype).removeprefix("torch.")}


class FP16(Cast):
    """fp16 gradients (torch's ``fp16_compress_hook``)."""

    def __init__(self) -> None:
        super().__init__(torch.float16)


class BF16(Cast):
    """bf16 gradients (torch's ``bf16_compress_hook``): fp32's range, 8 bits of mantissa."""

    def __init__(self) -> None:
        super().__init__(torch.bfloat16)
