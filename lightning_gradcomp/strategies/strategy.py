"""``GradCompStrategy``: Lightning's DDP with our compression hook installed on CPU (Gloo) and GPU (NCCL)."""

import logging
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor, OptimizerCheck
from lightning_gradcomp.strategies import presets
from lightning_gradcomp.callbacks import CompressionMonitor, CompressionProgressBar, CompressionSchedule
from lightning_gradcomp.strategies.options import DDPOptions, with_options
from lightning_gradcomp.strategies.resilience import ResilienceMixin
from lightning_gradcomp.sites.layout import SiteGroups, SiteLayout, check_site_options, new_site_groups
from lightning_gradcomp.strategies.wiring import HookWiring, check_backend, select_float_names  # noqa: F401  (select_float_names: public here)

log = logging.getLogger(__name__)


class GradCompStrategy(ResilienceMixin, HookWiring, DDPStrategy):
    """Data-parallel training with compressed gradient exchange inside DDP's communication hook.

    Args:
        options: every option of :class:`~lightning_gradcomp.strategies.options.DDPOptions`, each a named parameter
            (``GradCompStrategy(compressor="fp32", min_numel=1024)``).
        precision_plugin: see Lightning's ``DDPStrategy``.
        **kwargs: further ``DistributedDataParallel`` options.
    """

    strategy_name = "gradcomp"

    @with_options(DDPOptions)
    def __init__(self, options: DDPOptions, precision_plugin: Optional[Precision] = None, **kwargs: Any) -> None:
        # reliability options (lightning_gradcomp.strategies.resilience), validated before anything else is built
        self._init_resilience(options)
        # DDP's further options, checked (and the ones that would replace the hook refused) before DDP sees them
        ddp_kwargs = self._init_wiring(options, kwargs)
        if self.hierarchy is not None:
            self._check_hierarchy()
        super().__init__(precision_plugin=precision_plugin, **options.lightning_kwargs(), **ddp_kwargs)

    @override
    def setup_environment(self) -> None:
        check_backend(self._process_group_backend, self.root_device)
        if self.hierarchy is not None:  # the world size is known now: refuse a bad layout before any group exists
            self.hierarchy.layout(self.world_size, self.num_nodes)
        if type(self)._hook_group is GradCompStrategy._hook_group:  # strategies with sites say what one rank means
            self._warn_single_rank(self.num_nodes * self.num_processes)
        super().setup_environment()

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours must run on CPU/Gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        module = self.lightning_module
        assert module is not None, "DDP wraps a LightningModule"
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.comm_state = self._build_hook_state(named, self.model.process_group, self.global_rank, self.world_size,
                                                 self.num_nodes, self.root_device, self._timeout, self._hook_group())
        if self.global_rank == 0:
            self._announce_hook_state(named, in_sites=type(self)._hook_group is not GradCompStrategy._hook_group)
        self._on_hook_state(named)
        self._attach_resilience(self.comm_state)  # per-rank optimizer states, pending checkpoint restore
        self.model.register_comm_hook(self.comm_state, self._hook_function())

    def _check_hierarchy(self) -> None:
        """Refuse what the hierarchical exchange cannot do (before any process group exists): strategies with their
        own sites (WeightGrad, DiLoCo: they override :meth:`_hook_group`) run their inner DDP inside a site."""
        arg, value = self.hierarchy.argument()  # type: ignore[union-attr]
        if type(self)._hook_group is not GradCompStrategy._hook_group:
            raise ValueError(
                f"Expected `{arg}` to be None for {type(self).__name__} (it has its own sites), but got "
                f"{value!r}. Fix: pass the sites to {type(self).__name__}'s own `site_size`/`site_sizes`, or use "
                f"GradCompStrategy for the hierarchical exchange of another compressor."
            )

    # -- override points for strategies that run DDP inside sites (WeightGrad, DiLoCo) ----------------------
    def _hook_group(self) -> tuple[int, Optional[int], dict[str, Any]]:
        """The hook's group size, this rank's index in it (``None``: the global rank) and further
        :class:`~lightning_gradcomp.exchange.hook.GradCompState` fields. DDP's own process group is the hook's group."""
        return self.world_size, None, {}

    def _on_hook_state(self, named: dict[str, torch.nn.Parameter]) -> None:
        """Called once the hook state exists, before a checkpoint's compression state is restored into it: a
        subclass attaches further per-rank state here (``comm_state.extra``). Default: nothing."""

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._report_first_step(self.global_rank)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if isinstance(self.compressor, OptimizerCheck):  # e.g. OneBit warns about heavy momentum
            self.compressor.check_optimizers(self.optimizers)
        # the gaps were measured on the flat exchange: strategies with sites or the hierarchical exchange send
        # something else between their sites
        flat = type(self)._hook_group is GradCompStrategy._hook_group and self.hierarchy is None
        self._warn_paper_default(self.optimizers, measured_exchange=flat)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # compression visible without a logger: comp_ratio in the progress bar, unless a monitor already shows it
        if not any(
            isinstance(c, CompressionProgressBar) or (isinstance(c, CompressionMonitor) and c.progress_bar)
            for c in trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        ):
            trainer.callbacks.append(CompressionProgressBar())  # type: ignore[attr-defined]
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        registry.register_strategies(cls, strategy_registry)


