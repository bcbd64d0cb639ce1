"""``DiLoCoStrategy`` (``strategy="diloco"``, ``"streaming_diloco"``): local AdamW steps, compressed outer rounds.

Each *site* (one or more ranks; by default every rank is its own site, as DiLoCo's workers) trains its own
replica: every inner step is DDP over the site's ranks only, with the gradcomp hook (plain fp32 by default, or any
per-step compressor as ``inner_compressor``). Between sites only the outer rounds talk
(:class:`~lightning_gradcomp.outer.engine.OuterSync`): every ``sync_every`` inner steps each fragment's
pseudo-gradient is compressed by ``compressor``, averaged over sites through the site leaders, and applied by the
outer optimizer.

What does not depend on how a site trains (the outer options, the engine after every inner step, the final round,
statistics and bytes) is :class:`OuterRounds`, mixed into :class:`DiLoCoStrategy` here and into
:class:`~lightning_gradcomp.outer.sharded.ShardedDiLoCoStrategy` (FSDP2 sites, each rank's shard exchanged).

Where the outer round runs: in :meth:`OuterRounds.optimizer_step`, right after the inner optimizer step. By
then DDP's backward (and every hook collective) has finished on all ranks, so the outer collectives, issued from
the main thread in a fixed order on every rank, cannot interleave with the inner ones on the same group.

When training ends, :meth:`OuterRounds.final_synchronisation` runs one last round for every fragment not synced at
the last step, right after that step (:class:`~lightning_gradcomp.strategies.final_sync.FinalSynchronisation`), so
the checkpoints written at the end of ``fit`` and every rank hold the global weights (``docs/diloco.md``).
"""

import copy
import importlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.hook import GradCompState
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.outer.engine import OuterSync
from lightning_gradcomp.outer.exchange import LeaderExchange
from lightning_gradcomp.outer.fragments import strided_fragments
from lightning_gradcomp.strategies.final_sync import FinalSynchronisation
from lightning_gradcomp.strategies.resilience import ResilienceMixin
from lightning_gradcomp.strategies.strategy import SiteStrategy
from lightning_gradcomp.validation import check_bool, check_int, check_number, UnknownOptionError
from lightning_gradcomp.exchange.ledger import dense_bytes
from lightning_gradcomp.sites.layout import SiteGroups, SiteLayout, site_layout, start_sites_from_rank0

if TYPE_CHECKING:
    # the type checker reads the mixin as the strategy it is mixed into (a ResilienceMixin over a Lightning
    # strategy); at run time it stays a plain mixin ahead of that strategy in the bases
    _OuterBase = ResilienceMixin
else:
    _OuterBase = object

log = logging.getLogger(__name__)

_SHORT_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def resolve_optimizer(outer_optimizer: Union[str, type]) -> type[Optimizer]:
    """An optimizer class from a class, a dotted path (``"torch.optim.SGD"``) or a short name (``"sgd"``).

    Raises:
        ValueError: the value names no ``torch.optim.Optimizer`` subclass.
    """
    cls: Any = outer_optimizer
    if isinstance(outer_optimizer, str):
        cls = _SHORT_OPTIMIZERS.get(outer_optimizer.lower())
        if cls is None and "." in outer_optimizer:
            module, _, attr = outer_optimizer.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), attr, None)
            except ImportError:
                cls = None
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ValueError(
            f"Expected `outer_optimizer` to be a torch.optim.Optimizer class, but got {outer_optimizer!r}. "
            f"Fix: use 'torch.optim.SGD' (DiLoCo: with outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True), "
            f"a short name {sorted(_SHORT_OPTIMIZERS)}, or an optimizer class."
        )
    return cls


# arguments the strategy sets itself from its own options (``outer_lr``, ``outer_momentum``, ``outer_nesterov``)
_OWN_ARGUMENTS = {"lr": "outer_lr", "momentum": "outer_momentum", "nesterov": "outer_nesterov"}


