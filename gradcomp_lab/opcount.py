"""Count the aten ops and host reads one training step dispatches, and what the gradcomp hook adds to plain DDP.

On a GPU every dispatched op is (at least) one kernel launch of several microseconds and every host read
drains the stream, so a hook that dispatches a fixed number of ops per parameter tensor costs time in
proportion to the model's tensor count. Counting on CPU shows it without a GPU, and counts are deterministic, so
tests can assert them (timings never).

Three things are counted, each at torch's dispatcher (a :class:`~torch.utils._python_dispatch.TorchDispatchMode`,
which sees every aten op, including those called from C++ extensions and inside autograd):

* ops: every aten op overload dispatched (views and in-place ops included: each is a dispatch on every device);
* host reads: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``if t:``) and
  ``Tensor.tolist()`` (which reads memory without dispatching; seen by a
  :class:`~torch.overrides.TorchFunctionMode`);
* data-dependent ops: ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``,
  indexing with a boolean mask). On CUDA each one waits for the device to learn the size; on CPU it does not,
  which is why they are counted apart from host reads.

Only the calling thread is counted (the modes are thread-local): at world size 1 the hook decodes inline, so one
step at world size 1 sees everything the hook does. :func:`hook_op_overhead` measures the hook's ops beyond
DDP with torch's own all-reduce hook that way.

Written here rather than taken from torch: ``torch.utils.flop_counter`` counts flops of a few matmul-like ops,
and ``torch.profiler`` records times with per-event overhead and no notion of host reads; neither counts
dispatches.
"""

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook

#: aten ops whose output size depends on the values of their input (a device-to-host wait on CUDA)
DATA_DEPENDENT_OPS: frozenset[str] = frozenset(
    {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
     "argwhere", "repeat_interleave"}
)


@dataclass
class OpCount:
    """What one counted region dispatched.

    Attributes:
        ops: aten op overload name -> times dispatched.
        host_reads: scalar reads (``aten._local_scalar_dense``) and ``Tensor.tolist()`` calls.
        data_dependent: dispatched ops whose output size depends on the data (see :data:`DATA_DEPENDENT_OPS`).
    """

    ops: Counter[str] = field(default_factory=Counter)
    host_reads: int = 0
    data_dependent: int = 0

    @property
    def total(self) -> int:
        """All aten ops dispatched."""
        return sum(self.ops.values())

    def minus(self, other: "OpCount") -> "OpCount":
        """This count less ``other`` (per op name; negative where ``other`` dispatched more)."""
        ops: Counter[str] = Counter(self.ops)
        ops.subtract(other.ops)
        return OpCount(ops, self.host_reads - other.host_reads, self.data_dependent - other.data_dependent)


def _is_data_dependent(name: str, args: tuple[Any, ...]) -> bool:
    base = name.split(".")[0]
    if base in DATA_DEPENDENT_OPS:
        return True
    if base in ("index", "_index_put_impl_", "index_put", "index_put_"):
        # a boolean mask as an index becomes nonzero() inside the kernel, below this mode
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        name = func.name().removeprefix("aten::")
        self.count.ops[name] += 1
        if name.startswith("_local_scalar_dense"):
            self.count.host_reads += 1
        elif _is_data_dependent(name, args):
            self.count.data_dependent += 1
        return func(*args, **(kwargs or {}))


class _ListReadCounter(TorchFunctionMode):
    """``Tensor.tolist()`` reads the tensor's memory without dispatching an op: seen one level up."""

    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None) -> Any:
        if func is Tensor.tolist:
            self.count.host_reads += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_ops() -> Iterator[OpCount]:
    """Count the aten ops, host reads and data-dependent ops dispatched by this thread inside the block.

    Example::

        with count_ops() as counted:
            loss.backward()
        print(counted.total, counted.host_reads)
    """
    count = OpCount()
    with _ListReadCounter(count), _DispatchCounter(count):
        yield count


