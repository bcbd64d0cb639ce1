"""``ShardedGradCompStrategy``: FSDP2 inside a replica (a node), compressed gradient shards between replicas.

Lightning's ``ModelParallelStrategy`` with a ``("replicate", "shard")`` device mesh: the user shards the model in
``configure_model`` over ``self.device_mesh["shard"]`` (``fully_shard``, FSDP2's own dense reduce-scatter and
all-gather inside a replica), and the strategy installs :class:`~lightning_gradcomp.strategies.shards.ShardExchange` on every
FSDP2 unit, so each rank's gradient shard is averaged over the replicas through the library's hook with any
compressor. Checkpoints are Lightning's (distributed with ``torch.distributed.checkpoint`` by default) plus every
rank's compression state.

:class:`ShardedWiring` is what the Trainer strategy shares with its Fabric twin
(:class:`~lightning_gradcomp.strategies.fabric.ShardedGradCompFabricStrategy`): the mesh's shape and groups, the check that the
model is sharded over the mesh's ``"shard"`` dimension, the hook state and the exchange, and the non-finite agreement
across the shard group.
"""

import inspect
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import OptimizerCheck
from lightning_gradcomp.exchange.ledger import Ledger, joint_bytes_per_step
from lightning_gradcomp.strategies.fsdp_all_gather import QuantizedAllGather
from lightning_gradcomp.strategies.fsdp_collectives import CompressedReduceScatter, check_compressor, node_layout
from lightning_gradcomp.strategies.options import ShardedOptions, with_options
from lightning_gradcomp.strategies.resilience import ResilienceMixin
from lightning_gradcomp.strategies.shards import ShardExchange, agree_on_skip, fsdp_units
from lightning_gradcomp.sites.layout import new_group
from lightning_gradcomp.validation import UnknownOptionError, check_int, check_options
from lightning_gradcomp.strategies.wiring import HookWiring, check_backend

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_gradcomp.exchange.hook import GradCompState

log = logging.getLogger(__name__)


def new_mesh(replicas: int, shard: int, rank: int, device_type: str, timeout: Optional[timedelta]) -> "DeviceMesh":
    """The ``(replicas, shard)`` device mesh named ``("replicate", "shard")`` (rank = replica * shard + index), its
    groups made by :func:`~lightning_gradcomp.sites.layout.new_group` with the strategy's ``timeout``:
    ``init_device_mesh`` would give them torch's 30-minute default, so a stalled peer would hold the others that
    long. Every rank makes every group, in the same order."""
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.arange(replicas * shard).view(replicas, shard)
    mine: dict[str, Any] = {}
    for dim, lines in (("replicate", layout.t()), ("shard", layout)):
        for ranks in lines.tolist():
            group = new_group(ranks, timeout)
            if rank in ranks:
                mine[dim] = group
    return DeviceMesh.from_group([mine["replicate"], mine["shard"]], device_type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def mesh_shape(world_size: int, shard_size: Optional[int], ranks_per_node: int) -> tuple[int, int]:
    """The ``(replicas, shard)`` shape of the device mesh: ``shard_size`` ranks per replica (``None``: one node's).

    Raises:
        ValueError: the shard size does not divide the world size.
    """
    shard = ranks_per_node if shard_size is None else shard_size
    if world_size % shard:
        raise ValueError(
            f"Expected `shard_size` to divide the world size ({world_size} ranks), but got {shard}. Fix: use a "
            f"divisor of {world_size}, normally the ranks of one node ({ranks_per_node})."
        )
    return world_size // shard, shard


def keyword_options(cls: type) -> list[str]:
    """The keyword options ``cls.__init__`` takes (its ``**kwargs`` aside), for the unknown-option error."""
    return [n for n, p in inspect.signature(cls).parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]


def check_sharded(module: Module, shard_mesh: "DeviceMesh", where: str, mesh_name: str) -> None:
    """Refuse a model that was not sharded with FSDP2 over the mesh's ``"shard"`` dimension (its gradients would not
    reach the replica exchange). ``where`` names the user's sharding code (``configure_model``, ``parallelize_fn``)
    and ``mesh_name`` how it reads the mesh there, for the fix.

    Raises:
        ValueError: no ``fully_shard`` module, or a trainable parameter that is not a DTensor on ``shard_mesh``.
    """
    from torch.distributed.tensor import DTensor

    if not fsdp_units(module):
        raise ValueError(
            f"Expected the model to be sharded with FSDP2 in `{where}`, but got {type(module).__name__} "
            f"with no `fully_shard` module. Fix: in `{where}`, call "
            f"`fully_shard(block, mesh={mesh_name}['shard'])` for each block, then on the root module."
        )
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, DTensor) or p.device_mesh != shard_mesh:
            got = "an unsharded tensor" if not isinstance(p, DTensor) else f"a DTensor on mesh {p.device_mesh}"
            raise ValueError(
                f"Expected every trainable parameter to be sharded over `{mesh_name}['shard']`, but "
                f"`{name}` is {got}. Fix: pass `mesh={mesh_name}['shard']` to every `fully_shard` call in `{where}` "
                f"(the whole 2-D mesh would make FSDP2 all-reduce densely between replicas), and apply "
                f"`fully_shard` to the root module too."
            )