def check_outer_kwargs(cls: type[Optimizer], outer_kwargs: dict[str, Any]) -> None:
    """Refuse ``outer_kwargs`` keys the outer optimizer does not take or the strategy sets itself.

    Raises:
        ValueError: a key is not an argument of ``cls`` (:class:`~lightning_gradcomp.validation.UnknownOptionError`)
            or duplicates one of the strategy's own options (``lr``: ``outer_lr``; SGD's ``momentum`` and
            ``nesterov``: ``outer_momentum``, ``outer_nesterov``).
    """
    for key, option in _OWN_ARGUMENTS.items():
        if key in outer_kwargs and (key == "lr" or issubclass(cls, torch.optim.SGD)):
            raise ValueError(
                f"Expected `outer_kwargs` without {key!r} (the strategy sets it from `{option}`), but got "
                f"{outer_kwargs!r}. Fix: pass `{option}={outer_kwargs[key]!r}` instead."
            )
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # the optimizer takes any keyword: its own check runs on the probe in the constructor
    valid = [n for n in parameters if n not in ("self", "params", *_OWN_ARGUMENTS)]
    unknown = [key for key in outer_kwargs if key not in valid]
    if unknown:
        raise UnknownOptionError(
            f"Expected `outer_kwargs` to hold arguments of {cls.__name__}, but got {unknown[0]!r} in "
            f"{outer_kwargs!r}. Fix: use only {valid}."
        )


def tokens_in(batch: Any) -> int:
    """Tokens in a batch: the elements of its first integer tensor (token ids, ``B x T``), else its first
    tensor's length (samples). Read from shapes only: no device transfer."""
    tensors: list[Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)

    collect(batch)
    for t in tensors:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0


