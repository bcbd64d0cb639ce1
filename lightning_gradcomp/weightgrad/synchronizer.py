"""The Gradient Synchronizer: between sites, significant accumulated updates, quantized, through the leaders.

It runs after every local optimizer step on every rank. All ranks of a site hold the same weights, optimizer
state and synchronizer state (each rank is a replica of the site's Local Parameter Server), so every rank
computes the same decisions without asking; only the leaders talk over the WAN.

State per layer (identical within a site): ``anchor``, the global weights agreed at the last WAN round
(identical on every rank of the world); ``hidden``, the part of the site's accumulated update that is not in
the site's weights. The site's accumulated update is ``g_u = hidden + (w - anchor)``.

A WAN round (all sites together):

1. each site takes the significant part of ``g_u`` (:class:`SignificanceFilter`), ternarizes it with a per-layer
   scale (loss-aware with the optimizer's second moments, or TernGrad's stochastic rounding, or not at all),
   encodes it (:mod:`~lightning_gradcomp.weightgrad.quantize`) and keeps what it did not send (``g_u - sent``:
   insignificant parts and rounding error keep accumulating, as in Gaia);
2. leaders all-gather the messages over the WAN, then each leader broadcasts them inside its site over the
   LAN: the weights travel down as ternary weight updates with a per-layer scale;
3. every rank decodes all sites' messages in site order and moves ``anchor`` by their average (the Global
   Server's average), bit-identically everywhere;
4. ``site_view="global"``: every rank's weights become ``anchor`` (all sites identical after the round; the
   unsent part stays in ``hidden``). ``site_view="gaia"``: weights become ``anchor + unsent`` (a site keeps
   seeing its own unsent updates, as Gaia's data centers do; sites differ by what they have not sent).

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

from lightning_gradcomp import comm
from lightning_gradcomp.weightgrad import quantize
from lightning_gradcomp.weightgrad.significance import SignificanceFilter
from lightning_gradcomp.weightgrad.sites import SiteGroups

WanQuantization = Literal["loss_aware", "terngrad", "none"]
SiteView = Literal["global", "gaia"]
Trigger = Literal["bound", "significance"]

# LAQ code: D = sqrt(v) + 1e-8
_LAQ_EPS = 1e-8


class GradientSynchronizer:
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
        seed: seed of the stochastic ternarization (one stream per site, identical on the site's ranks).
        float_names: layers that cross the WAN unquantized (the strategy's ``exclude`` / ``min_numel``).
    """

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
        self.params = params
        self.float_names = float_names
        self.names = sorted(params)  # the same layer order on every rank
        self.buffers = list(buffers)
        self.groups = groups
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
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed * 1_000_003 + 7919 * groups.site)
        with torch.no_grad():
            self.anchor = {n: p.detach().clone() for n, p in params.items()}
            self.last = {n: p.detach().clone() for n, p in params.items()}
        self.hidden: dict[str, Tensor] = {}
        self._step_update: dict[str, Tensor] = {}
        self.steps_since_round = 0
        self.rounds = 0
        self._round_started = time.monotonic()
        #: statistics of the latest step, as tensors (bytes this rank sent in the WAN step, rounds, staleness, ...)
        self.stats: dict[str, Tensor] = {}

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
        wan_bytes = lan_bytes = 0

        at_bound = self.steps_since_round >= self.staleness_bound
        late = significant = False
        if self.staleness_seconds is not None or self.trigger == "significance":
            flags = torch.zeros(2, dtype=torch.uint8)
            if self.staleness_seconds is not None and self.groups.is_leader:
                flags[0] = int(time.monotonic() - self._round_started >= self.staleness_seconds)
            if self.trigger == "significance" and not at_bound:
                flags[1] = int(any(bool(self._mask(n).any()) for n in self.names))
            g = self.groups
            comm.hierarchical_all_reduce_max_(flags, g.leader_group, g.site_group, g.leader, g.site_size)
            late, significant = bool(flags[0]), bool(flags[1])
            wan_bytes += flags.numel() if g.is_leader and g.layout.num_sites > 1 else 0
            lan_bytes += flags.numel() if g.is_leader and g.site_size > 1 else 0

        ran = at_bound or late or significant
        if ran:
            round_wan, round_lan = self._round(flush=self.flush_at_bound and (at_bound or late))
            wan_bytes += round_wan
            lan_bytes += round_lan
        self.stats.update(
            wan_bytes=torch.tensor(wan_bytes),
            round_lan_bytes=torch.tensor(lan_bytes),
            wan_rounds=torch.tensor(self.rounds),
            staleness=torch.tensor(self.steps_since_round),
        )
        for name in self.names:
            self.stats[f"g_thresh/{name}"] = self.significance.threshold_of(name).detach().clone()
        return ran

    def pending(self, name: str) -> Tensor:
        """The site's accumulated update ``g_u`` of a layer (weight units)."""
        p = self.params[name].detach()
        out = p - self.anchor[name]
        hidden = self.hidden.get(name)
        return out if hidden is None else out + hidden

    def _mask(self, name: str) -> Tensor:
        return self.significance.mask(name, self.pending(name), self._step_update[name], self.anchor[name])

    # -- a WAN round ------------------------------------------------------------------------------------
    def _quantize(self, name: str, x: Tensor) -> tuple[Optional[Tensor], Tensor]:
        if self.wan_quantization == "none" or name in self.float_names:
            return None, x.float()
        if self.wan_quantization == "terngrad":
            return quantize.stochastic_ternary(x, self._generator)
        v = self.second_moment(name)
        d = None if v is None else v.detach().float().sqrt().add_(_LAQ_EPS)
        return quantize.loss_aware_ternary(x, d)

    def _round(self, flush: bool) -> tuple[int, int]:
        g = self.groups
        pendings, layers = [], []
        for name in self.names:
            pending = self.pending(name)
            mask = torch.ones_like(pending, dtype=torch.bool) if flush else self._mask(name)
            self.stats[f"fraction_significant/{name}"] = mask.float().mean()
            pendings.append(pending)
            layers.append(self._quantize(name, torch.where(mask, pending, torch.zeros_like(pending))))
        message = quantize.encode(layers)
        num_sites = g.layout.num_sites
        sizes, gathered = comm.hierarchical_all_gather_bytes(
            message, g.leader_group, g.site_group, g.leader, num_sites, g.site_size
        )
        numels = [self.params[n].numel() for n in self.names]
        decoded = [quantize.decode(gathered[s, : int(sizes[s])], numels) for s in range(num_sites)]
        for i, name in enumerate(self.names):
            p = self.params[name]
            total = decoded[0][i].clone()
            for s in range(1, num_sites):
                total.add_(decoded[s][i])
            delta = total.div_(num_sites).view_as(p).to(p.dtype)
            unsent = pendings[i] - decoded[g.site][i].view_as(p).to(p.dtype)
            self.anchor[name].add_(delta)
            if self.site_view == "global":
                p.copy_(self.anchor[name])
                self.hidden[name] = unsent
            else:
                p.copy_(self.anchor[name] + unsent)
                self.hidden.pop(name, None)
            self.last[name].copy_(p.detach())
        buffer_bytes = 0
        if self.buffers:
            flat = torch.cat([b.detach().reshape(-1).float() for b in self.buffers])
            comm.hierarchical_broadcast_(flat, g.layout.leaders[0], g.leader_group, g.site_group, g.leader, g.site_size)
            offset = 0
            for b in self.buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b).to(b.dtype))
                offset += b.numel()
            buffer_bytes = flat.numel() * flat.element_size()
        self.rounds += 1
        self.steps_since_round = 0
        self._round_started = time.monotonic()
        wan = lan = 0
        if g.is_leader and num_sites > 1:
            # own message + its size; the buffers leave site 0's leader only
            wan = message.numel() + 8 + (buffer_bytes if g.site == 0 else 0)
        if g.is_leader and g.site_size > 1:
            lan = 8 * num_sites + gathered.numel() + buffer_bytes
        self.stats["wan_message_bytes"] = torch.tensor(message.numel())
        return wan, lan

    # -- checkpointing ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-site state (identical on the ranks of a site).

        Includes the site's current weights: between WAN rounds sites differ, and Lightning's checkpoint holds
        only rank 0's model. (Optimizer state is still rank 0's: with optimizer momentum, a resumed site other
        than site 0 restarts from site 0's buffers.)
        """
        return {
            "params": {k: p.detach().cpu().clone() for k, p in self.params.items()},
            "anchor": {k: v.detach().cpu().clone() for k, v in self.anchor.items()},
            "hidden": {k: v.detach().cpu().clone() for k, v in self.hidden.items()},
            "steps_since_round": self.steps_since_round,
            "rounds": self.rounds,
            "significance": self.significance.state_dict(),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in state.get("params", {}).items():
                self.params[k].copy_(v)
        for k, v in state["anchor"].items():
            self.anchor[k].copy_(v)
        self.hidden = {k: v.to(self.anchor[k].device) for k, v in state["hidden"].items()}
        for n, p in self.params.items():
            self.last[n].copy_(p.detach())
        self.steps_since_round = state["steps_since_round"]
        self.rounds = state["rounds"]
        self.significance.load_state_dict(state["significance"])
        self._generator.set_state(state["generator"])
