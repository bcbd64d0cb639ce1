"""The Gradient Synchronizer: between sites, significant accumulated updates, quantized, through the leaders.

It runs after every local optimizer step on every rank. All ranks of a site hold the same weights, optimizer
state and synchronizer state (each rank is a replica of the site's Local Parameter Server), so every rank
computes the same decisions without asking; only the leaders talk over the WAN.

State per layer (identical within a site): ``anchor``, the global weights agreed at the last WAN round
(identical on every rank of the world); ``hidden``, the part of the site's accumulated update that is not in
the site's weights. The site's accumulated update is ``g_u = hidden + (w - anchor)``.

A WAN round (all sites together):

1. each site takes the significant part of ``g_u`` (:class:`SignificanceFilter`) and runs the hook's exchange on it
   (:func:`~lightning_gradcomp.exchange.hook.gradcomp_hook`) with the WAN message as its compressor
   (:class:`~lightning_gradcomp.weightgrad.quantize.WanMessage`: per layer a scale and ternary values from
   :class:`~lightning_gradcomp.compressors.loss_aware.LossAwareTernary` with the optimizer's second moments, or
   :class:`~lightning_gradcomp.compressors.TernGrad`'s stochastic rounding at scale ``max|x|``, or fp32 values, in one
   variable-size message); the site keeps what it did not send (``g_u - sent``: insignificant parts and rounding
   error keep accumulating, as in Gaia);
2. the exchange's transport is the sites (:class:`~lightning_gradcomp.sites.transport.SiteLeadersTransport`): the
   leaders all-gather the messages over the WAN, then each leader broadcasts them inside its site over the LAN; the
   weights travel down as ternary weight updates with a per-layer scale;
3. every rank decodes all sites' messages in site order and moves ``anchor`` by their average (the Global
   Server's average), bit-identically everywhere;
4. ``site_view="global"``: every rank's weights become ``anchor`` (all sites identical after the round; the
   unsent part stays in ``hidden``). ``site_view="gaia"``: weights become ``anchor + unsent`` (a site keeps
   seeing its own unsent updates, as Gaia's data centers do; sites differ by what they have not sent).

On the outer-sync engine (:class:`~lightning_gradcomp.outer.engine.OuterSync`), WeightGrad is one configuration:
one fragment, the significance filter and the ternary WAN message as the exchange (this class implements the
engine's exchange protocol), the unsent part kept in ``hidden`` or in the weights (``site_view``), and an outer
SGD at learning rate 1 without momentum (the Global Server's plain average: ``anchor - 1 * mean(-g_u)`` is
``anchor + mean(g_u)`` bit for bit). Its rounds follow the staleness bound and triggers below instead of the
engine's fixed schedule.

Rounds happen when ``staleness_bound`` steps have passed since the last one, or earlier when any leader's
clock passed ``staleness_seconds`` or (``trigger="significance"``) any site has a significant update; those
two need a one-byte consensus among leaders every step. Collectives block: a site cannot apply another local
update until the round's global update has arrived, which is how the bound is enforced.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_gradcomp.compressors.loss_aware import LossAwareTernary
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.exchange.ledger import Ledger, tensor_bytes
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.sites.transport import SiteLeadersTransport
from lightning_gradcomp.outer.engine import OuterSync
from lightning_gradcomp.outer.exchange import FlatBucket, InFlight, sync_buffers
from lightning_gradcomp.weightgrad.quantize import Ternarizer, WanMessage
from lightning_gradcomp.weightgrad.significance import SignificanceFilter
from lightning_gradcomp.sites.layout import SiteGroups

WanQuantization = Literal["loss_aware", "terngrad", "none"]
SiteView = Literal["global", "gaia"]
Trigger = Literal["bound", "significance"]


class _Contribution(LayerTransform):
    """What a WAN round's message effectively sent of each layer (its own decode, which the group step computes for
    the transforms): the engine keeps ``g_u - sent``, so the message's compressor keeps no residual of its own."""

    applies_to_float = True

    def __init__(self) -> None:
        self.sent: dict[str, Tensor] = {}

    @override
    def after_compress(self, name: str, compressed_input: Tensor, sent: Tensor) -> None:
        self.sent[name] = sent


