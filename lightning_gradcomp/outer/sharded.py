"""``ShardedDiLoCoStrategy`` (``strategy="sharded_diloco"``, ``"sharded_streaming_diloco"``): DiLoCo over FSDP2 sites.

A site is one replica of :class:`~lightning_gradcomp.ShardedGradCompStrategy`'s ``("replicate", "shard")`` device
mesh: its ranks shard the model with FSDP2 (``fully_shard(..., mesh=self.device_mesh["shard"])`` in
``configure_model``), and an inner step is FSDP2's own: a dense reduce-scatter and all-gather among the site's ranks,
nothing between sites, no compression. Every ``sync_every`` steps the outer round of :class:`DiLoCoStrategy` runs on
each rank's shard: the shard's pseudo-gradient ``anchor - theta`` is averaged, compressed, with the ranks holding
the same shard in the other sites (the mesh's replicate group), and the outer optimizer steps the anchor's shard.
So the global weights, the outer momentum and the outer error feedback are sharded as the model is.

Reused, not copied: the engine (:class:`~lightning_gradcomp.outer.engine.OuterSync`), the exchange
(:class:`~lightning_gradcomp.outer.exchange.LeaderExchange` with ``sharded=True``: every rank sends its own shard
through the hook's pipeline, its ledger counting the bytes), the outer options, final round and statistics
(:class:`~lightning_gradcomp.outer.strategy.OuterRounds`), the mesh, its groups and the FSDP2 checks
(:class:`~lightning_gradcomp.ShardedGradCompStrategy`), the replica check after a round and the per-rank checkpoint
state (:class:`~lightning_gradcomp.strategies.resilience.ResilienceMixin`).

Why the engine works on plain local tensors (``DTensor.to_local()``) and not on ``DTensor`` parameters: everything in
an outer round is elementwise (the pseudo-gradient, the outer SGD step, mixing) or goes through the hook, which
takes plain tensors, so each rank does its shard's part alone; the outer state then holds plain tensors, which the
per-rank checkpoint stores as they are.
"""

import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import Tensor, nn
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.outer.exchange import LeaderExchange
from lightning_gradcomp.outer.fragments import strided_fragments
from lightning_gradcomp.outer.strategy import STREAMING_DESCRIPTION, STREAMING_PRESET, OuterRounds, warn_one_site
from lightning_gradcomp.strategies.resilience import ResumeCompression
from lightning_gradcomp.strategies.sharded import ShardedGradCompStrategy
from lightning_gradcomp.sites.layout import SiteGroups, SiteLayout
from lightning_gradcomp.exchange.ledger import dense_bytes

log = logging.getLogger(__name__)


class LocalShards(Mapping[str, Tensor]):
    """Each sharded parameter's local shard by name, looked up at every access (``DTensor.to_local()``, a view of
    the parameter's own storage, so writes reach the parameter). Not kept from setup: FSDP2 may replace a
    parameter's local tensor at its lazy initialization (it re-pads an uneven shard), which a kept reference would
    no longer see."""

    def __init__(self, params: Mapping[str, nn.Parameter]) -> None:
        self._params = dict(params)

    def __getitem__(self, name: str) -> Tensor:
        with torch.no_grad():  # under autograd, to_local() would return a differentiable copy's view
            return self._params[name].to_local()  # type: ignore[attr-defined]  # a DTensor (checked at setup)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def start_shards_from_site0(shards: Mapping[str, Tensor], buffers: Sequence[Tensor],
                            replicate_group: Optional[dist.ProcessGroup], site0_rank: int) -> None:
    """Every site starts from site 0's weights: each rank's shard from the rank holding it in site 0 (``site0_rank``,
    over the replicate group), the buffers (whole on every rank under FSDP2) from global rank 0. Collective: every
    rank calls it, in the same order. FSDP2 itself copies nothing between ranks at setup."""
    with torch.no_grad():
        for name in shards:
            shard = shards[name]
            if shard.numel():  # the same shape on every rank of the group: all skip an empty shard together
                dist.broadcast(shard, src=site0_rank, group=replicate_group)
        for buffer in buffers:
            dist.broadcast(buffer, src=0)


