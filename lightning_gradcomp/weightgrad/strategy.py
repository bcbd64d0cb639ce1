"""``WeightGradStrategy`` (``strategy="weightgrad"``): TernGrad inside each site, significant ternary updates between.

Inside a site (the LAN), every step: DDP over the site's process group, with the gradcomp hook exchanging
TernGrad ternary gradients (with TernGrad's local clipping, plus whatever layer transforms the strategy holds,
e.g. momentum correction) among the site's ranks only; then the local optimizer step, identical on every rank
of the site. Between sites (the WAN), after that step: the :class:`GradientSynchronizer`.

Where the WAN step runs: in :meth:`WeightGradStrategy.optimizer_step`, right after the local update. By then
DDP's backward (and every hook collective) has finished on all ranks, so the WAN collectives, issued from the
main thread in a fixed order on every rank, cannot interleave with the hook's; and the weights the next
forward sees already include the round's global update.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.strategies.strategy import SiteStrategy
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number
from lightning_gradcomp.weightgrad.significance import Rule, Scope, SignificanceFilter
from lightning_gradcomp.sites.layout import SiteLayout, site_layout, start_sites_from_rank0
from lightning_gradcomp.weightgrad.synchronizer import GradientSynchronizer, SiteView, Trigger, WanQuantization

log = logging.getLogger(__name__)

#: how a site applies its workers' gradients: one step with their average (Algorithm 3) or one per worker (Algorithm 4)
Aggregate = Literal["average", "serial"]


class GatheredFP32(Identity):
    """fp32 gradients all-gathered instead of summed, so each worker's gradient stays visible (serial mode)."""

    aggregation = Aggregation.GATHER


