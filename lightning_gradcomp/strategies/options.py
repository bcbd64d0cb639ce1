"""The strategies' options, declared once for the Trainer and the Fabric front end.

:class:`GradCompStrategy` and :class:`GradCompFabricStrategy` take the same options (:class:`DDPOptions`), as do
:class:`ShardedGradCompStrategy` and :class:`ShardedGradCompFabricStrategy` (:class:`ShardedOptions`); the options
every strategy takes are :class:`ExchangeOptions`. Each option's name, type, default and description is written in
its dataclass and nowhere else.

A front end's constructor is written as ``__init__(self, <leading>, options: X, <its own>, **kwargs)`` under
:func:`with_options`, which gives it the signature users call: the leading parameters, then every field of ``X`` as
a named parameter with its type and default, then its own. Whatever reads signatures at run time
(``inspect.signature``, LightningCLI / jsonargparse, ``help()``) sees those named parameters, so
``GradCompStrategy(compressor="fp32", min_numel=1024)`` and a YAML ``init_args`` block work as with hand-written
parameters; the API reference shows the same signature (``tools/griffe_options.py`` expands it statically).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, TypeVar, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.costmodel import CompressionCost, Link, Network
from lightning_gradcomp.exchange.guard import NonFinite
from lightning_gradcomp.sites.hierarchy import Hierarchy
from lightning_gradcomp.strategies._runtime import ResumeCompression

__all__ = ["DDPOptions", "ExchangeOptions", "ShardedOptions", "with_options"]


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
    """The options of the compressed exchange that every strategy takes.

    Args:
        compressor: a :class:`~lightning_gradcomp.compressors.Compressor` instance, or a registered name
            (``"terngrad"``, ``"fp32"``, ...). Under the sharded strategies it compresses each parameter's shard as
            a tensor of the shard's shape (see ``docs/sharded.md``).
        exclude: parameter-name patterns (``fnmatch`` globs, e.g. ``"classifier.*"``) sent uncompressed in
            fp32; every pattern must match at least one parameter.
        min_numel: parameters with fewer elements (whole tensor) are sent uncompressed (the TernGrad AlexNet
            script's ``size_to_binarize``; 1 compresses everything).
        pipeline_mb: MiB of gradient per pipelined group inside a bucket (a sharded unit's shard): the hook
            compresses a group and launches its collectives before compressing the next, so compression overlaps
            the transfer of the previous group (a parameter is never split). ``None``: one group per bucket.
            Results are identical either way; each extra group costs one collective's latency.
        check_replicas_every: every k optimizer steps, compare the parameters (a sharded model: every rank's
            shard) of the ranks that must hold the same ones and stop every rank with an error naming the first
            diverging parameter (0: never). Costs one all-gather of 16 bytes per parameter tensor.
        nonfinite: a NaN/Inf gradient on any rank: ``"skip"`` the step on every rank (residuals untouched; under
            Fabric ``fabric.backward`` drops the gradients, so the next ``optimizer.step()`` is a no-op),
            ``"raise"`` on every rank naming the parameter, or ``"ignore"`` (no check). See
            :mod:`lightning_gradcomp.exchange.guard`.
        resume_compression: ``"exact"`` restores every rank's compression state from the checkpoint (and refuses
            a checkpoint written by another world size); ``"reset"`` starts it afresh.
        process_group_backend: ``"gloo"``, ``"nccl"``, or ``None`` for the device's default.
        timeout: collective timeout (a positive ``timedelta``), also of the strategy's own groups: how long a
            rank waits for a peer that stopped answering before it fails. A peer that dies is usually detected at
            once (Gloo: connection closed).
    """

    compressor: Union[Compressor, str] = "terngrad"
    exclude: Optional[Sequence[str]] = None
    min_numel: int = 1
    pipeline_mb: Optional[float] = 8.0
    check_replicas_every: int = 0
    nonfinite: NonFinite = "skip"
    resume_compression: ResumeCompression = "exact"
    process_group_backend: Optional[str] = None
    timeout: Optional[timedelta] = default_pg_timeout


@dataclasses.dataclass(frozen=True)
class DDPOptions(ExchangeOptions):
    """The options of :class:`~lightning_gradcomp.GradCompStrategy` and
    :class:`~lightning_gradcomp.strategies.fabric.GradCompFabricStrategy`: :class:`ExchangeOptions`, DDP's and the
    Lightning ``DDPStrategy``'s, the collective planner's and the hierarchical exchange's.

    Args:
        find_unused_parameters: as in ``DistributedDataParallel``.
        static_graph: as in ``DistributedDataParallel``.
        gradient_as_bucket_view: as in ``DistributedDataParallel``.
        bucket_cap_mb: DDP bucket size in MiB (``None``: DDP's default).
        broadcast_buffers: as in ``DistributedDataParallel``; ``None`` (default) leaves it to DDP (buffers synced),
            without torch's deprecation warning for passing it, as stock ``strategy="ddp"`` does.
        accelerator: see Lightning's ``DDPStrategy``.
        parallel_devices: see Lightning's ``DDPStrategy``.
        cluster_environment: see Lightning's ``DDPStrategy``.
        checkpoint_io: see Lightning's ``DDPStrategy``.
        start_method: how Lightning launches local processes (``"popen"``, ``"spawn"``, ``"fork"`` in notebooks).
        link: the network between ranks (``"1gbit"``, ``"100mbit@2ms"``, a
            :class:`~lightning_gradcomp.exchange.costmodel.Link` or ``Network``); when given, a cost model picks per
            bucket between plain fp32 all-reduce and the compressor's collectives (logged at INFO, counted in
            ``comm_state.ledger.collectives``). ``None`` (default): always compress.
        compression_cost: compress/decode seconds per element for that choice; ``None`` measures them on the
            first step (max over ranks).
        hierarchy: ``"node"``: the hierarchical exchange with one site per node (see
            :mod:`lightning_gradcomp.sites.hierarchy`): dense inside a site, ``compressor`` between sites. ``None``
            (default): flat, unless one of the next two is given. At most one of ``hierarchy``, ``site_size`` and
            ``site_sizes``.
        site_size: the hierarchical exchange with sites of this many consecutive ranks (at least 2).
        site_sizes: the hierarchical exchange with these sites (consecutive ranks, equal sizes >= 2), e.g. ``[2, 2]``.
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: Optional[float] = None
    broadcast_buffers: Optional[bool] = None
    accelerator: Optional[Any] = None
    parallel_devices: Optional[list[torch.device]] = None
    cluster_environment: Optional[ClusterEnvironment] = None
    checkpoint_io: Optional[CheckpointIO] = None
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"
    link: Optional[Union[str, Link, Network]] = None
    compression_cost: Optional[CompressionCost] = None
    hierarchy: Optional[Hierarchy] = None
    site_size: Optional[int] = None
    site_sizes: Optional[list[int]] = None

    def ddp_flags(self) -> dict[str, Any]:
        """The ``DistributedDataParallel`` arguments among the options (validated with DDP's other options)."""
        return dict(find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
                    gradient_as_bucket_view=self.gradient_as_bucket_view, broadcast_buffers=self.broadcast_buffers)

    def lightning_kwargs(self) -> dict[str, Any]:
        """The arguments of Lightning's ``DDPStrategy`` among the options (the Trainer's and Fabric's take the same
        names; DDP's own, ``bucket_cap_mb`` and ``broadcast_buffers`` only where set: torch >= 2.13 warns whenever
        ``broadcast_buffers`` is passed, even with its default)."""
        kwargs: dict[str, Any] = dict(
            accelerator=self.accelerator, parallel_devices=self.parallel_devices,
            cluster_environment=self.cluster_environment, checkpoint_io=self.checkpoint_io,
            process_group_backend=self.process_group_backend, timeout=self.timeout, start_method=self.start_method,
            find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        if self.broadcast_buffers is not None:
            kwargs["broadcast_buffers"] = self.broadcast_buffers
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs


@dataclasses.dataclass(frozen=True)
class ShardedOptions(ExchangeOptions):
    """The options of :class:`~lightning_gradcomp.ShardedGradCompStrategy` and
    :class:`~lightning_gradcomp.strategies.fabric.ShardedGradCompFabricStrategy`: :class:`ExchangeOptions` and the
    device mesh's.

    Args:
        shard_size: ranks that shard one replica of the model (consecutive ranks, normally one node's devices);
            ``None``: the ranks of one node. Must divide the world size.
        save_distributed_checkpoint: as in Lightning's ``ModelParallelStrategy``: ``torch.distributed.checkpoint``
            shards, each rank writing its own (``True``), or one full file.
        compress_across_nodes: shard the model over every rank (one replica: ``shard_size`` ``None`` or the world
            size) and compress FSDP2's gradient reduce-scatter between nodes with ``compressor`` (``"int8"``:
            blockwise int8 with error feedback; ``BlockInt8(bits=4)``: int4 codes with block scales, as ZeRO++'s
            qgZ; ``"terngrad"``, ``"qsgd"``, ``"onebit"``, ``"bf16"``: as under DDP, per piece; ``"fp32"``: FSDP2's
            own reduce-scatter, stock FSDP2's bits), dense inside a node
            (:class:`~lightning_gradcomp.strategies.fsdp_collectives.CompressedReduceScatter`). The weights'
            all-gather stays FSDP2's (dense) unless ``quantize_weights``. Its residuals are in every rank's
            checkpoint state.
        node_size: with ``compress_across_nodes``, the ranks of one node (consecutive ranks); ``None``: the
            Trainer's or Fabric's ``devices``. Must divide the world size into 2 nodes or more.
        quantize_weights: with ``compress_across_nodes``, also replace FSDP2's weight all-gather: blockwise int8
            between nodes (256 elements per fp32 scale, as ZeRO++'s qwZ), dense inside a node
            (:class:`~lightning_gradcomp.strategies.fsdp_all_gather.QuantizedAllGather`). Every rank computes with
            the same quantized weights; the optimizer updates the full-precision shards. Its bytes between nodes
            join ``bytes_per_step()``.
    """

    shard_size: Optional[int] = None
    save_distributed_checkpoint: bool = True
    compress_across_nodes: bool = False
    node_size: Optional[int] = None
    quantize_weights: bool = False


OptionsT = TypeVar("OptionsT", bound=ExchangeOptions)
_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _parameters(options: type[ExchangeOptions]) -> list[inspect.Parameter]:
    """The options' fields as named parameters, in declaration order, with their types and defaults."""
    return [inspect.Parameter(f.name, _KEYWORD, default=f.default, annotation=f.type)
            for f in dataclasses.fields(options)]


def _args_section(options: type[ExchangeOptions]) -> str:
    """The ``Args:`` entries of ``options`` and of the option classes it extends, base first (for ``help()`` and
    the CLI's help, which read the constructor's docstring)."""
    entries: list[str] = []
    for cls in reversed(options.__mro__):
        doc = cls.__dict__.get("__doc__") if dataclasses.is_dataclass(cls) else None
        if doc and "Args:" in doc:
            entries.append(inspect.cleandoc(doc.split("Args:", 1)[1]).rstrip())
    return f"Takes every option of :class:`{options.__name__}` by name.\n\nArgs:\n" + "\n".join("    " + line if line else line for block in entries for line in block.splitlines())


def with_options(options: type[OptionsT]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a strategy constructor written as ``__init__(self, <leading>, options: X, <its own>, **kwargs)`` the
    signature users call: ``options`` replaced by every field of ``options`` (the dataclass ``X``) as a named
    parameter. A call binds to that signature (a wrong or missing name is Python's ``TypeError``, an extra keyword
    goes to ``**kwargs`` where there is one) and the constructor receives the options as one ``X``.
    """

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        written = list(inspect.signature(init).parameters.values())
        at = next(i for i, p in enumerate(written) if p.name == "options")
        fields = _parameters(options)
        # the front end's own parameters keep their kind; after the fields they must take a default
        signature = inspect.Signature([*written[:at], *fields, *written[at + 1:]])
        names = [f.name for f in fields]

        @functools.wraps(init)
        def construct(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            given.pop(written[0].name)
            extra = given.pop(next((p.name for p in written if p.kind is inspect.Parameter.VAR_KEYWORD), ""), {})
            chosen = options(**{n: given.pop(n) for n in names})
            init(self, options=chosen, **given, **extra)

        construct.__signature__ = signature  # type: ignore[attr-defined]  # read by inspect.signature, jsonargparse
        construct.__doc__ = _args_section(options)
        return construct

    return decorate