class ShardedDiLoCoStrategy(OuterRounds, ShardedGradCompStrategy):
    """DiLoCo and Streaming DiLoCo over a model sharded with FSDP2 inside each site (see the module docstring).

    Shard the model in ``configure_model`` as for :class:`~lightning_gradcomp.ShardedGradCompStrategy`. A site is
    ``shard_size`` consecutive ranks (normally a node); inside it FSDP2 trains one replica, between sites only the
    outer rounds talk, each rank sending its own shard.

    Args:
        sync_every: H, inner steps between two outer syncs of a fragment.
        compressor: what encodes each rank's shard of the pseudo-gradients between sites (a registered name or a
            ``Compressor``; ``"fp32"``: dense DiLoCo). Per-tensor statistics become per-shard statistics, as under
            ``ShardedGradCompStrategy`` (``docs/sharded.md``).
        outer_optimizer: the outer optimizer class (or dotted path / short name).
        outer_lr: the outer learning rate (DiLoCo: 0.7).
        outer_momentum: momentum of an SGD outer optimizer (DiLoCo: 0.9).
        outer_nesterov: Nesterov momentum for an SGD outer optimizer (DiLoCo: True).
        outer_kwargs: further keyword arguments of the outer optimizer.
        shard_size: ranks per site, which shard its model (consecutive ranks, normally one node's GPUs); ``None``:
            the ranks of one node. Must divide the world size.
        fragments: P, strided groups of layers synced at staggered steps (1: DiLoCo).
        sync_delay: tau, inner steps a fragment's exchange overlaps before it is applied (0: blocking).
        mixing: alpha, the share of a site's own weights kept when a fragment is applied (0: the global weights).
        outer_state_device: where the anchor's shard, the outer optimizer's state and the outer error feedback live:
            ``None`` beside the parameters, ``"cpu"`` off the accelerator.
        error_decay: beta of the outer error feedback, for compressors that use it.
        exclude: parameter-name patterns whose pseudo-gradients cross between sites uncompressed (fp32).
        min_numel: parameters with fewer elements (whole tensor) cross uncompressed.
        check_replicas_every: with k > 0, right after every outer round compare each rank's shard with its copies in
            the other sites (between rounds the sites differ by design, and a site's ranks hold different shards).
        resume_compression: ``"exact"`` restores every rank's outer state (anchor, momentum, error feedback, the
            site's weights and inner optimizer state) from the checkpoint; ``"reset"`` starts it afresh.
        save_distributed_checkpoint: as in ``ModelParallelStrategy`` (each rank writes its shards).
        process_group_backend: ``"gloo"``, ``"nccl"``, or ``None`` for the device's default.
        timeout: collective timeout (a positive ``timedelta``).
    """

    strategy_name = "sharded_diloco"
    # sites step their inner optimizers apart between rounds: each rank keeps its own shard of AdamW's moments
    per_rank_optimizer_state = True
    # inner steps are FSDP2's own: the hook state only carries the per-rank checkpoint state
    hook_every_step = False
    outer_senders = "of each rank's shard (rank 0's shard)"

    def __init__(
        self,
        sync_every: int = 100,
        compressor: Union[Compressor, str] = "fp32",
        outer_optimizer: Union[str, type] = "torch.optim.SGD",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        outer_kwargs: Optional[dict[str, Any]] = None,
        shard_size: Optional[int] = None,
        fragments: int = 1,
        sync_delay: int = 0,
        mixing: float = 0.0,
        outer_state_device: Optional[Literal["cpu"]] = None,
        error_decay: float = 0.95,
        exclude: Optional[Sequence[str]] = None,
        min_numel: int = 1,
        check_replicas_every: int = 0,
        resume_compression: ResumeCompression = "exact",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        self._init_outer(sync_every, compressor, outer_optimizer, outer_lr, outer_momentum, outer_nesterov,
                         outer_kwargs, fragments, sync_delay, mixing, outer_state_device, error_decay)
        # the inner steps run no hook: an identity state, never called, holds the per-rank checkpoint state; a
        # non-finite inner gradient reaches the site's weights and stops every site at the next round
        super().__init__(
            compressor="fp32", shard_size=shard_size, exclude=exclude, min_numel=min_numel, pipeline_mb=None,
            check_replicas_every=check_replicas_every, nonfinite="ignore", resume_compression=resume_compression,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.groups: Optional[SiteGroups] = None

    @override
    def setup_environment(self) -> None:
        # a shard_size that does not divide the world fails here, first
        replicas, shard = self._mesh_shape(self.num_nodes * self.num_processes, self.num_processes)
        if replicas == 1:
            where = "it runs on one device" if shard == 1 else f"its {shard} ranks form one site (shard_size={shard})"
            warn_one_site(where, self.outer_optimizer_class, self.sync_every, "pass a smaller `shard_size`")
        super().setup_environment()

    @override
    def _on_sharded(self, named: dict[str, nn.Parameter]) -> None:
        module = self.lightning_module
        assert module is not None
        if self.transforms:
            raise ValueError(
                f"Expected no gradient transforms under {type(self).__name__} (its inner steps are FSDP2's own, with "
                f"no hook to run them), but got {[type(t).__name__ for t in self.transforms]}. Fix: drop the "
                f"callbacks that add them, or use ShardedGradCompStrategy for a per-step exchange with transforms."
            )
        mesh = self.device_mesh
        replicate, shard = mesh["replicate"], mesh["shard"]
        sites, size, rank = replicate.size(), shard.size(), self.global_rank
        # the mesh's groups are the sites' (made by `sites.new_group` in `_new_mesh`): a site is a row, its leader
        # the rank holding shard 0, the leaders' group that shard's replicate group (buffers go through it)
        self.groups = SiteGroups(SiteLayout((size,) * sites), rank, rank // size, shard.get_group(),
                                 replicate.get_group() if rank % size == 0 else None)
        fragments = strided_fragments(list(named), self.num_fragments)  # fragments > layers fails here, before step 1
        shards = LocalShards(named)
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        start_shards_from_site0(shards, list(module.buffers()), replicate.get_group(), rank % size)
        self.comm_state = self._new_comm_state(named, None, rank, 1, self.root_device)
        # seeded by the global rank, as ShardedGradCompStrategy's exchange: each shard has its own random stream
        outer_state = self._outer_hook_state(named, self.comm_state.float_names, replicate.get_group(), sites, rank)
        shapes = {n: shards[n].shape for n in named}
        exchange = LeaderExchange(outer_state, self.groups, fragments, named, self.root_device, shapes=shapes,
                                  sharded=True)
        self._start_outer(shards, buffers, self.groups, exchange, fragments)
        self._attach_resilience(self.comm_state)  # the per-rank optimizer state, a pending checkpoint restore
        if rank == 0:
            log.info("diloco: FSDP2 over the %d ranks of each of %d sites: inner steps are FSDP2's own (dense, inside "
                     "the site); between sites each rank sends its own shard of the pseudo-gradients", size, sites)
            self._announce_outer(shapes, self.comm_state.float_names, sites)

    @override
    def _replica_sets(self) -> Optional[list[list[int]]]:
        # between rounds no two ranks hold the same tensors: a site's ranks hold different shards, sites step apart
        return [[r] for r in range(self.world_size)]

    @override
    def _round_sets(self) -> Optional[list[list[int]]]:
        # right after a round: each shard in every site (rank = site * shard_size + shard index)
        return ShardedGradCompStrategy._replica_sets(self)

    @override
    def dense_bytes_per_step(self) -> float:
        """What dense HSDP would send per rank and step between sites: the fp32 bytes of this rank's shards
        (``bytes_per_step``'s reference, for the progress bar's ``comp_ratio``); 0 before setup."""
        if self.outer is None:
            return 0
        return sum(dense_bytes(self.outer.params[n].numel()) for n in self.outer.params)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry)


def register(strategy_registry: Any = None) -> None:
    """Register ``"sharded_diloco"`` and ``"sharded_streaming_diloco"`` (no ``*_notebook`` variants: the sharded
    strategies launch no processes of their own)."""
    registry.register_preset(
        "sharded_diloco", ShardedDiLoCoStrategy,
        "DiLoCo over FSDP2 sites: H local FSDP2 steps per site, each rank's pseudo-gradient shard averaged between sites",
        strategy_registry, notebook=False,
    )
    registry.register_preset("sharded_streaming_diloco", ShardedDiLoCoStrategy, f"{STREAMING_DESCRIPTION}, over FSDP2 "
                             "sites", strategy_registry, notebook=False, **STREAMING_PRESET)