class WeightGradStrategy(SiteStrategy):
    """WeightGrad (Akter & Adnan, KDD 2020): two-level LAN/WAN training with ternary gradients and weights.

    Args:
        compressor: the in-site gradient compressor (default TernGrad with 2.5-sigma local clipping; ``"fp32"`` to
            switch in-site quantization off).
        site_size: ranks per site (all sites equal). With neither this nor ``site_sizes``, each node is a site.
        site_sizes: the size of each site, in global-rank order.
        allow_single_rank_sites: allow sites of one rank (no LAN exchange).
        staleness_bound: T: every site is synchronized with the others at least every T local steps.
        staleness_seconds: optionally also force a round when a leader has not had one for this many seconds.
        threshold: a fixed G_thresh; ``None`` (default) uses the dynamic rule (initial ``||g||_2/||g||_inf``,
            updated by Eq. 13); 0 makes every update significant.
        significance: ``"layer"`` (a whole layer is significant or not: ``||g_u||_2 / max|step| >= G``),
            ``"element"`` (per element: ``|g_u[k]| / max|step| >= G``) or ``"relative"`` (Gaia's filter,
            ``|g_u[k]| >= G * |w[k]|``, G starting at 1%).
        threshold_momentum: m of the momentum-correction velocity whose norm change drives Eq. 13.
        threshold_rule: ``"capped"`` (Eq. 13, but G never rises above its initial value) or ``"eq13"`` (literal).
        trigger: ``"bound"``: WAN rounds every ``staleness_bound`` steps; ``"significance"``: also as soon as any
            site has a significant update (costs a one-byte WAN consensus each step).
        flush_at_bound: send the whole accumulated update (not only its significant part) at rounds forced by
            the bound.
        aggregation: ``"average"`` (Algorithm 3: one step with the site's average gradient) or ``"serial"``
            (Algorithm 4: one optimizer step per worker's gradient, in site-rank order, each at the full LR).
        wan_quantization: what crosses the WAN and comes down to the workers: ``"loss_aware"`` (ternary weight
            updates with a per-layer scale, loss-aware with the optimizer's second moments when it has them,
            e.g. Adam's ``exp_avg_sq``, plain ternary otherwise), ``"terngrad"`` (unbiased stochastic ternary) or
            ``"none"`` (fp32).
        site_view: ``"global"``: after a round every site's weights are the global weights (sites identical);
            ``"gaia"``: a site also keeps its own not-yet-sent updates in its weights.
        seed: seed of the WAN's stochastic ternarization.
        **kwargs: :class:`~lightning_gradcomp.GradCompStrategy` arguments (``exclude``, ``min_numel``: those layers
            stay fp32 both inside the site and over the WAN; DDP options).
    """

    strategy_name = "weightgrad"
    # sites step their optimizers apart between WAN rounds: momentum and Adam moments differ per site
    per_rank_optimizer_state = True
    # a non-finite step is skipped (or raised) by every site alike, not by the site that saw it only
    nonfinite_across_sites = True

    def __init__(
        self,
        compressor: Union[Compressor, str] = "terngrad",
        site_size: Optional[int] = None,
        site_sizes: Optional[Sequence[int]] = None,
        allow_single_rank_sites: bool = False,
        staleness_bound: int = 4,
        staleness_seconds: Optional[float] = None,
        threshold: Optional[float] = None,
        significance: Scope = "layer",
        threshold_momentum: float = 0.9,
        threshold_rule: Rule = "capped",
        trigger: Trigger = "bound",
        flush_at_bound: bool = False,
        aggregation: Aggregate = "average",
        wan_quantization: WanQuantization = "loss_aware",
        site_view: SiteView = "global",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        self._init_sites(site_size, site_sizes)
        check_int("staleness_bound", staleness_bound, minimum=1, fix="T counts local steps between WAN rounds; use 1 to sync every step")
        if staleness_seconds is not None:
            check_number("staleness_seconds", staleness_seconds, minimum=0.0, min_open=True, fix="use None for no time bound")
        if threshold is not None:
            check_number("threshold", threshold, minimum=0.0, fix="use None for the dynamic G_thresh, 0 to send everything")
        check_choice("significance", significance, ("layer", "element", "relative"))
        check_number("threshold_momentum", threshold_momentum, minimum=0.0, maximum=1.0, max_open=True, fix="use 0.9 (DGC)")
        check_choice("threshold_rule", threshold_rule, ("capped", "eq13"))
        check_choice("trigger", trigger, ("bound", "significance"))
        check_choice("aggregation", aggregation, ("average", "serial"))
        check_choice("wan_quantization", wan_quantization, ("loss_aware", "terngrad", "none"))
        check_choice("site_view", site_view, ("global", "gaia"))
        check_int("seed", seed, minimum=0)
        check_bool("allow_single_rank_sites", allow_single_rank_sites)
        check_bool("flush_at_bound", flush_at_bound)
        super().__init__(compressor=compressor, **kwargs)
        if aggregation == "serial" and type(self.compressor) is Identity:
            self.compressor = GatheredFP32()
        self.allow_single_rank_sites = allow_single_rank_sites
        self.staleness_bound = staleness_bound
        self.staleness_seconds = None if staleness_seconds is None else float(staleness_seconds)
        self.threshold = None if threshold is None else float(threshold)
        self.significance = significance
        self.threshold_momentum = float(threshold_momentum)
        self.threshold_rule = threshold_rule
        self.trigger = trigger
        self.flush_at_bound = flush_at_bound
        self.aggregation = aggregation
        self.wan_quantization = wan_quantization
        self.site_view = site_view
        self.seed = seed
        self.synchronizer: Optional[GradientSynchronizer] = None
        self._groups_by_param: Optional[dict[int, int]] = None
        #: monitor statistics of the latest step (tensors): ``lan_bytes``, ``wan_bytes``, ``wan_rounds``,
        #: ``staleness``, ``fraction_significant/<layer>``, ``g_thresh/<layer>``
        self.stats: dict[str, Tensor] = {}

    # -- sites and groups -------------------------------------------------------------------------------
    @override
    def make_layout(self, world_size: int) -> SiteLayout:
        """The site layout for ``world_size`` ranks (validates; raises ``ValueError`` on a bad configuration).

        Warns when the layout is one site: WeightGrad's WAN rounds then never run and training is plain in-site
        TernGrad, which is what a single node gets by default (one site per node).
        """
        layout = site_layout(
            world_size,
            num_nodes=self.num_nodes,
            site_size=self.site_size,
            site_sizes=self.site_sizes,
            allow_single_rank_sites=self.allow_single_rank_sites,
        )
        if len(layout.sizes) == 1:
            rank_zero_warn(
                f"Expected WeightGrad to run at least 2 sites, but its {world_size} ranks form one site "
                f"({'site_sizes' if self.site_sizes else 'site_size' if self.site_size else 'one site per node'}), "
                f"so no WAN round will ever run. Fix: set `site_size` (e.g. site_size={max(1, world_size // 2)}) or "
                f"`site_sizes` to emulate several sites on this node, or run on several nodes.",
                category=UserWarning,
            )
        return layout

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the layout, the site groups, DDP inside the site
        assert self.groups is not None

    @override
    def _site_hook_fields(self) -> dict[str, Any]:
        serial = self.aggregation == "serial"
        return dict(identity=GatheredFP32() if serial else Identity(), keep_per_rank=serial)

    @override
    def _announce(self, named: dict[str, torch.nn.Parameter], float_names: frozenset[str], world_size: int,
                  in_sites: bool = False, between_sites: bool = False) -> None:
        """The in-site exchange's setup line, then what crosses between sites: what :meth:`bytes_per_step` counts."""
        super()._announce(named, float_names, world_size, in_sites=in_sites, between_sites=between_sites)
        assert self.layout is not None
        if self.layout.num_sites == 1:
            log.info("weightgrad: one site: nothing crosses between sites, so bytes_per_step() is 0; the in-site "
                     "exchange's bytes are the monitor's lan_bytes")
        else:
            log.info("weightgrad: WAN rounds between %d sites, at most %d local steps apart: their bytes follow the "
                     "significance filter; bytes_per_step() averages this rank's bytes between sites over the run",
                     self.layout.num_sites, self.staleness_bound)

    @override
    def _on_hook_state(self, named: dict[str, torch.nn.Parameter]) -> None:
        assert self.groups is not None and self.comm_state is not None
        # the compressor is set up for its site by now: its aggregation is the one it travels with there
        if self.aggregation == "serial" and self.compressor.aggregation is not Aggregation.GATHER:
            raise ValueError(
                f"Expected a compressor whose packets are gathered for `aggregation='serial'` (each worker's gradient is "
                f"applied on its own), but {type(self.compressor).__name__} sums them in a site of "
                f"{self.groups.site_size}. Fix: use `TernGrad(collective='allgather')`, or `aggregation='average'`."
            )
        module = self.lightning_module
        assert module is not None
        g = self.groups
        start_sites_from_rank0(module)
        self.synchronizer = GradientSynchronizer(
            params=named,
            buffers=[b for b in module.buffers() if b.is_floating_point()],
            groups=g,
            significance=SignificanceFilter(
                self.threshold, self.significance, self.threshold_momentum, self.threshold_rule
            ),
            staleness_bound=self.staleness_bound,
            staleness_seconds=self.staleness_seconds,
            trigger=self.trigger,
            flush_at_bound=self.flush_at_bound,
            wan_quantization=self.wan_quantization,
            site_view=self.site_view,
            second_moment=self._second_moment,
            learning_rate=self._learning_rate,
            seed=self.seed,
            float_names=self.comm_state.float_names,
        )
        # the synchronizer's accumulators, staleness counter and G_thresh are training state: checkpointed per rank
        self.comm_state.attach("weightgrad", self.synchronizer)
        log.info(
            "weightgrad: rank %d in site %d of %s (leader %d), in-site %s",
            self.global_rank,
            g.site,
            list(g.layout.sizes),
            g.leader,
            self.compressor.describe(),
        )

    # -- optimizer access (by parameter name) -----------------------------------------------------------
    def _optimizer(self) -> Optimizer:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"Expected exactly one optimizer with strategy='weightgrad', but got {len(self.optimizers)}. "
                f"Fix: return a single optimizer from `configure_optimizers`."
            )
        opt = self.optimizers[0]
        return opt.optimizer if isinstance(opt, LightningOptimizer) else opt

    def _param_group(self, name: str) -> dict[str, Any]:
        assert self.synchronizer is not None
        groups = self._optimizer().param_groups
        if self._groups_by_param is None:
            self._groups_by_param = {id(p): i for i, group in enumerate(groups) for p in group["params"]}
        return groups[self._groups_by_param.get(id(self.synchronizer.params[name]), 0)]

    def _learning_rate(self, name: str) -> float:
        return float(self._param_group(name)["lr"])

    def _second_moment(self, name: str) -> Optional[Tensor]:
        assert self.synchronizer is not None
        state = self._optimizer().state.get(self.synchronizer.params[name], {})
        v = state.get("exp_avg_sq")
        return v if isinstance(v, Tensor) else None

    # -- the step ---------------------------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        self._optimizer()  # one optimizer, checked on the first step before anything moves
        if self.aggregation == "serial":
            output = self._serial_step(optimizer, closure, model, **kwargs)
        else:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.synchronizer is not None and self.comm_state is not None
        self.synchronizer.after_local_step()
        self._check_landed_rounds(
            self.synchronizer, f"{'global weights' if self.site_view == 'gaia' else 'weights'} right after a WAN round")
        self._update_stats()
        return output

    def _serial_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Any], **kwargs: Any) -> Any:
        """Algorithm 4: the site applies each worker's gradient in turn (one optimizer step each)."""
        assert self.comm_state is not None and self.comm_state.ledger.per_rank is not None and self.synchronizer is not None
        per_rank = self.comm_state.ledger.per_rank
        params = self.synchronizer.params
        averages: dict[str, Tensor] = {}

        def first_worker() -> Any:
            result = closure()  # forward + backward: the hook fills per_rank
            for name, grads in per_rank.items():
                grad = params[name].grad
                if grad is not None:
                    averages[name] = grad.clone()
                    grad.copy_(grads[0])
            return result

        output = super().optimizer_step(optimizer, first_worker, model, **kwargs)
        for i in range(1, self.groups.site_size if self.groups else 1):
            for name in averages:
                params[name].grad.copy_(per_rank[name][i])  # type: ignore[union-attr]
            optimizer.step()
        for name, grad in averages.items():  # the site average, for the threshold's statistics
            params[name].grad.copy_(grad)  # type: ignore[union-attr]
        return output

    def _update_stats(self) -> None:
        assert self.synchronizer is not None and self.comm_state is not None
        sync = self.synchronizer.stats
        hook_bytes = self.comm_state.last_step_bytes() if self.groups and self.groups.site_size > 1 else 0
        self.stats = dict(sync)
        self.stats["lan_bytes"] = torch.tensor(hook_bytes) + sync["round_lan_bytes"]

    @override
    def bytes_per_step(self) -> int:
        """Bytes this rank put between sites (WAN rounds and their consensus flags) per local step, averaged over the
        run so far (:class:`~lightning_gradcomp.exchange.ledger.ByteReport`); 0 with one site, where nothing crosses
        between sites. The in-site exchange's bytes are the monitor's ``lan_bytes``."""
        return 0 if self.synchronizer is None else self.synchronizer.bytes_per_step()

    @override
    def last_step_bytes(self) -> int:
        """Bytes this rank put between sites in the latest local step (its WAN round and flags, if any)."""
        return 0 if self.synchronizer is None else self.synchronizer.last_step_bytes()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(strategy_registry)


def register(strategy_registry: Any = None) -> None:
    """Register ``strategy="weightgrad"`` (and its fork-started ``"weightgrad_notebook"``) in Lightning's ``StrategyRegistry``."""
    from lightning_gradcomp.registry import register_preset

    description = "WeightGrad: TernGrad inside each site, significant ternary updates between sites (KDD 2020)"
    register_preset("weightgrad", WeightGradStrategy, description, strategy_registry)
