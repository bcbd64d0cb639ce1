"""The hook's wiring shared by the Trainer strategy and the Fabric strategy: options, transforms, hook state.

:class:`~lightning_gradcomp.GradCompStrategy` (``lightning.pytorch``) and
:class:`~lightning_gradcomp.strategies.fabric.GradCompFabricStrategy` (``lightning.fabric``) derive from two unrelated
``DDPStrategy`` classes; both mix in :class:`HookWiring`, so the options are validated, the layer transforms
attached, the :class:`~lightning_gradcomp.exchange.hook.GradCompState` built (flat or hierarchical) and the exchange's layout
described (sites, shard size, the sets of ranks that hold the same parameters) by one implementation. The per-rank
state around the hook state (checkpoint, non-finite steps, replica check) is :class:`~lightning_gradcomp.strategies._runtime.Runtime`.
"""

import copy
import fnmatch
import inspect
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

import lightning_gradcomp.registry as registry
from lightning_gradcomp.strategies._runtime import Runtime
from lightning_gradcomp.strategies.options import DDPOptions, ExchangeOptions
from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.sites.hierarchy import HierarchySpec, hierarchical_hook, hierarchy_spec, new_site_exchange
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.exchange.planner import CollectivePlanner
from lightning_gradcomp.validation import check_bool, check_int, check_number
from lightning_gradcomp.exchange.ledger import dense_bytes

# DDPStrategy arguments that would replace or bypass our hook; jsonargparse passes them as explicit None
_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "output_device",
    "process_group",
}
# DDP options that take a bool: a string such as "false" is truthy and would silently switch them on
_DDP_SIGNATURE = inspect.signature(DistributedDataParallel.__init__).parameters
_DDP_BOOL_OPTIONS = frozenset(n for n, p in _DDP_SIGNATURE.items() if isinstance(p.default, bool))

log = logging.getLogger("lightning_gradcomp.strategies.strategy")  # the setup line's logger, whichever strategy writes it


def check_ddp_options(options: dict[str, Any], bucket_cap_mb: Any, backend: Any) -> None:
    """Refuse DDP options DDP itself would accept wrongly (truthy strings) or only fail on deep inside.

    Raises:
        ValueError: a bool option that is not a bool, a ``bucket_cap_mb`` that is not a positive number, or a
            ``process_group_backend`` that is not a name.
    """
    for name, value in options.items():
        if name in _DDP_BOOL_OPTIONS or (value is not None and name in ("broadcast_buffers", "forward_sync_buffers")):
            check_bool(name, value)
    if bucket_cap_mb is not None:
        check_number("bucket_cap_mb", bucket_cap_mb, minimum=0, min_open=True,
                     fix="pass a positive size in MiB, e.g. 25 (DDP's default), or None for DDP's default")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(
            f"Expected `process_group_backend` to be a backend name or None, but got {backend!r}. "
            f"Fix: use 'gloo' on CPU, 'nccl' on CUDA, or None for the device's default."
        )


def check_backend(backend: Optional[str], device: torch.device) -> None:
    """Refuse NCCL on a non-CUDA device (or without NCCL) before any process group exists.

    Raises:
        ValueError: ``backend`` is ``"nccl"`` but the device is not CUDA or this torch has no NCCL.
    """
    if backend == "nccl" and (device.type != "cuda" or not torch.distributed.is_nccl_available()):
        raise ValueError(
            f"Expected `process_group_backend` to name a backend this run can use on {device.type}, but got "
            f"'nccl' (NCCL needs CUDA devices and a torch built with NCCL). Fix: use "
            f"`process_group_backend='gloo'` on CPU, or None for the device's default."
        )


