"""The compressed exchange of a sharded model's gradient shards between replicas (FSDP2, HSDP-style).

A model is sharded with FSDP2's ``fully_shard`` over the ``"shard"`` dimension of a ``("replicate", "shard")``
device mesh: inside a replica (a node), FSDP2 reduce-scatters the gradients densely, so each rank holds the mean of
its replica for its own shard. What remains is the mean over replicas, which stock HSDP sends as a dense all-reduce
over the slow link. Here FSDP2 hands each unit's reduce-scattered shard to :func:`~lightning_gradcomp.exchange.hook.gradcomp_hook`
(``FSDPModule.set_all_reduce_hook``) as one bucket whose group is the replicate group: every compressor, its error
feedback keyed by parameter name (each rank's residual covers its own shard only), the non-finite guard, the ledger
and the statistics work exactly as for a DDP bucket. Nothing here compresses or communicates on its own. With one
replica there is nothing to average between replicas: the hook's non-finite guard alone runs on each shard (no
compressor, no transform, no collective, no bytes), so the run is plain FSDP2.

Why the layout is read from FSDP2's parameter group: the hook receives one flat tensor per unit, the shards of the
unit's parameters back to back, each padded to an equal share of its first dimension. The public API gives no
layout, so :func:`shard_layout` reads it from the unit's ``FSDPParam`` records (``sharded_size``,
``padded_sharded_param_size``), checks it against every flat tensor it is handed, and fails with a clear error if a
torch release changes it.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gradcomp.exchange.guard import begin_step, bucket_is_nonfinite
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.exchange.ledger import dense_bytes


@dataclass(frozen=True)
class ShardLayout:
    """Where each parameter's gradient shard lies in one FSDP unit's reduce-scattered flat tensor.

    Attributes:
        params: the unit's sharded parameters (the module's own ``nn.Parameter`` objects), in FSDP2's order.
        offsets: each shard's first element in the flat tensor.
        shapes: each shard's shape on this rank (the last ranks' shards may be shorter, or empty).
        numel: the flat tensor's length, padding included.
    """

    params: tuple[nn.Parameter, ...]
    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    numel: int


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of ``model`` (modules that ``fully_shard`` was applied to), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_layout(unit: nn.Module) -> ShardLayout:
    """The layout of ``unit``'s reduce-scattered gradient (see the module docstring for why FSDP2's records).

    Raises:
        RuntimeError: this torch's FSDP2 keeps its parameter records differently (a torch release we do not know).
    """
    try:
        group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        records = [] if group is None else [r for r in group.fsdp_params if r.sharded_param.requires_grad]
        params, offsets, shapes, at = [], [], [], 0
        for record in records:
            if record.offload_to_cpu:
                raise ValueError(
                    f"Expected FSDP2 without CPU offload under the compressed replica exchange, but "
                    f"`{record._param_fqn}` is offloaded (`offload_policy=CPUOffloadPolicy()`). Fix: drop the offload "
                    f"policy from `fully_shard`: the exchange compresses the shard where FSDP2 reduced it."
                )
            params.append(record.sharded_param)
            offsets.append(at)
            shapes.append(torch.Size(record.sharded_size))
            at += record.padded_sharded_param_size.numel()
    except AttributeError as error:
        raise RuntimeError(
            f"Expected FSDP2's parameter records (`FSDPParam.sharded_size`, `padded_sharded_param_size`) on "
            f"{type(unit).__name__}, but got {error}. Fix: use torch 2.6 to 2.13, whose FSDP2 this exchange reads."
        ) from error
    return ShardLayout(tuple(params), tuple(offsets), tuple(shapes), at)


class ShardBucket:
    """One unit's reduce-scattered gradient shards, shaped as DDP's ``GradBucket`` for the hook.

    ``buffer()`` is FSDP2's own flat tensor: the hook writes the replicas' decoded mean into it in place, and FSDP2
    then hands its views to the optimizer as the sharded gradients. Padding between shards is never read.
    """

    def __init__(self, index: int, is_last: bool, buffer: Tensor, layout: ShardLayout) -> None:
        self._index = index
        self._is_last = is_last
        self._buffer = buffer
        self._layout = layout

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> Sequence[nn.Parameter]:
        return self._layout.params

    def layer_offsets(self) -> tuple[int, ...]:
        return self._layout.offsets

    def layer_shapes(self) -> tuple[torch.Size, ...]:
        return self._layout.shapes

    def gradients(self) -> list[Tensor]:
        return [self._buffer[o : o + s.numel()].view(s) for o, s in zip(self._layout.offsets, self._layout.shapes)]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last


class ShardExchange:
    """Installs the compressed replica exchange on every FSDP2 unit of a model.

    Each backward hands the units' shards to the hook in FSDP2's reduce order, the same on every rank; a unit's
    bucket index is its place in that order within the step (index 0 opens the step for the non-finite guard and
    the residuals). Every unit reduce-scatters all its trainable parameters on every backward
    (``set_reduce_scatter_unused_params``: an unused one contributes zeros), so each unit's layout is fixed and
    every replica issues the same collectives even where a rank skipped a layer. With one replica (``state``'s
    world size 1) each unit's shard only passes the non-finite guard (:func:`guard_shard`): nothing is compressed.

    Args:
        state: the hook state; its process group is the replicate group (one rank per replica holding the same
            shard), its world size the number of replicas.
        model: the model, already sharded by ``fully_shard``.
    """

    def __init__(self, state: GradCompState, model: nn.Module) -> None:
        self.state = state
        self.units = fsdp_units(model)
        self.layouts = [shard_layout(u) for u in self.units]
        self._calls = 0
        self._expected = sum(1 for layout in self.layouts if layout.params)
        for unit, layout in zip(self.units, self.layouts):
            if not layout.params:
                continue
            if hasattr(unit, "set_reduce_scatter_unused_params"):  # torch >= 2.12; before, every parameter must be used
                unit.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
            unit.set_all_reduce_hook(self._hook_for(layout))  # type: ignore[operator]

    def _hook_for(self, layout: ShardLayout) -> Any:
        def hook(reduce_output: Tensor) -> None:
            if reduce_output.numel() != layout.numel:
                raise RuntimeError(
                    f"Expected FSDP2 to hand the replica exchange {layout.numel} gradient elements for the unit of "
                    f"{len(layout.params)} parameters, but got {reduce_output.numel()}. Fix: on a torch whose FSDP2 has no "
                    f"`set_reduce_scatter_unused_params` (before 2.12), give every trainable parameter of the unit a "
                    f"gradient on every step (or freeze the unused ones); otherwise use torch 2.11 to 2.13, whose FSDP2 "
                    f"layout this exchange reads."
                )
            index = self._calls
            self._calls = (self._calls + 1) % self._expected
            bucket = ShardBucket(index, index == self._expected - 1, reduce_output, layout)
            if self.state.world_size == 1:
                guard_shard(self.state, bucket)
                return
            # FSDP2 reads the shard right after the hook returns: the replicas' mean must be in place by then
            gradcomp_hook(self.state, bucket).wait()

        return hook

    def shard_bytes(self) -> int:
        """The fp32 size of this rank's gradient shards (what dense HSDP all-reduces per step, per rank)."""
        return sum(dense_bytes(sum(s.numel() for s in layout.shapes)) for layout in self.layouts)