class SiteStrategy(GradCompStrategy):
    """A :class:`GradCompStrategy` whose DDP runs inside sites that step apart between rounds (DiLoCo, WeightGrad):
    the site options, the layout and the site groups (:func:`~lightning_gradcomp.sites.layout.new_site_groups`, made in
    ``setup_environment``; the site's group becomes DDP's), the hook inside the site, and the replica check per
    site. A subclass says how ranks form sites (:meth:`make_layout`) and what runs between them."""

    def _init_sites(self, site_size: Optional[int], site_sizes: Optional[Sequence[int]]) -> None:
        """Validate and keep the site options (before the strategy's own ``__init__``: bad values fail first)."""
        check_site_options(site_size, site_sizes)
        self.site_size = site_size
        self.site_sizes = None if site_sizes is None else list(site_sizes)
        self.layout: Optional[SiteLayout] = None
        self.groups: Optional[SiteGroups] = None

    def make_layout(self, world_size: int) -> SiteLayout:
        """The site layout for ``world_size`` ranks (validates; raises ``ValueError`` on a bad configuration)."""
        raise NotImplementedError

    @override
    def setup_environment(self) -> None:
        # validated before the process group exists: a bad layout fails fast, identically on every rank
        self.layout = self.make_layout(self.num_nodes * self.num_processes)
        super().setup_environment()
        self.groups = new_site_groups(self.layout, self.global_rank, self._timeout)
        # DDP itself runs inside the site: its parameter broadcast, buffer broadcast and gradient hook stay there
        self._ddp_kwargs["process_group"] = self.groups.site_group

    @override
    def _hook_group(self) -> tuple[int, Optional[int], dict[str, Any]]:
        # the global rank seeds the compressor (distinct random streams); transforms see their rank in the site
        assert self.groups is not None
        return self.groups.site_size, self.groups.site_rank, self._site_hook_fields()

    def _site_hook_fields(self) -> dict[str, Any]:
        """Further :class:`~lightning_gradcomp.exchange.hook.GradCompState` fields of the hook inside a site. Default: none."""
        return {}

    @override
    def _replica_sets(self) -> Optional[list[list[int]]]:
        # sites step apart between rounds by design: only the ranks of a site must agree after every local step
        assert self.layout is not None
        return [self.layout.ranks(site) for site in range(self.layout.num_sites)]


class PresetStrategy(GradCompStrategy):
    """:class:`GradCompStrategy` with a preset's compressor setting, measured to reach AdamW DDP's loss on a
    transformer (``Trainer(strategy="terngrad_lm")``; the table, its measurements and the stored runs they rest on:
    :mod:`lightning_gradcomp.strategies.presets`).

    A preset sets the compressor's options, sends the parameters of every ``nn.Embedding`` in fp32 where it says so
    (on top of ``exclude``), and runs its first steps dense where it says so (a
    :class:`~lightning_gradcomp.callbacks.CompressionSchedule` added at setup, unless the Trainer has one already).

    Args:
        preset: a preset name (:func:`lightning_gradcomp.strategies.presets.preset_names`).
        row_levels: compress the embeddings by QSGD at this many levels with a norm per row instead of the preset's
            way (``terngrad_lm``: fp32); ``None``: the preset's. Measured by ``benchmarks/presets_generalise.py``.
        **kwargs: :class:`GradCompStrategy`'s options, except ``compressor``.
    """

    strategy_name = "gradcomp_preset"

    def __init__(self, preset: str, row_levels: Optional[int] = None, **kwargs: Any) -> None:
        self.preset, compressor = presets.preset_compressor(preset, kwargs, type(self).__name__, row_levels)
        super().__init__(**{**kwargs, "compressor": compressor})

    @override
    def _float_names(self, named: dict[str, torch.nn.Parameter]) -> frozenset[str]:
        names = super()._float_names(named)
        module = self.lightning_module
        if self.preset.float_embeddings and module is not None:
            names |= presets.embedding_names(module, named)
        return names

    @override
    def _layer_compressors(self, named: dict[str, torch.nn.Parameter]) -> dict[str, Compressor]:
        module = self.lightning_module
        return {} if module is None else self.preset.embedding_compressors(module, named)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if self.preset.dense_steps:
            if any(isinstance(c, CompressionSchedule) for c in callbacks):
                log.info("gradcomp: %s: the Trainer's CompressionSchedule decides the dense steps (the preset's: %s)",
                         self.preset.name, self.preset.dense_steps)
            else:
                callbacks.append(CompressionSchedule(dense_steps=self.preset.dense_steps))
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets.register(cls, strategy_registry)