#: the DDP engine's site options: under the sharded engine a replica (``shard_size`` consecutive ranks) is the site
_SITE_OPTIONS = ("site_size", "site_sizes", "hierarchy")


def check_sharded_options(owner: str, unknown: dict[str, Any], options: Sequence[str]) -> None:
    """Refuse keyword arguments a sharded strategy does not take, naming them (instead of Python's ``TypeError``):
    a site option of the DDP engine points to ``shard_size``; any other, to the closest option
    (:func:`~lightning_gradcomp.validation.check_options`).

    Raises:
        ValueError: an unknown keyword (:class:`~lightning_gradcomp.validation.UnknownOptionError`).
    """
    for name in _SITE_OPTIONS:
        if name in unknown:
            value = unknown[name]
            if name == "site_size" and isinstance(value, int) and not isinstance(value, bool):
                fix = f"`shard_size={value}`"
            elif name == "hierarchy":
                fix = "`shard_size=None` (the default: one replica per node)"
            else:
                fix = "`shard_size=<ranks per replica>` (replicas are all the same size; None: one node's ranks)"
            raise UnknownOptionError(
                f"Expected {owner}'s replicas to be set with `shard_size` (a replica of `shard_size` consecutive "
                f"ranks is its site), but got `{name}={value!r}`, GradCompStrategy's option for its sites. "
                f"Fix: did you mean 'shard_size'? pass {fix}."
            )
    check_options(owner, unknown, options, unknown)