def guard_shard(state: GradCompState, bucket: ShardBucket) -> None:
    """One replica: what the hook does to a bucket before anything compresses it, and nothing more. The bucket is
    counted (the step's end is detected from the last one), bucket 0 opens the step, and the non-finite guard decides
    on this shard (a skipped step's shard is filled with NaN, as the hook fills its buckets); the compressor, the
    transforms and the residuals never see it, no collective runs and the ledger records no bytes. What FSDP2
    reduce-scattered is what the optimizer gets: stock FSDP2's gradient, bit for bit."""
    state.ledger.bucket_called(bucket.is_last())
    if bucket.index() == 0:
        begin_step(state)
    names = [state.names[id(p)] for p in bucket.parameters()]
    if bucket_is_nonfinite(state, bucket.buffer(), bucket.gradients(), names):
        bucket.buffer().fill_(float("nan"))


def agree_on_skip(state: GradCompState, shard_group: dist.ProcessGroup, device: torch.device) -> None:
    """Make a step skipped on one shard skipped on every rank of the model.

    The hook's guard agrees inside the replicate group only: a NaN lands in the one shard it was reduce-scattered to,
    and the ranks holding other shards see finite gradients. One 4-byte all-reduce (MAX) over the shard group after
    backward spreads the decision; a rank that learns of it here skips as if its own guard had (residuals rolled back).
    """
    from lightning_gradcomp.exchange.guard import mark_skipped

    if state.guard.mode == "ignore" or dist.get_world_size(shard_group) == 1:
        return
    flag = torch.tensor([1.0 if state.guard.step_nonfinite else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_group)
    state.ledger.count("allreduce_nonfinite")
    if flag.item() > 0 and not state.guard.step_nonfinite:
        mark_skipped(state)
