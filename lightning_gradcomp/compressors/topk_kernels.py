"""Top-k's and DGC's kernel providers: the operations of their group step (:class:`TopKKernels`) on torch ops and on
Triton's (:mod:`lightning_gradcomp.kernels.triton_topk` selects, :mod:`~lightning_gradcomp.kernels.triton_compact`
compacts and scatters); both select the same elements and write the same payload bytes. Neither compressor has
compiled CPU kernels: its ``backend`` is always the torch ops'. On the torch ops, how a group's elements are
selected follows the compressor's ``selection`` (one partial selection per layer, or a fixed number of ops per
group); int2 values have no Triton scatter, and decode by torch ops on either provider.
"""

from collections.abc import Sequence
from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.compressors import dgc_group, topk_group
from lightning_gradcomp.compressors.backends import Kernels
from lightning_gradcomp.compressors.topk_group import SparseLayout
from lightning_gradcomp.flat import Segments

#: the selections by torch ops: every sparse layer's top-k of the magnitudes, int64 flat positions ascending
TOP_K = {"loop": topk_group.select_top_k, "batched": topk_group.select_top_k_batched}
_INT2 = "int2"


class TopKSettings(Protocol):
    """The setting of :class:`~lightning_gradcomp.compressors.TopK` the torch ops read (at each call)."""

    @property
    def selection(self) -> Optional[str]: ...


class TopKKernels(Protocol):
    """The operations of top-k's and DGC's group step that a kernel set runs."""

    @property
    def name(self) -> str:
        """The kernel set: ``"torch"``, ``"fused"`` or ``"triton"``."""
        ...

    def encode_top_k(self, x: Tensor, layout: SparseLayout) -> Tensor:
        """The group payload of every sparse layer's top-k of ``x``."""
        ...

    def dgc_encode(self, plan: dgc_group.DGCPlan, x: Tensor, starts: Sequence[int]) -> "tuple[Tensor, tuple[int, ...] | Tensor]":
        """DGC's selection of fp32 / fp16 values in the group payload, and the elements sent per layer."""
        ...

    def dgc_indices(
        self, plan: dgc_group.DGCPlan, x: Tensor, starts: Sequence[int]
    ) -> "tuple[Tensor, Tensor, tuple[int, ...] | Tensor]":
        """DGC's selection: (the values to encode, their flat positions ascending, the elements sent per layer)."""
        ...

    def decode_sent(self, payload: Tensor, layout: SparseLayout, dtype: torch.dtype, selection: Optional[Segments]) -> Tensor:
        """The flat tensor a payload stands for."""
        ...

    def decode_mean_into(
        self, payloads: Sequence[Tensor], layout: SparseLayout, dtype: torch.dtype, out: Tensor,
        selections: Sequence[Optional[Segments]],
    ) -> Tensor:
        """The ranks' mean of gathered payloads in ``out``."""
        ...


class TorchTopK:
    """Top-k's and DGC's group step in torch ops.

    Args:
        settings: the compressor, whose ``selection`` is read at each call.
    """

    name: Kernels = "torch"

    def __init__(self, settings: TopKSettings) -> None:
        self.settings = settings

    def selecting(self, x: Tensor) -> str:
        """The torch ops' selection on ``x``: the compressor's ``selection``, or by device when ``None`` (the loop on
        a CPU, where an op costs well under a microsecond, the batched ops elsewhere)."""
        selection = self.settings.selection
        if selection is None:
            return "loop" if x.device.type == "cpu" else "batched"
        if selection not in TOP_K:
            raise ValueError(f"Expected `selection` to be one of {list(TOP_K)} or None but got {selection!r}. "
                             "Fix: use None to choose by device.")
        return selection

    def encode_top_k(self, x: Tensor, layout: SparseLayout) -> Tensor:
        return topk_group.encode(x, layout, TOP_K[self.selecting(x)](x.abs(), layout))

    def dgc_indices(
        self, plan: dgc_group.DGCPlan, x: Tensor, starts: Sequence[int]
    ) -> "tuple[Tensor, Tensor, tuple[int, ...] | Tensor]":
        select = dgc_group.select_loop if self.selecting(x) == "loop" else dgc_group.select
        indices, sent = select(plan, x.abs(), starts)
        return x, indices, sent

    def dgc_encode(self, plan: dgc_group.DGCPlan, x: Tensor, starts: Sequence[int]) -> "tuple[Tensor, tuple[int, ...] | Tensor]":
        x, indices, sent = self.dgc_indices(plan, x, starts)
        return topk_group.encode(x, plan.layout, indices), sent

    def decode_sent(self, payload: Tensor, layout: SparseLayout, dtype: torch.dtype, selection: Optional[Segments]) -> Tensor:
        return topk_group.decode_sent(payload, layout, dtype, selection)

    def decode_mean_into(
        self, payloads: Sequence[Tensor], layout: SparseLayout, dtype: torch.dtype, out: Tensor,
        selections: Sequence[Optional[Segments]],
    ) -> Tensor:
        return topk_group.decode_mean_into(payloads, layout, dtype, out,
                                          lambda p, s, total: topk_group.add_decoded(p, layout, s, total), selections)


class TritonTopK(TorchTopK):
    """Top-k's and DGC's group step in Triton kernels: a radix select and a compaction, DGC's counts, thresholds and
    marks, and the scatters of fp32 / fp16 values."""

    name: Kernels = "triton"

    def encode_top_k(self, x: Tensor, layout: SparseLayout) -> Tensor:
        return topk_group.encode_top_k(x, layout)

    def dgc_indices(
        self, plan: dgc_group.DGCPlan, x: Tensor, starts: Sequence[int]
    ) -> "tuple[Tensor, Tensor, tuple[int, ...] | Tensor]":
        x = x.float().contiguous()
        mask, sent = dgc_group.select_mask(plan, x, starts)
        return x, torch.nonzero(mask).reshape(-1), sent

    def dgc_encode(self, plan: dgc_group.DGCPlan, x: Tensor, starts: Sequence[int]) -> "tuple[Tensor, tuple[int, ...] | Tensor]":
        x = x.float().contiguous()
        mask, sent = dgc_group.select_mask(plan, x, starts)
        return topk_group.encode_mask(x, plan.layout, mask), sent

    def decode_sent(self, payload: Tensor, layout: SparseLayout, dtype: torch.dtype, selection: Optional[Segments]) -> Tensor:
        if layout.value_dtype == _INT2:
            return super().decode_sent(payload, layout, dtype, selection)
        return topk_group.scatter_sent(payload, layout, dtype)

    def decode_mean_into(
        self, payloads: Sequence[Tensor], layout: SparseLayout, dtype: torch.dtype, out: Tensor,
        selections: Sequence[Optional[Segments]],
    ) -> Tensor:
        if layout.value_dtype == _INT2:
            return super().decode_mean_into(payloads, layout, dtype, out, selections)
        return topk_group.decode_mean_into(payloads, layout, dtype, out,
                                          lambda p, s, total: topk_group.add_sections(p, layout, total), selections)


#: top-k's and DGC's provider of each kernel set (no compiled CPU kernels)
TOPK_KERNELS: dict[Kernels, type[TorchTopK]] = {"torch": TorchTopK, "triton": TritonTopK}

__all__ = ["TOPK_KERNELS", "TOP_K", "TopKKernels", "TopKSettings", "TorchTopK", "TritonTopK"]