class GradientSynchronizer(OuterSync):
    """Two-level synchronization of one site with the others (see the module docstring).

    Args:
        params: the trainable parameters by name (the site's weights).
        buffers: module buffers (batch-norm statistics), copied from global rank 0 at every round.
        groups: this rank's sites and groups.
        significance: the significance filter with G_thresh.
        staleness_bound: T, the most local steps between two WAN rounds.
        staleness_seconds: optional bound in seconds since the last round (checked by every leader each step).
        trigger: ``"bound"``: rounds only at the bound; ``"significance"``: also as soon as any site has a
            significant update.
        flush_at_bound: whether a round forced by the bound sends the whole accumulated update, not only its
            significant part.
        wan_quantization: ``"loss_aware"``, ``"terngrad"`` or ``"none"``.
        site_view: ``"global"`` or ``"gaia"``.
        second_moment: parameter name -> the optimizer's second-moment estimate (e.g. Adam's ``exp_avg_sq``), or
            ``None`` when it has none (plain ternary).
        learning_rate: parameter name -> the learning rate of its optimizer group.
        seed: seed of the stochastic ternarization (one stream per site and layer, identical on the site's ranks).
        float_names: layers that cross the WAN unquantized (the strategy's ``exclude`` / ``min_numel``).
    """

    schedule_option = "staleness_bound"

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        buffers: Sequence[Tensor],
        groups: SiteGroups,
        significance: SignificanceFilter,
        staleness_bound: int,
        staleness_seconds: Optional[float],
        trigger: Trigger,
        flush_at_bound: bool,
        wan_quantization: WanQuantization,
        site_view: SiteView,
        second_moment: Callable[[str], Optional[Tensor]],
        learning_rate: Callable[[str], float],
        seed: int = 0,
        float_names: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(
            params,
            buffers,
            groups,
            exchange=self,
            # the Global Server's average: anchor - 1 * mean(delta), no momentum
            outer_optimizer=lambda anchors: torch.optim.SGD(anchors, lr=1.0),
            fragments=[sorted(params)],
            sync_every=staleness_bound,
            unsent=site_view,
        )
        self.float_names = float_names
        self.names = sorted(params)  # the same layer order on every rank
        self.significance = significance
        self.staleness_bound = staleness_bound
        self.staleness_seconds = staleness_seconds
        self.trigger = trigger
        self.flush_at_bound = flush_at_bound
        self.wan_quantization = wan_quantization
        self.site_view = site_view
        self.second_moment = second_moment
        self.learning_rate = learning_rate
        device = next(iter(params.values())).device
        # the WAN quantizer. TernGrad: no clipping (scale max|x|), each site's own scale in its message, per-name
        # counter-based streams; set up with the site as its rank, so a site's ranks draw the same bits (they are
        # replicas of the site) and sites draw different ones
        quantizer: Optional[Ternarizer] = None
        if wan_quantization == "terngrad":
            quantizer = TernGrad(clip_factor=0.0, scaler_share="per_worker", collective="allgather", seed=seed)
        elif wan_quantization == "loss_aware":
            quantizer = LossAwareTernary(second_moment=second_moment)
        #: the WAN message: the exchange's compressor, set up with the site as its rank among the sites
        self.message = WanMessage(quantizer, float_names)
        self.message.setup(groups.site, groups.layout.num_sites, device)
        self._contribution = _Contribution()
        #: the WAN round's exchange: the hook's, over the sites (every rank of a site runs it on the same data), its
        #: ledger counting the bytes between sites and the leaders' broadcasts inside them (channel ``"lan"``);
        #: no non-finite check of its own: the site's inner exchange checks every gradient
        self.transport = SiteLeadersTransport(groups)
        self.state = GradCompState(self.message, {id(p): n for n, p in params.items()}, transforms=[self._contribution],
                                   world_size=groups.layout.num_sites, nonfinite="ignore", transport=self.transport)
        self.transport.ledger = self.state.ledger
        self.bucket = FlatBucket(0, [params[n] for n in self.names], device)
        with torch.no_grad():
            self.last = {n: p.detach().clone() for n, p in params.items()}
        self._step_update: dict[str, Tensor] = {}
        self._flush = False
        self.steps_since_round = 0
        self._round_started = time.monotonic()

    # -- every step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def after_local_step(self) -> bool:
        """Observe the local update just applied; run a WAN round when one is due. Returns whether one ran."""
        for name in self.names:
            p = self.params[name]
            self._step_update[name] = p.detach() - self.last[name]
            self.last[name].copy_(p.detach())
            if p.grad is not None:
                self.significance.observe(name, p.grad, self.learning_rate(name))
        self.steps_since_round += 1
        self.inner_steps += 1  # the engine's step count: ``bytes_per_step`` averages over it
        lan_bytes = flag_bytes = 0

        at_bound = self.steps_since_round >= self.staleness_bound
        late = significant = False
        if self.staleness_seconds is not None or self.trigger == "significance":
            flags = torch.zeros(2, dtype=torch.uint8)
            if self.staleness_seconds is not None and self.groups.is_leader:
                flags[0] = int(time.monotonic() - self._round_started >= self.staleness_seconds)
            if self.trigger == "significance" and not at_bound:
                flags[1] = int(any(bool(self._mask(n).any()) for n in self.names))
            g = self.groups
            self.transport.max_(flags)
            late, significant = bool(flags[0]), bool(flags[1])
            if g.is_leader and g.layout.num_sites > 1:  # the flags crossed between sites
                flag_bytes = tensor_bytes(flags)
            lan_bytes += self.state.ledger.take_channel("lan")

        ran = at_bound or late or significant
        if ran:
            self._flush = self.flush_at_bound and (at_bound or late)
            self.start(0)
            self.finish(0)
            for name in self.names:
                self.last[name].copy_(self.params[name].detach())
            self.steps_since_round = 0
            self._round_started = time.monotonic()
            lan_bytes += int(self.stats["lan_bytes_per_round"])
        # recorded after the round, whose buffers' bytes between sites are taken from the same channel
        self.state.ledger.record_channel("wan", flag_bytes)
        self.close_step()
        self.stats.update(
            wan_bytes=torch.tensor(self.last_step_bytes()),
            round_lan_bytes=torch.tensor(lan_bytes),
            wan_rounds=torch.tensor(self.rounds),
            staleness=torch.tensor(self.steps_since_round),
        )
        for name in self.names:
            self.stats[f"g_thresh/{name}"] = self.significance.threshold_of(name).detach().clone()
        return ran

    def pending(self, name: str) -> Tensor:
        """The site's accumulated update ``g_u`` of a layer (weight units)."""
        return self.memory.compensate(self.params[name].detach() - self.anchor[name], name)

    def _mask(self, name: str) -> Tensor:
        return self.significance.mask(name, self.pending(name), self._step_update[name], self.anchor[name])

    @property
    def quantizer(self) -> Optional[Ternarizer]:
        """The WAN message's quantizer (``None``: ``wan_quantization="none"``)."""
        return self.message.quantizer

    # -- a WAN round: the engine's exchange ------------------------------------------------------------------
    def launch(self, fragment: int, pseudo_gradients: Sequence[Tensor], step: int) -> InFlight:
        """The engine's exchange: the significant part of ``g_u = -delta`` through the hook's exchange over the sites
        (quantized and encoded by :attr:`message`, all-gathered through the leaders, decoded and averaged in site
        order); blocking, so the result is complete on return."""
        g = self.groups
        for name, view, delta in zip(self.names, self.bucket.gradients(), pseudo_gradients):
            pending = -delta  # g_u, exactly: delta = (anchor - w) - hidden
            mask = torch.ones_like(pending, dtype=torch.bool) if self._flush else self._mask(name)
            self.stats[f"fraction_significant/{name}"] = mask.float().mean()
            view.copy_(pending).masked_fill_(~mask, 0.0)
        gradcomp_hook(self.state, self.bucket).wait()
        ledger = self.state.ledger
        means, sent = [], []
        for name, mean in zip(self.names, self.bucket.gradients()):
            p = self.params[name]
            # in pseudo-gradient units (negated exactly): the engine's SGD at lr 1 adds the mean update back
            means.append(mean.to(p.dtype).neg())
            sent.append(self._contribution.sent.pop(name).view_as(p).to(p.dtype).neg())
        # only the leaders' messages cross the WAN (every rank of a site encodes the same one)
        wan = ledger.bytes_of(self.names, 0, sizes=True) if g.is_leader and g.layout.num_sites > 1 else 0
        self.stats["wan_message_bytes"] = torch.tensor(ledger.bytes_of(self.names, 0))
        return InFlight(means, None, wan, ledger.take_channel("lan"), ledger.dense_bytes_per_step(), step, done=True,
                        sent=sent, deltas=list(pseudo_gradients))

    def wait(self, flight: InFlight) -> list[Tensor]:
        return flight.means

    def sync_buffers(self, buffers: Sequence[Tensor]) -> tuple[int, int]:
        return sync_buffers(buffers, self.transport)

    @property
    def ledger(self) -> Ledger:
        """Where the WAN rounds' and flags' bytes are recorded: the exchange's hook state's ledger."""
        return self.state.ledger

    def exchange_state(self) -> dict[str, Any]:
        return {"significance": self.significance.state_dict(), "quantizer": self.message.state_dict()}

    def load_exchange_state(self, state: dict[str, Any]) -> None:
        if "quantizer" not in state and self.wan_quantization == "terngrad":
            # the single stream of an older release cannot be split into TernGrad's per-layer streams, and starting
            # them afresh silently would make the resumed run differ from the uninterrupted one
            raise ValueError(
                f"Expected the WeightGrad checkpoint's exchange state to hold the quantizer's random streams but got "
                f"the keys {sorted(state)} (a checkpoint written before the WAN ternarization drew from TernGrad's "
                "streams). Fix: resume with resume_compression='reset', or with the version that wrote the checkpoint."
            )
        self.significance.load_state_dict(state["significance"])
        self.message.load_state_dict(state.get("quantizer", {}))

    # -- checkpointing ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-site state (identical on the ranks of a site): the engine's (the site's weights, since sites differ
        between WAN rounds and Lightning's checkpoint holds only rank 0's model; anchor; hidden), the significance
        filter and the stochastic stream, and the staleness counter. (Optimizer state is checkpointed per rank by
        the strategy.)"""
        return {**super().state_dict(), "steps_since_round": self.steps_since_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for n, p in self.params.items():
            self.last[n].copy_(p.detach())
        self.steps_since_round = state["steps_since_round"]