class _ResidualLinear(nn.Module):
    """``x + 0.1 relu(linear(x))``: a deep stack keeps non-zero gradients in every layer (a plain ReLU stack of 80
    layers underflows, and an all-zero gradient takes other branches in some compressors)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + 0.1 * torch.relu(self.linear(x))


def mlp(tensors: int, width: int = 32, seed: int = 0) -> nn.Module:
    """``tensors // 2`` residual ``Linear(width, width)`` layers with bias (``tensors`` must be even)."""
    if tensors < 2 or tensors % 2:
        raise ValueError(f"Expected `tensors` to be an even number >= 2, but got {tensors}. Fix: use 40 or 160.")
    torch.manual_seed(seed)
    return nn.Sequential(*[_ResidualLinear(width) for _ in range(tensors // 2)])


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """The default process group: the existing one, else a 1-rank Gloo group in this process (destroyed after)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(
                f"Expected no default process group or one of world size 1, but got world size {dist.get_world_size()}. "
                "Fix: count ops in a process without a group (one is made here) or in a 1-rank group."
            )
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def step_ops(
    model: nn.Module,
    compressor: Optional[Compressor],
    batch: int = 8,
    warmup: int = 3,
    hook: Optional[Callable[[Any, dist.GradBucket], torch.futures.Future[Tensor]]] = None,
    hook_state: Any = None,
) -> OpCount:
    """Ops of one training step (forward, backward with DDP's exchange, SGD step) at world size 1.

    Args:
        model: the module (its parameters in one DDP bucket: the bucket cap is set above the model's size).
        compressor: exchanged through :func:`~lightning_gradcomp.gradcomp_hook` (set up for rank 0 of 1), or
            ``None``: plain DDP, or ``hook`` when given.
        batch: rows of the random input.
        warmup: steps before the counted one (DDP rebuilds its buckets after the first step; compressors warm up).
        hook, hook_state: another comm hook (e.g. torch's ``fp16_compress_hook``), when ``compressor`` is None.
    """
    width = next(p for p in model.parameters() if p.dim() == 2).shape[1]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with single_rank_group():
        ddp = DistributedDataParallel(model, bucket_cap_mb=max(1.0, 2 * nbytes / 2**20))
        if compressor is not None:
            compressor.setup(0, 1, torch.device("cpu"))
            state = GradCompState(compressor=compressor, names={id(p): n for n, p in model.named_parameters()})
            ddp.register_comm_hook(state, gradcomp_hook)
        elif hook is not None:
            ddp.register_comm_hook(hook_state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(0)
        counts = []
        for step in range(warmup + 1):
            x = torch.randn(batch, width, generator=gen)
            with count_ops() if step == warmup else contextlib.nullcontext(OpCount()) as count:
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
            counts.append(count)
        del ddp, opt
    if compressor is not None and (state.guard.skipped_steps or not all(torch.isfinite(p).all() for p in model.parameters())):
        raise RuntimeError("the counted step was skipped or left non-finite parameters: its ops are not a step's")
    return counts[-1]


def hook_op_overhead(make_compressor: Callable[[], Compressor], tensors: int, width: int = 32) -> OpCount:
    """Ops one step with the gradcomp hook dispatches beyond the same step of DDP with torch's own all-reduce comm
    hook, on :func:`mlp` (``tensors``).

    The baseline registers a hook too because DDP's reducer treats any hooked bucket alike: after the hook it copies
    the bucket back into each ``.grad`` (a view, a slice and a copy per parameter), where unhooked DDP fuses that
    copy into its division by the world size. Those per-parameter ops are DDP's, whatever the hook, so they are in
    the baseline and the difference is what the gradcomp hook itself dispatches.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with_hook = step_ops(mlp(tensors, width), make_compressor())
    return with_hook.minus(step_ops(mlp(tensors, width), None, hook=allreduce_hook, hook_state=None))


__all__ = ["DATA_DEPENDENT_OPS", "OpCount", "count_ops", "hook_op_overhead", "mlp", "single_rank_group", "step_ops"]