def select_float_names(named: dict[str, torch.nn.Parameter], exclude: Sequence[str], min_numel: int) -> frozenset[str]:
    """Names of the parameters sent uncompressed: those matching an ``exclude`` glob or below ``min_numel``.

    Raises:
        ValueError: a pattern matches no parameter (a typo would otherwise silently compress everything).
    """
    chosen: set[str] = set()
    for pattern in exclude:
        matched = {n for n in named if fnmatch.fnmatchcase(n, pattern)}
        if not matched:
            raise ValueError(
                f"Expected every `exclude` pattern to match a parameter, but {pattern!r} matches none. "
                f"Fix: use fnmatch globs over these names: {sorted(named)}."
            )
        chosen |= matched
    chosen |= {n for n, p in named.items() if p.numel() < min_numel}
    return frozenset(chosen)


class HookWiring:
    """Compression options, layer transforms and hook installation for a DDP strategy (Trainer or Fabric)."""

    compressor: Compressor
    exclude: list[str]
    min_numel: int
    pipeline_mb: Optional[float]
    planner: Optional[CollectivePlanner]
    comm_state: Optional[GradCompState]
    #: the hierarchical exchange's sites (``None``: flat), set by :meth:`_init_wiring`
    hierarchy: Optional[HierarchySpec]
    #: the per-rank runtime, made by the front-end's mixin (ResilienceMixin, FabricRecovery) in its constructor
    _runtime: Runtime

    def _init_wiring(self, options: ExchangeOptions, ddp_kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Validate and keep the compression options and, with :class:`DDPOptions`, DDP's (``ddp_kwargs``: the
        further ``DistributedDataParallel`` options), the collective planner's and the hierarchical exchange's;
        returns ``ddp_kwargs`` without the hook arguments set to ``None``."""
        ddp = options if isinstance(options, DDPOptions) else None
        ddp_kwargs = dict(ddp_kwargs or {})
        for key in _HOOK_ARGUMENTS:
            value = ddp_kwargs.pop(key, None)
            if value is not None:
                raise ValueError(
                    f"Expected `{key}` to be None ({type(self).__name__} installs its own communication hook), but got "
                    f"{value!r}. "
                    f"Fix: use `strategy='ddp'` for a custom DDP hook, or a Compressor for custom compression."
                )
        unknown = sorted(set(ddp_kwargs) - _DDP_OPTIONS)
        if unknown:
            raise ValueError(
                f"Unknown option(s) {unknown} for {type(self).__name__}. Fix: compressor options go to the compressor, "
                f"e.g. `GradCompStrategy(compressor=TernGrad(clip_factor=2.5))`; DDP options are "
                f"{sorted(_DDP_OPTIONS)}."
            )
        flags = {} if ddp is None else ddp.ddp_flags()
        check_ddp_options({**flags, **ddp_kwargs}, None if ddp is None else ddp.bucket_cap_mb,
                          options.process_group_backend)
        self.compressor = registry.resolve_compressor(options.compressor)
        exclude, min_numel, pipeline_mb = options.exclude, options.min_numel, options.pipeline_mb
        if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude or ()):
            raise ValueError(
                f"Expected `exclude` to be a list of parameter-name patterns, but got {exclude!r}. "
                f"Fix: wrap a single pattern in a list, e.g. `exclude=['classifier.*']`."
            )
        self.exclude = list(exclude or [])
        check_int("min_numel", min_numel, minimum=1, fix="use 1 to compress every parameter")
        self.min_numel = min_numel
        if pipeline_mb is not None:
            check_number("pipeline_mb", pipeline_mb, minimum=0, min_open=True,
                         fix="pass a positive size in MiB, or None for one group per bucket")
        self.pipeline_mb = pipeline_mb
        # parsed now so a bad spec fails before any process group exists
        self.planner = None if ddp is None or ddp.link is None else CollectivePlanner(ddp.link, ddp.compression_cost)
        self._transforms: list[LayerTransform] = []
        self.comm_state = None
        # at most one of the hierarchical exchange's options; none: flat
        self.hierarchy = None if ddp is None else hierarchy_spec(ddp.hierarchy, ddp.site_size, ddp.site_sizes)
        self._first_step_reported = False
        self._warm_up_reported = False
        return ddp_kwargs

    # -- the exchange's layout: what a checkpoint and the replica check must agree with ----------------------------
    def _checkpoint_sites(self, world_size: int, num_nodes: int) -> tuple[Optional[list[int]], Optional[str]]:
        """This run's sites under the hierarchical exchange (``None``: flat) and the option that chose them, which
        a checkpoint's compression state must match (:func:`lightning_gradcomp.strategies.checkpoint.select`)."""
        if self.hierarchy is None:
            return None, None
        arg, value = self.hierarchy.argument()
        return list(self.hierarchy.layout(world_size, num_nodes).sizes), f"`{arg}={value!r}`"

    def _checkpoint_shard_size(self) -> Optional[int]:
        """The ranks per replica of this run's sharded model (``None``: not sharded), which a checkpoint's compression
        state must match (:func:`lightning_gradcomp.strategies.checkpoint.select`); the sharded wiring overrides it."""
        return None

    def _replica_sets(self) -> Optional[list[list[int]]]:
        """The sets of global ranks whose parameters must agree after every optimizer step (``None``: all ranks).
        Strategies with sites that step apart between rounds (DiLoCo, WeightGrad) return their sites."""
        return None

    def _replica_scope(self, sets: Optional[list[list[int]]]) -> str:
        """What must be equal after every step, for the divergence message."""
        return "every rank must hold the same parameters" if sets is None else (
            "the ranks of each site must hold the same parameters after every step; sites differ between rounds")

    def _warn_paper_default(self, optimizers: Sequence[torch.optim.Optimizer], measured_exchange: bool = True) -> None:
        """Warn once, on rank 0, when the compressor has a paper default whose measured gap to AdamW DDP is large
        and an optimizer is Adam or AdamW (:func:`lightning_gradcomp.strategies.presets.paper_default_warning`): not for an
        exchange nobody measured (``exclude``, ``min_numel``, or not ``measured_exchange``)."""
        from lightning_gradcomp.strategies.presets import paper_default_warning

        customised = bool(self.exclude) or self.min_numel != 1 or not measured_exchange
        message = paper_default_warning(self.compressor, optimizers, customised=customised)
        if message is not None:
            rank_zero_warn(message, category=UserWarning)

    def add_transform(self, transform: LayerTransform) -> None:
        """Attach a per-layer transform (called by callbacks at setup, before DDP wraps the model)."""
        if self.comm_state is not None:
            raise RuntimeError(
                "Transforms must be attached before the model is wrapped in DDP. Fix: attach it from a callback's "
                "`setup` hook, or add the callback to the Trainer's `callbacks`."
            )
        if any(type(t) is type(transform) for t in self._transforms):
            raise ValueError(
                f"A {type(transform).__name__} transform is already attached. Fix: pass one such callback to the Trainer."
            )
        self._transforms.append(transform)

    @property
    def transforms(self) -> tuple[LayerTransform, ...]:
        """The per-layer transforms, in the order they run."""
        return tuple(self._transforms)

    def _float_names(self, named: dict[str, torch.nn.Parameter]) -> frozenset[str]:
        return select_float_names(named, self.exclude, self.min_numel)

    def _layer_compressors(self, named: dict[str, torch.nn.Parameter]) -> dict[str, Compressor]:
        """Parameters with a compressor of their own, by name (a preset's embedding rows). Default: none."""
        return {}

    def _new_comm_state(
        self,
        named: dict[str, torch.nn.Parameter],
        process_group: Optional[dist.ProcessGroup],
        rank: int,
        world_size: int,
        device: torch.device,
        group_rank: Optional[int] = None,
        global_world_size: Optional[int] = None,
        **fields: Any,
    ) -> GradCompState:
        """Set up the compressor and transforms for this rank and build the hook state (not yet registered), its
        non-finite mode given by the runtime (:meth:`~lightning_gradcomp.strategies._runtime.Runtime.hook_mode`).

        Args:
            named: the parameters that go through the hook, by name.
            process_group: the group the hook exchanges with.
            rank: this process's rank, which seeds the compressor's random streams (distinct on every rank).
            world_size: ranks in ``process_group``.
            device: where the compressor's state lives.
            group_rank: this rank's index inside ``process_group`` for the transforms (default: ``rank``).
            global_world_size: ranks in the default group, where the hook's group is one site of them (default:
                ``world_size``).
            **fields: further :class:`~lightning_gradcomp.exchange.hook.GradCompState` fields, overriding the defaults.
        """
        self.compressor.setup(rank, world_size, device)
        own = self._layer_compressors(named)
        for compressor in {id(c): c for c in own.values()}.values():
            compressor.setup(rank, world_size, device)
        for transform in self._transforms:
            transform.setup(sorted(named), rank if group_rank is None else group_rank, world_size)
        options: dict[str, Any] = dict(
            compressor=self.compressor,
            names={id(p): n for n, p in named.items()},
            float_names=self._float_names(named),
            layer_compressors=own,
            transforms=tuple(self._transforms),
            process_group=process_group,
            world_size=world_size,
            planner=self.planner,
            pipeline_bytes=None if self.pipeline_mb is None else int(self.pipeline_mb * 2**20),
            nonfinite=self._runtime.hook_mode(world_size, world_size if global_world_size is None else global_world_size),
        )
        options.update(fields)
        return GradCompState(**options)

    def _build_hook_state(
        self,
        named: dict[str, torch.nn.Parameter],
        process_group: Optional[dist.ProcessGroup],
        rank: int,
        world_size: int,
        num_nodes: int,
        device: torch.device,
        timeout: Optional[timedelta],
        hook_group: Optional[tuple[int, Optional[int], dict[str, Any]]] = None,
    ) -> GradCompState:
        """The DDP hook's state, flat over ``process_group`` or, with :attr:`hierarchy`, over the sites (its
        groups made here: every rank calls this, in the same order).

        Args:
            named: the parameters that go through the hook, by name.
            process_group: DDP's group (the flat exchange's).
            rank: this rank's global rank.
            world_size: ranks in the default group.
            num_nodes: nodes of the run (``hierarchy="node"``: one site per node).
            device: where the compressor's state lives.
            timeout: the strategy's collective timeout, for the hierarchy's groups.
            hook_group: the flat hook's group size, this rank's index in it and further hook state fields
                (default: every rank, ``(world_size, None, {})``; a strategy with sites passes its site's).
        """
        if self.hierarchy is None:
            size, group_rank, fields = (world_size, None, {}) if hook_group is None else hook_group
            return self._new_comm_state(named, process_group, rank, size, device, group_rank=group_rank,
                                        global_world_size=world_size, **fields)
        # the compressor and its statistics see the sites as its workers: its group is the cross-site one
        sizes = [(n, p.numel() * p.element_size()) for n, p in named.items()]
        site = new_site_exchange(self.hierarchy.layout(world_size, num_nodes), rank, sizes, timeout)
        return self._new_comm_state(named, site.cross_group, rank, site.layout.num_sites, device,
                                    group_rank=site.site, global_world_size=world_size, hierarchy=site)

    def _announce_hook_state(self, named: dict[str, torch.nn.Parameter], in_sites: bool = False) -> None:
        """Log (INFO, call on rank 0 once the hook state exists) the setup line (:meth:`_announce`) for the hook
        state's group: the ranks (flat), a site's ranks (``in_sites``: DiLoCo, WeightGrad) or the sites (the
        hierarchical exchange, whose layout follows in a line of its own)."""
        state = self.comm_state
        assert state is not None
        self._announce(named, state.float_names, state.world_size, in_sites=in_sites,
                       between_sites=state.peers.hierarchy is not None)
        if state.peers.hierarchy is not None:
            site = state.peers.hierarchy
            log.info(
                "gradcomp: hierarchical exchange, %d sites of %d ranks: each share reduced to its owner and gathered "
                "back inside a site, %s between sites on each local rank's share (rank 0: %d of %d tensors)",
                site.layout.num_sites, site.site_size, type(self.compressor).__name__, len(site.owned), len(named),
            )

    def _hook_function(self) -> Callable[..., Any]:
        """The communication hook DDP runs on every bucket (a subclass whose exchange follows its optimizer's
        phase wraps :func:`~lightning_gradcomp.exchange.hook.gradcomp_hook`)."""
        return gradcomp_hook if self.hierarchy is None else hierarchical_hook

    # -- what the strategy sends (ByteReport), and what it says about it ------------------------------------------
    def bytes_per_step(self) -> int:
        """Bytes this rank sent per optimizer step (payloads and shared statistics; with the hierarchical exchange,
        this rank's share between sites), averaged over the run so far, dense warm-up steps included, read from the
        hook's ledger; 0 before the first step.

        The same method on every strategy of the library (:class:`~lightning_gradcomp.exchange.ledger.ByteReport`); the
        progress bar's ``comp_ratio`` and ``CompressionMonitor``'s totals read it.
        """
        return 0 if self.comm_state is None else self.comm_state.ledger.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes this rank sent in the latest optimizer step, on the link :meth:`bytes_per_step` counts."""
        return 0 if self.comm_state is None else self.comm_state.ledger.last_step_bytes()

    def dense_bytes_per_step(self) -> float:
        """What fp32 DDP would send per rank and step for the same parameters (from the hook's ledger)."""
        return 0 if self.comm_state is None else self.comm_state.ledger.dense_bytes_per_step()

    def _warn_single_rank(self, world_size: int) -> None:
        """Warn (rank 0, before any step) that one rank exchanges nothing while the compressor still runs."""
        if world_size == 1:
            rank_zero_warn(
                f"Expected at least 2 ranks for {type(self).__name__} to exchange compressed gradients, but got "
                f"world_size=1 (devices x num_nodes): nothing is sent, yet {type(self.compressor).__name__} still "
                f"compresses every step, so training pays its error and its cost for no saving. Fix: use `devices=2` "
                f"or more (CPU ranks are fine), `strategy='auto'` for one device without compression, or "
                f"`TowerStrategy(num_workers=N)` to emulate N compressing workers in one process.",
                category=UserWarning,
            )

    def _announce(self, named: dict[str, torch.nn.Parameter], float_names: frozenset[str], world_size: int,
                  in_sites: bool = False, between_sites: bool = False) -> None:
        """Log (INFO, visible by default; call on rank 0) what runs: the compressor, its collectives, and its bytes.

        Fixed-size encodings: the exact bytes per rank and step, from
        :func:`~lightning_gradcomp.exchange.codec.measure_codec` (a copy of the compressor packs tensors of every compressed
        parameter's shape; the size depends on the shapes only). Sparse encodings (``fixed_size=False``) send what
        each step's gradients select, and a cost-model planner (``link``) may send a bucket in fp32: no number is
        promised for them here; the bytes the first step sent, read from the ledger, follow in their own line
        (:meth:`_report_first_step`). On one rank nothing is exchanged, and the line says so. ``in_sites``: the hook
        runs inside each site of ``world_size`` ranks (DiLoCo, WeightGrad; their own line describes the sites).
        ``between_sites``: the hierarchical exchange, ``world_size`` sites; the bytes are a site's (its ranks send
        one share each). Without a dense warm-up, the expected bytes are what ``bytes_per_step()`` reports (the
        hook's, inside a site, are the monitor's ``lan_bytes``: ``bytes_per_step()`` of a strategy with sites counts
        what crosses between them).
        """
        from lightning_gradcomp.exchange.codec import measure_codec

        if between_sites:
            where, per = f"between {world_size} sites", "per site (its ranks send one share each)"
        else:
            where = f"{'in each site of' if in_sites else 'on'} {world_size} rank{'' if world_size == 1 else 's'}"
            # a site's inner exchange is not what its strategy's bytes_per_step counts (the bytes between sites)
            per = ("per rank inside the site (the monitor's lan_bytes; bytes_per_step() counts what crosses between "
                   "sites)") if in_sites else "per rank"
        name = f"{type(self.compressor).__name__} {where}"
        dense = sum(dense_bytes(p.numel()) for p in named.values())
        if world_size == 1:
            log.info("gradcomp: %s: nothing is exchanged (no other %s); the compressor still runs every step "
                     "(fp32 DDP would send %s bytes per rank per step on 2 or more)", name,
                     "site" if between_sites else "rank in the site" if in_sites else "rank", f"{dense:,}")
            return
        shapes = [(n, tuple(p.shape)) for n, p in named.items() if n not in float_names]
        codec = measure_codec(copy.deepcopy(self.compressor), shapes, world_size, timed=False) if shapes else None
        if codec is None:
            collectives = "fp32 all-reduce only"
        else:
            collectives = (
                "all-gather of each rank's packed payload" if codec.aggregation is Aggregation.GATHER
                else "all-reduce of the compressed payload"
            ) + (" after one small all-reduce of shared scalers" if codec.rounds else "")
            if float_names:
                collectives += f"; {len(float_names)} of {len(named)} tensors in fp32 all-reduce"
            if self.planner is not None:
                collectives += "; per bucket, plain fp32 instead where the cost model of `link` says it is faster"
        if codec is not None and self._measured_later():
            log.info("gradcomp: %s: %s; bytes follow the data (%s): step 1's measured bytes follow, vs %s "
                     "for fp32 DDP per rank per step", name, collectives,
                     "the cost model's choice per bucket" if self.planner is not None else "a sparse encoding",
                     f"{dense:,}")
            return
        # what the ledger will count: fp32 layers, packets, and the shared statistics' all-reduce
        expected = dense - sum(dense_bytes(named[n].numel()) for n, _ in shapes) + (codec.nbytes + codec.shared_nbytes if codec
                                                                             else 0)
        log.info(
            "gradcomp: %s: %s; expected %s bytes %s per step vs %s for fp32 DDP (%.1fx less)",
            name, collectives, f"{int(expected):,}", per, f"{dense:,}", dense / max(expected, 1),
        )

    def _measured_later(self) -> bool:
        """Whether the bytes per step depend on the data (sparse encodings, the planner's choice), not on shapes."""
        return not self.compressor.fixed_size or self.planner is not None

    def _report_first_step(self, rank: int) -> None:
        """After the first compressed exchange (call after each backward): on rank 0, log the bytes it sent, from the
        ledger, where the setup line could not state them (:meth:`_announce`), or after a dense warm-up (which the
        first exchange's line announces: its steps send fp32, as DDP, and count in ``bytes_per_step``'s mean)."""
        state = self.comm_state
        if self._first_step_reported or state is None or not state.ledger.hook_calls:
            return  # no exchange yet (an accumulation micro-batch runs no hook)
        ledger = state.ledger
        # the exchange under way is the ledger's open step: its number counts every exchange so far
        step = ledger.run.steps + 1
        if state.router.dense:
            if not self._warm_up_reported and rank == 0 and state.world_size > 1:
                log.info("gradcomp: step %d is a dense warm-up step: %s bytes per rank in fp32, as DDP; the first "
                         "compressed step's bytes follow it; bytes_per_step() and comp_ratio average over the run, "
                         "warm-up included", step, f"{ledger.last_step_bytes():,}")
            self._warm_up_reported = True
            return
        self._first_step_reported = True
        if rank != 0 or state.world_size == 1 or not (self._measured_later() or self._warm_up_reported):
            return
        sent, dense = ledger.last_step_bytes(), ledger.dense_bytes_per_step()
        # a strategy with sites reports what crosses between them: the hook's bytes are the site's inner exchange
        flat = type(self).bytes_per_step is HookWiring.bytes_per_step
        log.info("gradcomp: step %d%s sent %s bytes per rank%s vs %s for fp32 DDP (%.1fx less), measured; %s", step,
                 " (the first compressed)" if self._warm_up_reported else "", f"{sent:,}",
                 "" if flat else " inside the site", f"{dense:,}", dense / max(sent, 1),
                 ("bytes_per_step() and the progress bar's comp_ratio average over the run so far"
                  + (", warm-up included" if self._warm_up_reported else "")) if flat else
                 "the monitor's lan_bytes follow every step (bytes_per_step() counts what crosses between sites)")
