"""The compression strategies under ``lightning.fabric``: ``GradCompFabricStrategy`` (DDP, ``Fabric(strategy="terngrad")``)
and ``ShardedGradCompFabricStrategy`` (FSDP2 inside a replica, compressed shards between replicas,
``Fabric(strategy="sharded_terngrad")``).

Fabric and the Trainer have separate ``DDPStrategy`` classes and separate strategy registries, so this is its own
class; what it shares with :class:`~lightning_gradcomp.GradCompStrategy` is the whole hook side
(:class:`~lightning_gradcomp.strategies.wiring.HookWiring`: options, transforms, :class:`~lightning_gradcomp.exchange.hook.GradCompState`,
the hierarchical exchange) and the per-rank runtime (:class:`~lightning_gradcomp.strategies._runtime.Runtime`); the sharded one
shares :class:`~lightning_gradcomp.strategies.sharded.ShardedWiring` with :class:`~lightning_gradcomp.ShardedGradCompStrategy`.
Both Fabric strategies share :class:`FabricRecovery` (the runtime's calls from Fabric's hooks: the compression state
in ``fabric.save``/``fabric.load``, the non-finite step after ``fabric.backward``, the replica check after
``optimizer.step()``). Importing :mod:`lightning_gradcomp`
registers every compressor name (and its ``<name>_notebook`` variant) and every ``sharded_<name>`` in
``lightning.fabric.strategies.STRATEGY_REGISTRY``.

Fabric has no Trainer callbacks, so the per-layer transforms are given to the strategy itself::

    from lightning_gradcomp.callbacks import SigmaClipping
    fabric = Fabric(strategy=GradCompFabricStrategy("fp32", transforms=[SigmaClipping(2.5)]), devices=2)

``fabric.save`` also stores every rank's compression state (residuals, random streams, transform buffers) as the
Trainer strategy does, and ``fabric.load`` gives each rank its own part back, so a resumed run continues exactly:
both with the objects (``fabric.load(path, state)``) and without (``full = fabric.load(path)`` followed by
``model.load_state_dict(full["model"])``; the compression state is restored by the load itself).

Only the per-step compressors (and their presets) run under Fabric: the names of strategies that need the Trainer's
loop (``"diloco"``, ``"streaming_diloco"``, ``"weightgrad"``, ``"onebit_adam"``, ...) are refused by
``Fabric(strategy=...)`` with what to use instead (:func:`fabric_alternatives`). Not
available under Fabric either (they need the Trainer's loop): ``CompressionSchedule``, ``CompressionMonitor`` and
``ExponentialMovingAverage`` (see ``docs/compatibility.md``). The replica check (``check_replicas_every``) and the
hierarchical exchange (``site_size``, ``site_sizes``, ``hierarchy``) work as under the Trainer.
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor, OptimizerCheck
from lightning_gradcomp.strategies import checkpoint as ckpt
from lightning_gradcomp.callbacks.base import PipelineCallback
from lightning_gradcomp.callbacks.momentum import MomentumCorrection
from lightning_gradcomp.strategies._runtime import Runtime, RuntimeOptions
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.strategies.options import DDPOptions, ExchangeOptions, ShardedOptions, with_options
from lightning_gradcomp.strategies.sharded import ShardedWiring, keyword_options, new_mesh
from lightning_gradcomp.strategies.wiring import HookWiring, check_backend

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_gradcomp.exchange.hook import GradCompState

    class _FabricBase(HookWiring, ParallelStrategy):
        """The type checker reads the mixin as the Fabric strategy it is mixed into, with the hook's wiring; at run
        time it is a plain mixin."""
else:
    _FabricBase = object


class FabricRecovery(RuntimeOptions, _FabricBase):
    """Fabric's side of the per-rank runtime (:class:`~lightning_gradcomp.strategies._runtime.Runtime`), shared by both Fabric
    strategies: every rank's compression state written by ``fabric.save`` and given back by ``fabric.load``, a
    skipped step's gradients dropped after ``fabric.backward``, and the replica check after ``optimizer.step()``. Its
    overrides translate Fabric's hooks into the runtime's calls, which
    :class:`~lightning_gradcomp.strategies.resilience.ResilienceMixin` makes from the Trainer's. The strategy calls
    :meth:`_init_recovery` from its constructor and :meth:`_attach_recovery` once the hook state exists."""

    comm_state: Optional["GradCompState"]

    def _init_recovery(self, options: ExchangeOptions) -> None:
        self._runtime = Runtime(options.nonfinite, options.resume_compression, options.timeout,
                                options.check_replicas_every)
        self._module: Optional[Module] = None

    def _attach_recovery(self, state: "GradCompState", module: Module) -> None:
        """The hook state exists (``fabric.setup``): remember the model (``fabric.backward`` passes none unless asked
        to) and restore a checkpoint loaded before the model was set up."""
        self._module = module
        self._runtime.attach(state, self.root_device)

    def _drop_skipped(self) -> None:
        """After backward: a step the guard skipped drops every gradient, so the next ``optimizer.step()`` is a no-op."""
        if self.comm_state is not None and self._module is not None:
            self._runtime.end_backward(self.comm_state, self._module.named_parameters(), self.global_rank,
                                       self.root_device, has_scaler=getattr(self.precision, "scaler", None) is not None)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self._module is not None:
            sets = self._replica_sets()
            # Fabric keeps no global step: the message counts this strategy's optimizer steps
            self._runtime.after_optimizer_step(self._module.named_parameters(), self.world_size,
                                               self._runtime.optimizer_steps + 1, sets, self._replica_scope(sets))
        return output

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        # every rank runs fabric.save: gather each rank's compression state, then rank 0 writes it (under the
        # sharded strategy into the metadata file beside the shards)
        state = dict(state)
        self._runtime.save(state, self.comm_state, self.global_rank, self.world_size, self._checkpoint_shard_size())
        super().save_checkpoint(path, state, storage_options, filter)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        if isinstance(state, (Module, Optimizer)):
            return remainder  # a bare module or optimizer state dict: no compression state in that file
        if not state:
            # `full = fabric.load(path)`, then `model.load_state_dict(full["model"])`: Fabric's other way to resume.
            # The user restores the model and optimizer by hand, but only this strategy can put back each rank's
            # compression state, so it does so here too; the checkpoint is returned whole, as Fabric documents
            saved = remainder.get(ckpt.CHECKPOINT_KEY)
        else:
            saved = remainder.pop(ckpt.CHECKPOINT_KEY, None)
        # both Fabric strategies' Lightning bases (DDPStrategy, ModelParallelStrategy) count the nodes
        sites, option = self._checkpoint_sites(self.world_size, getattr(self, "num_nodes", 1))
        # restored now into this run's hook state, or kept until `fabric.setup` builds it
        self._runtime.load({} if saved is None else {ckpt.CHECKPOINT_KEY: saved}, self.global_rank, self.world_size,
                           sites, option, self._checkpoint_shard_size(), self.comm_state, self.root_device)
        return remainder


class GradCompFabricStrategy(FabricRecovery, HookWiring, DDPStrategy):
    """Fabric's DDP with compressed gradient exchange inside DDP's communication hook.

    Args:
        options: every option of :class:`~lightning_gradcomp.strategies.options.DDPOptions` (as
            :class:`~lightning_gradcomp.GradCompStrategy` takes them), each a named parameter.
        transforms: per-layer transforms run inside the hook before compression, in order: pipeline callbacks
            (``SigmaClipping``, ``LocalGradientClipping``, ``MomentumCorrection`` without ``weight_decay``), which
            validate themselves against this strategy as under the Trainer, or
            :class:`~lightning_gradcomp.exchange.pipeline.LayerTransform` instances.
        precision: see Fabric's ``DDPStrategy``.
        **kwargs: further ``DistributedDataParallel`` options.
    """

    #: also registered as a name in Fabric's registry (`Fabric(strategy="gradcomp")`), as the Trainer's class is
    strategy_name = "gradcomp"

    @with_options(DDPOptions)
    def __init__(
        self,
        options: DDPOptions,
        transforms: Sequence[Union[PipelineCallback, LayerTransform]] = (),
        precision: Optional[Precision] = None,
        **kwargs: Any,
    ) -> None:
        self._init_recovery(options)
        # DDP's further options, checked (and the ones that would replace the hook refused) before DDP sees them
        ddp_kwargs = self._init_wiring(options, kwargs)
        self._momentum: Optional[float] = None
        for entry in transforms:
            self._attach(entry)
        super().__init__(precision=precision, **options.lightning_kwargs(), **ddp_kwargs)

    @override
    def setup_environment(self) -> None:
        check_backend(self._process_group_backend, self.root_device)
        if self.hierarchy is not None:  # the world size is known now: refuse a bad layout before any group exists
            self.hierarchy.layout(self.num_nodes * self.num_processes, self.num_nodes)
        self._warn_single_rank(self.num_nodes * self.num_processes)
        super().setup_environment()

    def _attach(self, entry: Union[PipelineCallback, LayerTransform]) -> None:
        if isinstance(entry, LayerTransform):
            self.add_transform(entry)
            return
        if not isinstance(entry, PipelineCallback):
            raise ValueError(
                f"Expected every entry of `transforms` to be a pipeline callback or a LayerTransform, but got {entry!r}. "
                f"Fix: pass e.g. `transforms=[SigmaClipping(2.5)]`; other Trainer callbacks have no Fabric equivalent."
            )
        if isinstance(entry, MomentumCorrection):
            if entry.weight_decay:
                raise ValueError(
                    f"Expected `MomentumCorrection.weight_decay` to be 0 under Fabric (its decay runs in a Trainer hook), "
                    f"but got {entry.weight_decay}. Fix: use `MomentumCorrection(weight_decay=0)` under Fabric, or "
                    f"the Trainer."
                )
            self._momentum = entry.momentum
        entry.transform = entry.make_transform(self)
        self.add_transform(entry.transform)

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self.comm_state is not None:
            raise ValueError(
                f"Expected one model per {type(self).__name__}, but `setup` was called for a second one ({type(module).__name__}). "
                f"Fix: put the models into one `nn.Module`, or use one Fabric per model."
            )
        model = super().setup_module(module)
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        # Fabric's DDPStrategy registers no comm hook of its own: ours goes on here, for Gloo and NCCL alike
        self.comm_state = self._build_hook_state(named, model.process_group, self.global_rank, self.world_size,
                                                 self.num_nodes, self.root_device, self._timeout)
        if self.global_rank == 0:  # the Trainer strategy's setup line: what compresses, with which bytes
            self._announce_hook_state(named)
        self._attach_recovery(self.comm_state, module)
        model.register_comm_hook(self.comm_state, self._hook_function())
        return model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._momentum is not None:
            MomentumCorrection.check_optimizers([optimizer], self._momentum)
        if isinstance(self.compressor, OptimizerCheck):  # as the Trainer strategy does (e.g. OneBit's momentum warning)
            self.compressor.check_optimizers([optimizer])
        self._warn_paper_default([optimizer])
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self._report_first_step(self.global_rank)
        self._drop_skipped()



def _shard_blocks(model: Module, device_mesh: "DeviceMesh") -> Module:
    """The default ``parallelize_fn``: ``fully_shard`` over ``device_mesh["shard"]`` on every entry (with parameters)
    of each ``nn.ModuleList`` (a transformer's blocks; nested lists first, as FSDP2 shards inner modules before the
    ones that hold them), then on the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["shard"]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    for blocks in reversed(lists):  # reversed module order: every list after the lists inside its entries
        for block in blocks:
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ShardedGradCompFabricStrategy(FabricRecovery, ShardedWiring, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with FSDP2 inside a replica and a compressed exchange of gradient shards
    between replicas: the Fabric twin of :class:`~lightning_gradcomp.ShardedGradCompStrategy`.

    The world is a ``(world_size // shard_size, shard_size)`` device mesh named ``("replicate", "shard")``.
    ``fabric.setup(model)`` calls ``parallelize_fn(model, device_mesh)``, which must shard the model with
    ``fully_shard(module, mesh=device_mesh["shard"])`` (each block, then the root); the strategy then installs the
    exchange on every FSDP2 unit, as the Trainer strategy does. Create the optimizer after ``fabric.setup(model)``
    (sharding replaces the parameters) and pass it to ``fabric.setup_optimizers``.

    Args:
        parallelize_fn: ``parallelize_fn(model, device_mesh) -> model``, as in Fabric's ``ModelParallelStrategy``.
            ``None``: ``fully_shard`` over ``device_mesh["shard"]`` on every entry of each ``nn.ModuleList`` (a
            transformer's blocks), then on the root.
        options: every option of :class:`~lightning_gradcomp.strategies.options.ShardedOptions` (as
            :class:`~lightning_gradcomp.ShardedGradCompStrategy` takes them), each a named parameter.
        **kwargs: refused with the option named (a misspelt option, or the DDP engine's ``site_size``), as a
            ``ValueError``.
    """

    #: also registered as a name in Fabric's registry (`Fabric(strategy="sharded_gradcomp")`)
    strategy_name = "sharded_gradcomp"

    @with_options(ShardedOptions)
    def __init__(
        self,
        parallelize_fn: Optional[Callable[[Any, "DeviceMesh"], Any]] = None,
        *,
        options: ShardedOptions,
        **kwargs: Any,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ValueError(
                f"Expected `parallelize_fn` to be a function `(model, device_mesh) -> model` or None, but got "
                f"{parallelize_fn!r}. Fix: pass the compressor by keyword, e.g. "
                f"`ShardedGradCompFabricStrategy(compressor='terngrad')`, and a function that calls "
                f"`fully_shard(block, mesh=device_mesh['shard'])` as `parallelize_fn`."
            )
        self._init_sharding(options.shard_size, kwargs, keyword_options(ShardedGradCompFabricStrategy))
        self._init_recovery(options)
        self._init_wiring(options)
        self._init_across_nodes(options.compress_across_nodes, options.node_size, options.quantize_weights)
        super().__init__(
            parallelize_fn=parallelize_fn or _shard_blocks,
            save_distributed_checkpoint=options.save_distributed_checkpoint,
            process_group_backend=options.process_group_backend,
            timeout=options.timeout,
        )

    @override
    def setup_environment(self) -> None:
        check_backend(self._process_group_backend, self.root_device)
        # before any process group exists
        replicas, shard = self._mesh_shape(self.num_nodes * self.num_processes, self.num_processes)
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self._device_mesh = new_mesh(replicas, shard, self.global_rank, self.root_device.type, self._timeout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank trains on its own data, as in DDP: sharding splits the model, not the batch
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_module(self, module: Module) -> Module:
        if self.comm_state is not None:
            raise ValueError(
                f"Expected one model per {type(self).__name__}, but `setup` was called for a second one "
                f"({type(module).__name__}). Fix: put the models into one `nn.Module`, or use one Fabric per model."
            )
        model = super().setup_module(module)  # parallelize_fn, then materialized on the device
        state = self._install_exchange(model, self.device_mesh, self.global_rank, self.root_device, "parallelize_fn",
                                       "device_mesh")
        self._install_reduce_scatter(model, state, self.num_processes)
        self._attach_recovery(state, model)
        return model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is not None:
            # sharding replaced the model's parameters: an optimizer made before `fabric.setup(model)` would step
            # the old, unsharded ones and the model would never change
            own = {id(p) for p in self._module.parameters()}
            stale = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
            if stale:
                raise ValueError(
                    f"Expected the optimizer to hold the sharded model's parameters, but got {type(optimizer).__name__} "
                    f"with {stale} parameter(s) that are not the model's (created before `fabric.setup(model)`, which "
                    f"replaces them with their shards). Fix: `model = fabric.setup(model)`, then "
                    f"`optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
                )
        self._check_optimizers([optimizer])  # as the Trainer strategy does (e.g. DeMo's sign-step warning)
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self._agree_on_skip(self.device_mesh, self.root_device)  # a skip on one shard skips the step everywhere
        self._report_first_step(self.global_rank)
        self._drop_skipped()


class PresetFabricStrategy(GradCompFabricStrategy):
    """:class:`GradCompFabricStrategy` with a preset's compressor setting (``Fabric(strategy="terngrad_lm")``;
    :mod:`lightning_gradcomp.strategies.presets`): the compressor's options, and the parameters of every ``nn.Embedding`` in
    fp32 where the preset says so. Presets with dense steps are Trainer-only (they need the Trainer's
    ``CompressionSchedule``).

    Args:
        preset: a preset name without dense steps (:func:`lightning_gradcomp.strategies.presets.preset_names`).
        row_levels: compress the embeddings by QSGD at this many levels with a norm per row instead of the preset's
            way (``terngrad_lm``: fp32); ``None``: the preset's. Measured by ``benchmarks/presets_generalise.py``.
        **kwargs: :class:`GradCompFabricStrategy`'s options, except ``compressor``.
    """

    def __init__(self, preset: str, row_levels: Optional[int] = None, **kwargs: Any) -> None:
        from lightning_gradcomp.strategies import presets

        self.preset, compressor = presets.preset_compressor(preset, kwargs, type(self).__name__, row_levels)
        if self.preset.dense_steps:
            raise ValueError(
                f"Expected a preset without dense steps under Fabric, but got {preset!r} "
                f"({self.preset.describe_dense()}: that needs the Trainer's CompressionSchedule). Fix: use "
                f"`lightning.pytorch.Trainer(strategy={preset!r})`, or one of "
                f"{[n for n, p in presets.PRESETS.items() if not p.dense_steps]} with Fabric."
            )
        self._preset_module: Optional[Module] = None
        super().__init__(**{**kwargs, "compressor": compressor})

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        self._preset_module = module  # the embeddings are found by module type when the hook state is built
        return super().setup_module(module)

    @override
    def _float_names(self, named: dict[str, torch.nn.Parameter]) -> frozenset[str]:
        from lightning_gradcomp.strategies import presets

        names = super()._float_names(named)
        if self.preset.float_embeddings and self._preset_module is not None:
            names |= presets.embedding_names(self._preset_module, named)
        return names

    @override
    def _layer_compressors(self, named: dict[str, torch.nn.Parameter]) -> dict[str, Compressor]:
        module = self._preset_module
        return {} if module is None else self.preset.embedding_compressors(module, named)


def fabric_alternatives() -> str:
    """What this package runs under Fabric, for an error's fix: the names from Fabric's registry (so a preset or a
    compressor registered later is listed too) and the classes."""
    names = registry.fabric_strategy_names()
    sharded = [n for n in names if n.startswith(registry.SHARDED_PREFIX)]
    per_step = [n for n in names if n not in sharded]
    return (
        f"Under Fabric, gradcomp runs the per-step compressors and their presets: `Fabric(strategy=<name>)` with a "
        f"name of {per_step} (or `<name>{registry.NOTEBOOK_SUFFIX}` for a notebook), or "
        f"`Fabric(strategy=GradCompFabricStrategy(...))`; sharded models: a name of {sharded} or "
        f"`ShardedGradCompFabricStrategy(...)`."
    )


def trainer_only_message(given: str, strategy_name: str, strategy_class: str) -> str:
    """The error for a Trainer-only strategy (``strategy_class``, registered as ``strategy_name``) given to Fabric as
    ``given`` (its name, or the instance's description)."""
    return (
        f"Expected `strategy` to be a strategy Fabric can run, but got {given}: {strategy_class} is "
        f"Trainer-only (it runs inside the Trainer's loop: its optimizer step, backward and checkpoint hooks, "
        f"which Fabric's loop does not call). {fabric_alternatives()} Fix: use one of those with Fabric, or "
        f"`lightning.pytorch.Trainer(strategy={strategy_name!r})` for {strategy_class}."
    )


def _trainer_only(strategy_name: str, strategy_class: str, **_: Any) -> None:
    """What Fabric's registry builds for a name of a Trainer-only strategy: an error naming what Fabric supports."""
    raise ValueError(trainer_only_message(repr(strategy_name), strategy_name, strategy_class))


def register_trainer_only_names(fabric_registry: Any) -> None:
    """Give every Trainer strategy name of this package that Fabric cannot run (a ``GradCompStrategy`` subclass
    with sites: DiLoCo, Streaming DiLoCo, WeightGrad, their ``_notebook`` variants, and DiLoCo over shards) an entry in Fabric's registry
    that raises :func:`_trainer_only`'s error when ``Fabric(strategy=name)`` is constructed, instead of Lightning's
    generic "invalid strategy name"."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_gradcomp.strategies.sharded import ShardedGradCompStrategy
    from lightning_gradcomp.strategies.strategy import GradCompStrategy

    for name, data in StrategyRegistry.items():
        cls = data["strategy"]
        # the sharded compressor names have a Fabric twin (ShardedGradCompFabricStrategy), registered before this
        # runs; the sharded DiLoCo names have none
        trainer_only = isinstance(cls, type) and issubclass(cls, (GradCompStrategy, ShardedGradCompStrategy))
        if name in fabric_registry or not trainer_only:
            continue
        fabric_registry.register(name, _trainer_only, description=f"{cls.__name__} is Trainer-only (an error under "
                                 "Fabric, naming what to use)", override=True, strategy_name=name,
                                 strategy_class=cls.__name__)