class ShardedWiring(HookWiring):
    """The sharded engine's side of a strategy, shared by the Trainer and the Fabric strategy: shard size, the hook
    state over the replicate group, the :class:`~lightning_gradcomp.strategies.shards.ShardExchange` on every FSDP2 unit, and
    the non-finite agreement across the shard group after backward."""

    shard_size: Optional[int]
    exchange: Optional[ShardExchange]
    #: the strategy's ``("replicate", "shard")`` mesh (``ModelParallelStrategy``'s, set in ``setup_environment``)
    _device_mesh: Optional["DeviceMesh"]
    #: the collective timeout (``ModelParallelStrategy``'s), also of the reduce-scatter's node and peer groups
    _timeout: Optional[timedelta]

    def _init_sharding(self, shard_size: Optional[int], unknown: dict[str, Any], options: Sequence[str]) -> None:
        """Validate and keep ``shard_size``; refuse ``unknown`` keyword arguments (:func:`check_sharded_options`,
        ``options``: the ones the strategy takes)."""
        check_sharded_options(type(self).__name__, unknown, options)
        if shard_size is not None:
            check_int("shard_size", shard_size, minimum=1, fix="pass the ranks of one node, e.g. 8, or None for that")
        self.shard_size = shard_size
        self.exchange = None
        self._agreed_hook_calls = 0
        # the compressed reduce-scatter across nodes (:meth:`_init_across_nodes`)
        self._across_nodes = False
        self.node_size: Optional[int] = None
        self.quantize_weights = False
        self.reduce_scatter: Optional[CompressedReduceScatter] = None
        self.weight_all_gather: Optional[QuantizedAllGather] = None

    def _init_across_nodes(self, compress_across_nodes: bool, node_size: Optional[int],
                           quantize_weights: bool = False) -> None:
        """Check the options of the compressed collectives across nodes that need no process group.

        Raises:
            ValueError: ``node_size`` or ``quantize_weights`` without ``compress_across_nodes``; a compressor that
                cannot serve the reduce-scatter.
        """
        for name, value in (("compress_across_nodes", compress_across_nodes), ("quantize_weights", quantize_weights)):
            if not isinstance(value, bool):
                raise ValueError(f"Expected `{name}` to be True or False, but got {value!r}. Fix: pass "
                                 f"`{name}=True` or leave it unset.")
        if quantize_weights and not compress_across_nodes:
            raise ValueError(
                "Expected `quantize_weights=True` only with `compress_across_nodes=True` (it quantizes FSDP2's weight "
                "all-gather between nodes, for a model sharded across nodes), but got it without. Fix: add "
                "`compress_across_nodes=True`, or drop `quantize_weights` (under HSDP the weights never cross "
                "between nodes)."
            )
        self.quantize_weights = quantize_weights
        if node_size is not None:
            check_int("node_size", node_size, minimum=1, fix="pass the ranks of one node, e.g. 8")
            if not compress_across_nodes:
                raise ValueError(
                    f"Expected `node_size` only with `compress_across_nodes=True` (it places the nodes of the "
                    f"compressed reduce-scatter), but got `node_size={node_size}` without it. Fix: add "
                    f"`compress_across_nodes=True`, or drop `node_size` (replicas are set with `shard_size`)."
                )
        self._across_nodes = compress_across_nodes
        self.node_size = node_size
        if compress_across_nodes:
            self.compressor = check_compressor(self.compressor)

    def _mesh_shape(self, world: int, ranks_per_node: int) -> tuple[int, int]:
        """``(replicas, shard_size)`` of this run on ``world`` ranks of ``ranks_per_node`` each (a ``shard_size``
        that does not divide the world fails here).

        Raises:
            ValueError: with ``compress_across_nodes``, a shard size other than the world or nodes that do not
                divide it into 2 or more.
        """
        if not self._across_nodes:
            return mesh_shape(world, self.shard_size, ranks_per_node)
        if self.shard_size not in (None, world):
            raise ValueError(
                f"Expected `shard_size` to be the world size ({world} ranks) or None with "
                f"`compress_across_nodes=True` (the model is sharded over every rank of every node), but got "
                f"{self.shard_size}. Fix: drop `shard_size`, or drop `compress_across_nodes` to compress between "
                f"replicas of {self.shard_size} ranks (HSDP)."
            )
        node = ranks_per_node if self.node_size is None else self.node_size
        if node_layout(world, node).num_sites < 2:
            raise ValueError(
                f"Expected at least 2 nodes for the compressed reduce-scatter across nodes, but got one: "
                f"`node_size={node}` on world_size={world} (devices x num_nodes), so nothing crosses a link between "
                f"nodes. Fix: pass `node_size` the ranks of one node (a divisor of {world} below it), or drop "
                f"`compress_across_nodes` on one node."
            )
        return 1, world

    def _install_reduce_scatter(self, module: Module, state: "GradCompState", ranks_per_node: int) -> None:
        """With ``compress_across_nodes``: the compressed reduce-scatter on every FSDP2 unit, its residuals in
        every rank's checkpoint state (``state.extra``); with ``quantize_weights`` too, the quantized weight
        all-gather. After the replica exchange, whose hook (the non-finite
        guard alone, one replica) then checks what this reduce-scatter delivered to each rank's shard."""
        if not self._across_nodes:
            return
        node = ranks_per_node if self.node_size is None else self.node_size
        self.reduce_scatter = CompressedReduceScatter(module, node, self.compressor, timeout=self._timeout)
        state.attach("reduce_scatter", self.reduce_scatter)
        if self.quantize_weights:  # over the reduce-scatter's node and peer groups
            self.weight_all_gather = QuantizedAllGather(module, node, timeout=self._timeout,
                                                        groups=self.reduce_scatter.groups)

    def _rollback_skipped(self) -> None:
        """After the agreement on a skipped step: the reduce-scatter's residuals carry that step's gradient on as if
        it were never sent."""
        state = self.comm_state
        if self.reduce_scatter is not None and state is not None and state.guard.step_nonfinite:
            self.reduce_scatter.rollback()

    def _node_ledgers(self) -> list[Ledger]:
        """The ledgers of the collectives across nodes: the reduce-scatter's, and the weight all-gather's."""
        return [c.ledger for c in (self.reduce_scatter, self.weight_all_gather) if c is not None]

    @override
    def bytes_per_step(self) -> int:
        if self.reduce_scatter is not None:  # between nodes (the replica exchange sends nothing with one replica)
            return joint_bytes_per_step(self._node_ledgers())
        return super().bytes_per_step()

    @override
    def last_step_bytes(self) -> int:
        if self.reduce_scatter is not None:
            return sum(ledger.last_step_bytes() for ledger in self._node_ledgers())
        return super().last_step_bytes()

    @override
    def dense_bytes_per_step(self) -> float:
        if self.reduce_scatter is not None:  # the same collectives between nodes in fp32
            return sum(ledger.dense_bytes_per_step() for ledger in self._node_ledgers())
        return super().dense_bytes_per_step()

    def _install_exchange(self, module: Module, mesh: "DeviceMesh", rank: int, device: torch.device, where: str,
                          mesh_name: str) -> "GradCompState":
        """Check that ``module`` is sharded over ``mesh["shard"]``, build the hook state over ``mesh["replicate"]``
        and install the exchange on every FSDP2 unit (rank 0 logs what runs). Returns the hook state, also kept as
        ``comm_state``."""
        check_sharded(module, mesh["shard"], where, mesh_name)
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        replicate = mesh["replicate"]
        if replicate.size() == 1:
            self._check_one_replica(mesh["shard"].size())
        state = self._new_comm_state(
            named, replicate.get_group(), rank, replicate.size(), device, group_rank=replicate.get_local_rank(),
        )
        self.comm_state = state
        self.exchange = ShardExchange(state, module)
        self._agreed_hook_calls = state.ledger.hook_calls
        if rank == 0 and replicate.size() == 1 and self._across_nodes:
            log.info("gradcomp: FSDP2 over %d ranks, its gradient reduce-scatter dense inside a node and %s between "
                     "nodes", mesh["shard"].size(), type(self.compressor).__name__)
        elif rank == 0 and replicate.size() == 1:
            log.info("gradcomp: FSDP2 over %d ranks in one replica: nothing is exchanged between replicas, %s is not "
                     "used (plain FSDP2, 0 bytes per rank per step)", mesh["shard"].size(),
                     type(self.compressor).__name__)
        elif rank == 0:
            log.info(
                "gradcomp: FSDP2 over %d ranks per replica, %s between %d replicas on each rank's gradient shard "
                "(%s fp32 bytes per rank per step for dense HSDP)",
                mesh["shard"].size(), type(self.compressor).__name__, replicate.size(),
                f"{self.exchange.shard_bytes():,}",
            )
        return state

    def _check_one_replica(self, world: int) -> None:
        """One replica of all ``world`` ranks exchanges nothing (:func:`~lightning_gradcomp.strategies.shards.guard_shard`):
        warn on rank 0 that the compressor is not used, naming the ``shard_size`` that gives replicas to compress
        between; refuse gradient transforms, which run in that exchange (MomentumCorrection's momentum would be
        lost without a word).

        Raises:
            ValueError: a gradient transform is attached (by a callback such as ``MomentumCorrection``).
        """
        if world == 1:
            fix = "use `devices=2` or more (CPU ranks are fine) with `shard_size=1`"
        else:
            # the largest shard size that still gives 2 replicas or more: each rank's share of the model grows least
            smaller = world // next(k for k in range(2, world + 1) if world % k == 0)
            fix = (f"pass `shard_size={smaller}` or a smaller divisor of {world} ({world // smaller} replicas or more "
                   f"that compress between them; on several nodes, `shard_size=world_size // num_nodes`)")
        if self.transforms:
            raise ValueError(
                f"Expected no gradient transforms with one replica under {type(self).__name__} (they run in the "
                f"exchange between replicas, which one replica skips: nothing would apply them), but got "
                f"{[type(t).__name__ for t in self.transforms]} with `shard_size={world}` on world_size={world}. "
                f"Fix: {fix}, or drop the callbacks that add them (without compression, MomentumCorrection(m) with "
                f"SGD(momentum=0) is SGD(momentum=m))."
            )
        if self._across_nodes:  # the compressor runs in the reduce-scatter between nodes
            return
        rank_zero_warn(
            f"Expected at least 2 replicas for {type(self).__name__} to exchange compressed gradient shards, but got "
            f"1: `shard_size={world}` ranks per replica on world_size={world} (devices x num_nodes), so nothing "
            f"crosses a link between replicas. {type(self.compressor).__name__} is not used: the run is plain FSDP2 "
            f"over {world} rank{'s' if world > 1 else ''} (as `sharded_fp32` or stock FSDP2) and `bytes_per_step()` is 0. Fix: {fix}, or use "
            f"Lightning's `ModelParallelStrategy` for FSDP2 without compression.",
            category=UserWarning,
        )

    def _check_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The compressor's check of the optimizers before the first step (e.g. DeMo's sign step, OneBit's
        momentum), as the DDP engine runs it; not with one replica, where no compressor runs, unless it runs in the
        reduce-scatter across nodes."""
        assert self._device_mesh is not None, "the mesh exists from setup_environment on"
        if (self._device_mesh["replicate"].size() > 1 or self._across_nodes) and isinstance(self.compressor, OptimizerCheck):
            self.compressor.check_optimizers(optimizers)

    def _shard_group_size(self) -> int:
        assert self._device_mesh is not None, "the mesh exists from setup_environment on"
        return self._device_mesh["shard"].size()

    @override
    def _checkpoint_shard_size(self) -> Optional[int]:
        # the live mesh's: the compression state is per shard (refused on resume with another shard size)
        return self._shard_group_size()

    @override
    def _replica_sets(self) -> Optional[list[list[int]]]:
        # the ranks holding the same shard: rank = replica * shard_size + shard index (the mesh's row order)
        assert self._device_mesh is not None
        size, world = self._shard_group_size(), self._device_mesh.size()
        return [list(range(s, world, size)) for s in range(size)]

    @override
    def _replica_scope(self, sets: Optional[list[list[int]]]) -> str:
        return "each rank's shard must be identical in every replica"

    def _agree_on_skip(self, mesh: "DeviceMesh", device: torch.device) -> None:
        """After a backward that ran the exchange, spread a step skipped on one shard to every rank of the model
        (:func:`~lightning_gradcomp.strategies.shards.agree_on_skip`); a backward without it (gradient accumulation) issues
        nothing. Every rank runs the same backwards, so every rank issues the same collectives."""
        state = self.comm_state
        if state is None or state.ledger.hook_calls == self._agreed_hook_calls:
            return
        self._agreed_hook_calls = state.ledger.hook_calls
        agree_on_skip(state, mesh.get_group("shard"), device)
        self._rollback_skipped()


class ShardedGradCompStrategy(ResilienceMixin, ShardedWiring, ModelParallelStrategy):
    """Sharded data parallelism (FSDP2) with a compressed exchange of gradient shards between replicas.

    The world is a ``(world_size // shard_size, shard_size)`` device mesh named ``("replicate", "shard")``. Shard the
    model in ``LightningModule.configure_model`` with ``fully_shard(module, mesh=self.device_mesh["shard"])`` (each
    block, then the root): inside a replica FSDP2 reduce-scatters and all-gathers densely; between replicas each
    rank's shard travels through ``compressor``, with error feedback on the shard (the residuals are sharded too).

    Args:
        options: every option of :class:`~lightning_gradcomp.strategies.options.ShardedOptions`, each a named
            parameter (``ShardedGradCompStrategy(compressor="int8", shard_size=8)``).
        **kwargs: refused with the option named (a misspelt option, or the DDP engine's ``site_size``), as a
            ``ValueError``.
    """

    strategy_name = "sharded_gradcomp"

    @with_options(ShardedOptions)
    def __init__(self, options: ShardedOptions, **kwargs: Any) -> None:
        self._init_sharding(options.shard_size, kwargs, keyword_options(ShardedGradCompStrategy))
        self._init_resilience(options)
        self._init_wiring(options)
        self._init_across_nodes(options.compress_across_nodes, options.node_size, options.quantize_weights)
        super().__init__(
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
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # read in configure_model

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank trains on its own data, as in DDP: sharding splits the model, not the batch
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        check_sharded(module, self.device_mesh["shard"], "configure_model", "self.device_mesh")
        self._on_sharded({n: p for n, p in module.named_parameters() if p.requires_grad})

    def _on_sharded(self, named: dict[str, torch.nn.Parameter]) -> None:
        """Once the model is sharded and checked: build the hook state and install the exchange between replicas
        on every FSDP2 unit (a subclass with another exchange, e.g. DiLoCo's outer rounds, replaces this)."""
        module = self.lightning_module
        assert module is not None
        state = self._install_exchange(module, self.device_mesh, self.global_rank, self.root_device,
                                       "configure_model", "self.device_mesh")
        self._install_reduce_scatter(module, state, self.num_processes)
        self._attach_resilience(state)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        self._check_optimizers(self.optimizers)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self._agree_on_skip(self.device_mesh, self.root_device)
        super().post_backward(closure_loss)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        registry.register_strategies(cls, strategy_registry, prefix=registry.SHARDED_PREFIX, notebook=False)
