"""``ShardedGradCompStrategy``: FSDP2 inside a replica (a node), compressed gradient shards between replicas.

Lightning's ``ModelParallelStrategy`` with a ``("replicate", "shard")`` device mesh: the user shards the model in
``configure_model`` over ``self.device_mesh["shard"]`` (``fully_shard``, FSDP2's own dense reduce-scatter and
all-gather inside a replica), and the strategy installs :class:`~lightning_gradcomp.shards.ShardExchange` on every
FSDP2 unit, so each rank's gradient shard is averaged over the replicas through the library's hook with any
compressor. Checkpoints are Lightning's (distributed with ``torch.distributed.checkpoint`` by default) plus every
rank's compression state.
"""

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.guard import NonFinite
from lightning_gradcomp.resilience import ResilienceMixin, ResumeCompression
from lightning_gradcomp.shards import ShardExchange, agree_on_skip, fsdp_units
from lightning_gradcomp.sites import new_group
from lightning_gradcomp.validation import check_int
from lightning_gradcomp.wiring import HookWiring, check_backend

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


def _new_mesh(replicas: int, shard: int, rank: int, device_type: str, timeout: Optional[timedelta]) -> "DeviceMesh":
    """The ``(replicas, shard)`` device mesh named ``("replicate", "shard")`` (rank = replica * shard + index), its
    groups made by :func:`~lightning_gradcomp.sites.new_group` with the strategy's ``timeout``:
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


class ShardedGradCompStrategy(ResilienceMixin, HookWiring, ModelParallelStrategy):
    """Sharded data parallelism (FSDP2) with a compressed exchange of gradient shards between replicas.

    The world is a ``(world_size // shard_size, shard_size)`` device mesh named ``("replicate", "shard")``. Shard the
    model in ``LightningModule.configure_model`` with ``fully_shard(module, mesh=self.device_mesh["shard"])`` (each
    block, then the root): inside a replica FSDP2 reduce-scatters and all-gathers densely; between replicas each
    rank's shard travels through ``compressor``, with error feedback on the shard (the residuals are sharded too).

    Args:
        compressor: a :class:`~lightning_gradcomp.compressors.Compressor` or a registered name. It compresses each
            parameter's shard as a tensor of the shard's shape (see ``docs/sharded.md`` for what that changes).
        shard_size: ranks that shard one replica of the model (consecutive ranks, normally one node's GPUs);
            ``None``: the ranks of one node. Must divide the world size.
        exclude: parameter-name patterns sent uncompressed in fp32 (as in ``GradCompStrategy``).
        min_numel: parameters with fewer elements (whole tensor) are sent uncompressed.
        pipeline_mb: MiB per pipelined group inside one unit's shard (``None``: one group per unit).
        check_replicas_every: every k optimizer steps, compare every rank's shard with the ranks holding the same
            shard in the other replicas (0: never).
        nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"`` a NaN/Inf gradient; a skip on one shard skips the step on
            every rank.
        resume_compression: ``"exact"`` restores every rank's compression state from the checkpoint, ``"reset"``
            starts it afresh.
        save_distributed_checkpoint: as in ``ModelParallelStrategy`` (each rank writes its shards).
        process_group_backend: ``"gloo"``, ``"nccl"``, or ``None`` for the device's default.
        timeout: collective timeout (a positive ``timedelta``).
    """

    strategy_name = "sharded_gradcomp"

    def __init__(
        self,
        compressor: Union[Compressor, str] = "terngrad",
        shard_size: Optional[int] = None,
        exclude: Optional[Sequence[str]] = None,
        min_numel: int = 1,
        pipeline_mb: Optional[float] = 8.0,
        check_replicas_every: int = 0,
        nonfinite: NonFinite = "skip",
        resume_compression: ResumeCompression = "exact",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        self._init_resilience(check_replicas_every, nonfinite, resume_compression, timeout)
        self._init_wiring(compressor, exclude, min_numel, pipeline_mb, None, None, {}, {}, None, process_group_backend)
        if shard_size is not None:
            check_int("shard_size", shard_size, minimum=1, fix="pass the ranks of one node, e.g. 8, or None for that")
        self.shard_size = shard_size
        self.exchange: Optional[ShardExchange] = None
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def _mesh_shape(self) -> tuple[int, int]:
        world = self.num_nodes * self.num_processes
        shard = self.num_processes if self.shard_size is None else self.shard_size
        if world % shard:
            raise ValueError(
                f"Expected `shard_size` to divide the world size ({world} ranks), but got {shard}. Fix: use a divisor "
                f"of {world}, normally the ranks of one node ({self.num_processes})."
            )
        return world // shard, shard

    @override
    def setup_environment(self) -> None:
        check_backend(self._process_group_backend, self.root_device)
        replicas, shard = self._mesh_shape()  # before any process group exists
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self._device_mesh = _new_mesh(replicas, shard, self.global_rank, self.root_device.type, self._timeout)
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
        self._check_sharded(module)
        self._on_sharded({n: p for n, p in module.named_parameters() if p.requires_grad})

    def _on_sharded(self, named: dict[str, torch.nn.Parameter]) -> None:
        """Once the model is sharded and checked: build the hook state and install the exchange between replicas
        on every FSDP2 unit (a subclass with another exchange, e.g. DiLoCo's outer rounds, replaces this)."""
        module = self.lightning_module
        assert module is not None
        mesh = self.device_mesh
        replicate = mesh["replicate"]
        self.comm_state = self._new_comm_state(
            named, replicate.get_group(), self.global_rank, replicate.size(), self.root_device,
            group_rank=replicate.get_local_rank(),
        )
        self.exchange = ShardExchange(self.comm_state, module)
        self._attach_resilience(self.comm_state)
        if self.global_rank == 0:
            log.info(
                "gradcomp: FSDP2 over %d ranks per replica, %s between %d replicas on each rank's gradient shard "
                "(%s fp32 bytes per rank per step for dense HSDP)",
                mesh["shard"].size(), type(self.compressor).__name__, replicate.size(),
                f"{self.exchange.shard_bytes():,}",
            )

    def _check_sharded(self, module: Module) -> None:
        """Refuse a model that ``configure_model`` did not shard over the mesh's ``"shard"`` dimension (its gradients
        would not reach the replica exchange)."""
        from torch.distributed.tensor import DTensor

        shard_mesh = self.device_mesh["shard"]
        if not fsdp_units(module):
            raise ValueError(
                f"Expected the model to be sharded with FSDP2 in `configure_model`, but got {type(module).__name__} "
                f"with no `fully_shard` module. Fix: in `configure_model`, call "
                f"`fully_shard(block, mesh=self.device_mesh['shard'])` for each block, then on the root module."
            )
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if not isinstance(p, DTensor) or p.device_mesh != shard_mesh:
                got = "an unsharded tensor" if not isinstance(p, DTensor) else f"a DTensor on mesh {p.device_mesh}"
                raise ValueError(
                    f"Expected every trainable parameter to be sharded over `self.device_mesh['shard']`, but "
                    f"`{name}` is {got}. Fix: pass `mesh=self.device_mesh['shard']` to every `fully_shard` call "
                    f"(the whole 2-D mesh would make FSDP2 all-reduce densely between replicas), and apply "
                    f"`fully_shard` to the root module too."
                )

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.comm_state is not None and self.comm_state.ledger.hook_calls:
            agree_on_skip(self.comm_state, self.device_mesh.get_group("shard"), self.root_device)
        super().post_backward(closure_loss)

    @override
    def _replica_sets(self) -> Optional[list[list[int]]]:
        # the ranks holding the same shard: rank = replica * shard_size + shard index (the mesh's row order)
        size = self.device_mesh["shard"].size()
        return [list(range(s, self.world_size, size)) for s in range(size)]

    @override
    def _replica_scope(self, sets: Optional[list[list[int]]]) -> str:
        return "each rank's shard must be identical in every replica"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        registry.register_strategies(cls, strategy_registry, prefix=registry.SHARDED_PREFIX, notebook=False)