class OuterRounds(_OuterBase):
    """The outer rounds of DiLoCo and Streaming DiLoCo, whatever trains a site between them: the options, the engine
    (:class:`~lightning_gradcomp.outer.engine.OuterSync`) after every inner optimizer step, the final round, the
    statistics and the bytes. Mixed in ahead of the strategy that runs the inner steps: DDP inside a site
    (:class:`DiLoCoStrategy`) or FSDP2 (:class:`~lightning_gradcomp.outer.sharded.ShardedDiLoCoStrategy`); that
    strategy builds the engine with :meth:`_start_outer` once its model is set up."""

    outer: Optional[OuterSync]
    outer_compressor: Compressor
    #: who sends a round's pseudo-gradients, for the setup line
    outer_senders = "of each site leader"

    def _init_outer(
        self,
        sync_every: int,
        compressor: Union[Compressor, str],
        outer_optimizer: Union[str, type],
        outer_lr: float,
        outer_momentum: float,
        outer_nesterov: bool,
        outer_kwargs: Optional[dict[str, Any]],
        fragments: int,
        sync_delay: int,
        mixing: float,
        outer_state_device: Optional[Literal["cpu"]],
        error_decay: float,
    ) -> None:
        """Validate and keep the outer options (before the strategy's own ``__init__``: bad values fail first)."""
        check_int("sync_every", sync_every, minimum=1, fix="H counts inner steps between outer syncs; DiLoCo uses 500, 1 syncs every step")
        check_int("fragments", fragments, minimum=1, fix="use 1 for DiLoCo, or a few (e.g. 4) for Streaming DiLoCo")
        check_int("sync_delay", sync_delay, minimum=0, fix="use 0 to apply each exchange at once")
        if sync_delay >= sync_every:
            raise ValueError(
                f"Expected `sync_delay` to be below `sync_every`={sync_every} (an exchange must land before the same "
                f"fragment syncs again), but got {sync_delay}. Fix: use a delay in 0..{sync_every - 1}."
            )
        check_number("mixing", mixing, minimum=0.0, maximum=1.0,
                     fix="alpha is the share of the local weights kept: 0 takes the global weights (DiLoCo), 0.5 Streaming DiLoCo")
        check_number("outer_lr", outer_lr, minimum=0.0, min_open=True, fix="use 0.7 (DiLoCo), or 1.0 without momentum to average")
        check_number("outer_momentum", outer_momentum, minimum=0.0, maximum=1.0, max_open=True, fix="use 0.9 (DiLoCo) or 0")
        check_bool("outer_nesterov", outer_nesterov)
        if outer_kwargs is not None and not isinstance(outer_kwargs, dict):
            raise ValueError(f"Expected `outer_kwargs` to be a dict or None, but got {outer_kwargs!r}. Fix: e.g. {{'betas': [0.9, 0.95]}}.")
        if outer_state_device not in (None, "cpu"):
            raise ValueError(
                f"Expected `outer_state_device` to be None or 'cpu', but got {outer_state_device!r}. "
                f"Fix: None keeps the outer state beside the parameters, 'cpu' keeps it off the accelerator."
            )
        check_number("error_decay", error_decay, minimum=0.0, maximum=1.0,
                     fix="beta of the outer error feedback: SparseLoCo-style 0.95, 1 for plain error feedback, 0 for none")
        self.outer_optimizer_class = resolve_optimizer(outer_optimizer)
        check_outer_kwargs(self.outer_optimizer_class, outer_kwargs or {})
        self.outer_compressor = registry.resolve_compressor(compressor)
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.outer_nesterov = outer_nesterov
        self.outer_kwargs = dict(outer_kwargs or {})
        self.num_fragments = fragments
        self.sync_delay = sync_delay
        self.mixing = float(mixing)
        self.outer_state_device = outer_state_device
        self.error_decay = float(error_decay)
        try:  # values the optimizer refuses (e.g. betas outside [0, 1)) fail now, not at the first round
            self._outer_optimizer([torch.zeros(1)])
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"Expected `outer_kwargs` that {self.outer_optimizer_class.__name__} accepts, but got "
                f"{self.outer_kwargs!r}: {exc}. Fix: correct the value it names, or leave the key out for "
                f"{self.outer_optimizer_class.__name__}'s default."
            ) from exc
        self.outer = None
        self._batch_tokens = 0
        #: the inner step at which the final round ran (it runs once)
        self._final_at: Optional[int] = None

    def _outer_optimizer(self, anchors: list[Tensor]) -> Optimizer:
        kwargs: dict[str, Any] = {"lr": self.outer_lr}
        if issubclass(self.outer_optimizer_class, torch.optim.SGD):
            kwargs.update(momentum=self.outer_momentum, nesterov=self.outer_nesterov and self.outer_momentum > 0)
        kwargs.update(self.outer_kwargs)
        return self.outer_optimizer_class(anchors, **kwargs)

    def _outer_hook_state(self, named: Mapping[str, torch.nn.Parameter], float_names: frozenset[str],
                          group: Any, sites: int, seed: int) -> GradCompState:
        """The outer exchange's own hook state over ``group`` (``sites`` members): the outer compressor (seeded by
        ``seed``), its error feedback, fp32 for ``float_names``; a non-finite pseudo-gradient raises."""
        state_device = None if self.outer_state_device is None else torch.device(self.outer_state_device)
        self.outer_compressor.setup(seed, sites, self.root_device)
        return GradCompState(
            compressor=self.outer_compressor,
            names={id(p): n for n, p in named.items()},
            float_names=float_names,
            process_group=group,
            world_size=sites,
            memory=ResidualMemory(state_device, self.error_decay),
            nonfinite="raise",  # a non-finite pseudo-gradient stops every site, naming the parameter
        )

    def _start_outer(self, params: Mapping[str, Tensor], buffers: Sequence[Tensor], groups: SiteGroups,
                     exchange: LeaderExchange, fragments: Sequence[Sequence[str]]) -> None:
        """Build the engine over this rank's ``params`` (the site's weights, or this rank's shard of them) and
        attach it to the checkpointed per-rank state."""
        assert self.comm_state is not None
        state_device = None if self.outer_state_device is None else torch.device(self.outer_state_device)
        self.outer = OuterSync(
            params=params,
            buffers=buffers,
            groups=groups,
            exchange=exchange,
            outer_optimizer=self._outer_optimizer,
            fragments=fragments,
            sync_every=self.sync_every,
            sync_delay=self.sync_delay,
            mixing=self.mixing,
            state_device=state_device,
        )
        self._final_at = None
        # anchor, outer momentum, outer error feedback and the site's weights: checkpointed per rank
        self.comm_state.attach("outer", self.outer)
        log.info(
            "diloco: rank %d in site %d of %s; %d fragment(s), H=%d, delay %d, mixing %.2f; outer %s, %s lr %g",
            self.global_rank, groups.site, list(groups.layout.sizes), len(fragments), self.sync_every, self.sync_delay,
            self.mixing, type(self.outer_compressor).__name__, self.outer_optimizer_class.__name__, self.outer_lr,
        )

    def _announce_outer(self, shapes: Mapping[str, torch.Size], float_names: frozenset[str], sites: int) -> None:
        """Log (INFO, rank 0) the outer rounds between ``sites`` sites: bytes per round and per inner step at
        ``sync_every`` of what this rank sends (``shapes``: its tensors' shapes, the outer compressor's packets and
        shared statistics as the ledger counts them), against fp32 DDP of the same tensors every step."""
        from lightning_gradcomp.exchange.codec import measure_codec

        dense = sum(dense_bytes(s.numel()) for s in shapes.values())
        if sites == 1:
            log.info("diloco: one site: no outer round sends anything (bytes_per_step() 0 vs %s for fp32 DDP)",
                     f"{dense:,}")
            return
        compressed = [(n, tuple(s)) for n, s in shapes.items() if n not in float_names]
        codec = measure_codec(copy.deepcopy(self.outer_compressor), compressed, sites, timed=False) if compressed else None
        per_window = dense - sum(dense_bytes(shapes[n].numel()) for n, _ in compressed) + (
            codec.nbytes + codec.shared_nbytes if codec else 0)
        per_step = per_window / self.sync_every
        log.info(
            "diloco: outer rounds between %d sites: %s pseudo-gradients %s, expected %s bytes per %s "
            "every %d inner steps = %s bytes per inner step at sync_every=%d, vs %s per step for fp32 DDP (%.1fx less)",
            sites, type(self.outer_compressor).__name__, self.outer_senders, f"{int(per_window):,}",
            "round" if self.num_fragments == 1 else f"{self.num_fragments} fragment rounds", self.sync_every,
            f"{per_step:,.0f}", self.sync_every, f"{dense:,}", dense / max(per_step, 1e-9),
        )

    @override
    def _without_state_message(self, checkpoint_path: Any) -> str:
        return (
            f"diloco: the checkpoint {checkpoint_path} holds no DiLoCo state (written by another strategy, e.g. DDP): "
            f"every site starts from its weights as the global weights, with fresh outer momentum, and the first outer "
            f"round comes {self.sync_every} inner steps from here (DiLoCo's warm start from synchronous training). "
            f"Fix: to resume a DiLoCo run, pass a checkpoint that run wrote."
        )

    def final_synchronisation(self) -> None:
        """At the end of ``fit``: one last round for every fragment not synced at the last step, so every rank
        holds the global weights (:meth:`~lightning_gradcomp.outer.engine.OuterSync.final_round`).

        Run right after the last training step, before the checkpoints that follow it, and again at
        ``on_train_end`` for a ``fit`` stopped otherwise: at most once per inner step, since with ``mixing > 0`` a
        second final round would step the outer optimizer again. Every rank calls it at the same point.
        """
        if self.outer is None or self._final_at == self.outer.inner_steps:
            return
        self._final_at = self.outer.inner_steps
        final = self.outer.final_round()
        self.outer.take_landed()
        module = self.lightning_module
        assert module is not None
        if final and self.global_rank == 0:
            log.info(
                "diloco: final outer round of fragment(s) %s at inner step %d, so every rank leaves fit with the global "
                "weights", final, self.outer.inner_steps,
            )
        # the engine's tensors: the trainable parameters, or this rank's shards of them under FSDP2
        names = list(self.outer.params)
        self._check_after_round(names, [self.outer.params[n] for n in names], module.trainer.global_step,
                                "parameters at the end of fit (the global weights)")

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        FinalSynchronisation.attach(trainer)  # runs `final_synchronisation` after the last step
        super().setup(trainer)

    # -- the step -------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch_tokens += tokens_in(args[0]) if args else 0
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.outer is not None
        tokens, self._batch_tokens = self._batch_tokens, 0
        self.outer.after_inner_step(tokens)
        self._check_landed_rounds(
            self.outer, f"{'weights' if self.mixing == 0 else 'global weights'} right after an outer round")
        return output

    @property
    def stats(self) -> dict[str, Tensor]:
        """Statistics of the latest step for :class:`~lightning_gradcomp.callbacks.CompressionMonitor`:
        ``bytes_per_round`` (what this rank put between sites in the latest round), ``bytes_per_token``,
        ``compression_ratio``, ``pseudo_gradient_norm/fragment_<p>``, ``sync_seconds/fragment_<p>`` (launch to
        applied), ``inner_steps_since_sync``, ``rounds``."""
        return {} if self.outer is None else self.outer.stats

    def bytes_per_step(self) -> int:
        """Bytes this rank put on the link between sites per inner step, averaged over the run so far
        (:class:`~lightning_gradcomp.exchange.ledger.ByteReport`); 0 with one site."""
        return 0 if self.outer is None else self.outer.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes this rank put on the link between sites in the latest inner step (0 on a step without a round)."""
        return 0 if self.outer is None else self.outer.last_step_bytes()


class DiLoCoStrategy(OuterRounds, SiteStrategy):
    """DiLoCo and Streaming DiLoCo with any compressor on the pseudo-gradients (see :mod:`lightning_gradcomp.outer`).

    Args:
        sync_every: H, inner steps between two outer syncs of a fragment (DiLoCo: 500; INTELLECT-1: 100).
        compressor: what encodes the pseudo-gradients between sites: a registered name or a ``Compressor``
            (``"fp32"``: dense DiLoCo; ``"int8"``: INTELLECT-1; ``TopK(0.02, value_dtype="int2")``: SparseLoCo's
            top-k with 2-bit values and error feedback). Error feedback is kept for compressors that use it.
        inner_compressor: the per-step compressor inside each site (``"fp32"``: plain DDP).
        outer_optimizer: the outer optimizer class (or dotted path / short name), stepping the global weights
            with the averaged pseudo-gradient as gradient.
        outer_lr: the outer learning rate (DiLoCo: 0.7; 1.0 with no momentum is plain averaging of the sites).
        outer_momentum: momentum of an SGD outer optimizer (DiLoCo: 0.9).
        outer_nesterov: Nesterov momentum for an SGD outer optimizer (DiLoCo: True).
        outer_kwargs: further keyword arguments of the outer optimizer (e.g. ``betas`` for Adam).
        site_size: ranks per site (all equal). With neither this nor ``site_sizes``: every rank is a site.
        site_sizes: the size of each site, in global-rank order.
        fragments: P, strided groups of layers synced at staggered steps (1: DiLoCo).
        sync_delay: tau, inner steps a fragment's exchange overlaps before it is applied (0: blocking).
        mixing: alpha, the share of a site's own weights kept when a fragment is applied (0: the global weights).
        outer_state_device: where the global weights, the outer optimizer's state and the outer error feedback
            live: ``None`` beside the parameters, ``"cpu"`` off the accelerator.
        error_decay: beta, the factor on the outer error feedback added back each round, for compressors with error
            feedback (SparseLoCo: ``e <- beta * e + delta``). Below 1 because each round re-derives the unsent progress
            from the same anchor: with 1 it would be counted again every round.
        **kwargs: :class:`~lightning_gradcomp.GradCompStrategy` arguments (``exclude``/``min_numel`` layers stay
            fp32 at both levels; DDP and reliability options).
    """

    strategy_name = "diloco"
    # sites step their inner optimizers apart between rounds: AdamW moments differ per site
    per_rank_optimizer_state = True

    def __init__(
        self,
        sync_every: int = 100,
        compressor: Union[Compressor, str] = "fp32",
        inner_compressor: Union[Compressor, str] = "fp32",
        outer_optimizer: Union[str, type] = "torch.optim.SGD",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        outer_kwargs: Optional[dict[str, Any]] = None,
        site_size: Optional[int] = None,
        site_sizes: Optional[Sequence[int]] = None,
        fragments: int = 1,
        sync_delay: int = 0,
        mixing: float = 0.0,
        outer_state_device: Optional[Literal["cpu"]] = None,
        error_decay: float = 0.95,
        **kwargs: Any,
    ) -> None:
        self._init_outer(sync_every, compressor, outer_optimizer, outer_lr, outer_momentum, outer_nesterov,
                         outer_kwargs, fragments, sync_delay, mixing, outer_state_device, error_decay)
        self._init_sites(site_size, site_sizes)
        # resolved here so that a bad value is reported as the argument given, not as GradCompStrategy's `compressor`
        super().__init__(compressor=registry.resolve_compressor(inner_compressor, "inner_compressor"), **kwargs)

    # -- sites ----------------------------------------------------------------------------------------------
    @override
    def make_layout(self, world_size: int) -> SiteLayout:
        """The site layout for ``world_size`` ranks (every rank a site unless ``site_size``/``site_sizes``).

        Warns when the layout is one site (one device, or ``site_size`` equal to the world size): nothing crosses
        between sites, so the run is one replica whose outer optimizer steps on its own pseudo-gradient every
        ``sync_every`` steps. Allowed: it is how a DiLoCo recipe is smoke-tested on one machine before a run over
        several.
        """
        site_size = 1 if self.site_size is None and self.site_sizes is None else self.site_size
        layout = site_layout(world_size, site_size=site_size, site_sizes=self.site_sizes, allow_single_rank_sites=True)
        if layout.num_sites == 1:
            where = (
                "it runs on one device" if world_size == 1
                else f"its {world_size} ranks form one site "
                f"({'site_sizes' if self.site_sizes else 'site_size'}={self.site_sizes or self.site_size})"
            )
            warn_one_site(where, self.outer_optimizer_class, self.sync_every, "pass a smaller `site_size`")
        return layout

    @override
    def _announce(self, named: dict[str, torch.nn.Parameter], float_names: frozenset[str], world_size: int,
                  in_sites: bool = True, between_sites: bool = False) -> None:
        """Log (INFO, rank 0) the two exchanges: the inner one inside each site (``world_size``: the site's ranks)
        and the outer rounds between sites (:meth:`OuterRounds._announce_outer`)."""
        assert self.layout is not None
        if world_size > 1:
            super()._announce(named, float_names, world_size, in_sites=True)  # the inner DDP, inside each site
        else:
            log.info("diloco: sites of one rank: no exchange inside a site, each rank takes its inner steps alone")
        self._announce_outer({n: p.shape for n, p in named.items()}, float_names, self.layout.num_sites)

    @override
    def _on_hook_state(self, named: dict[str, torch.nn.Parameter]) -> None:
        assert self.groups is not None and self.comm_state is not None
        g = self.groups
        module = self.lightning_module
        assert module is not None
        fragments = strided_fragments(list(named), self.num_fragments)  # fragments > layers fails here, before step 1
        start_sites_from_rank0(module)
        # the site (not the rank) seeds the outer compressor: only leaders compress, one stream per site
        outer_state = self._outer_hook_state(named, self.comm_state.float_names, g.leader_group, g.layout.num_sites,
                                             g.site)
        exchange = LeaderExchange(outer_state, g, fragments, named, self.root_device)
        self._start_outer(named, [b for b in module.buffers() if b.is_floating_point()], g, exchange, fragments)


def warn_one_site(where: str, outer_optimizer: type, sync_every: int, fix: str) -> None:
    """Warn (rank 0) that a layout of one site sends nothing between sites (``where``: why there is one site)."""
    rank_zero_warn(
        f"Expected DiLoCo to run at least 2 sites, but {where}, so no outer "
        f"round sends anything between sites: the outer {outer_optimizer.__name__} steps this one "
        f"replica on its own pseudo-gradient every {sync_every} steps. Fix: run on more devices or "
        f"nodes (every rank is a site by default), or {fix}.",
        category=UserWarning,
    )


#: what ``"streaming_diloco"`` (and ``"sharded_streaming_diloco"``) set: the paper's defaults
STREAMING_PRESET: dict[str, Any] = {"fragments": 4, "sync_delay": 5, "mixing": 0.5}
STREAMING_DESCRIPTION = ("Streaming DiLoCo: 4 strided fragments at staggered steps, each exchange overlapped with 5 "
                         "inner steps, mixing 0.5")


def register(strategy_registry: Any = None) -> None:
    """Register ``"diloco"`` and ``"streaming_diloco"`` (and their fork-started ``*_notebook`` variants)."""
    registry.register_preset(
        "diloco", DiLoCoStrategy, "DiLoCo: H local steps per site, outer Nesterov SGD on averaged pseudo-gradients",
        strategy_registry,
    )
    registry.register_preset(
        "streaming_diloco",
        DiLoCoStrategy,
        STREAMING_DESCRIPTION,
        strategy_registry,
        **STREAMING_PRESET,
    )

