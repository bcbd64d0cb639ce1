"""The outer-sync engine: anchor, pseudo-gradients, an outer optimizer, fragments on a staggered schedule.

DiLoCo (Douillard et al., arXiv 2311.08105), per outer round and site (a site: one or more ranks training one
replica with DDP inside):

1. the pseudo-gradient ``delta = anchor - theta`` (``anchor``: the global weights agreed at the last round;
   ``theta``: this site's weights after ``H`` inner optimizer steps);
2. the mean of ``delta`` over sites, compressed by any compressor (:class:`~lightning_gradcomp.outer.exchange.LeaderExchange`);
3. the outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9 in DiLoCo) steps ``anchor`` with that mean as its
   gradient; identical on every rank of the world, since every rank feeds it the same bits;
4. ``theta <- mixing * theta + (1 - mixing) * anchor`` (``mixing = 0``: every site continues from the global
   weights, DiLoCo; Streaming DiLoCo's ``alpha`` keeps part of the local progress made while the exchange ran).

Streaming DiLoCo (arXiv 2501.18512) splits the parameters into fragments synced at staggered steps
(:mod:`~lightning_gradcomp.outer.fragments`) and overlaps each exchange with ``sync_delay`` (``tau``) further inner
steps: the pseudo-gradient is taken at the fragment's sync step, its exchange launched asynchronously, and the
result applied ``tau`` steps later. Every collective is still issued from the main thread in the same order on
every rank, because the schedule depends only on the step count.

State kept per fragment of the model: ``anchor`` and the outer optimizer's state (momentum) on
``state_device`` (``"cpu"`` keeps them off the accelerator: two extra copies of the model is the usual memory
complaint about DiLoCo), and the outer exchange's error feedback (residual memory of the outer hook state).
"""

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, Literal, Optional, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.outer.exchange import InFlight
from lightning_gradcomp.outer.fragments import due, sync_offset
from lightning_gradcomp.sites.layout import SiteGroups
from lightning_gradcomp.exchange.ledger import Ledger, RunBytes, dense_bytes
from lightning_gradcomp.exchange.memory import ResidualMemory


UnsentView = Literal["global", "gaia"]


class OuterExchange(Protocol):
    """What the engine needs of an exchange (:class:`LeaderExchange`; WeightGrad's WAN message exchange)."""

    def launch(self, fragment: int, pseudo_gradients: Sequence[Tensor], step: int) -> InFlight: ...

    def wait(self, flight: InFlight) -> list[Tensor]: ...

    def sync_buffers(self, buffers: Sequence[Tensor]) -> tuple[int, int]: ...

    def exchange_state(self) -> dict[str, Any]: ...

    def load_exchange_state(self, state: dict[str, Any]) -> None: ...

    @property
    def ledger(self) -> Ledger:
        """Where the exchange records the bytes it puts on each link."""
        ...


class OuterSync:
    """Runs the outer rounds of one site (see the module docstring).

    Args:
        params: the trainable parameters by name (this site's weights ``theta``), or under FSDP2 this rank's shard
            of each (a mapping that returns the live local tensor at every lookup: the engine only reads and writes
            them in place).
        buffers: floating-point module buffers (batch-norm statistics), copied from global rank 0 at every round
            of fragment 0.
        groups: this rank's sites and groups.
        exchange: averages a fragment's pseudo-gradients over sites.
        outer_optimizer: builds the outer optimizer over the anchor tensors.
        fragments: the parameter names of each fragment (one fragment: DiLoCo).
        sync_every: H, inner steps between two syncs of a fragment.
        sync_delay: tau, inner steps between a fragment's launch and its application (0: blocking, DiLoCo).
        mixing: alpha, the share of the local weights kept when a fragment is applied (0: the global weights).
        state_device: where ``anchor`` and the outer optimizer's state live (``None``: beside the parameters).
        unsent: for exchanges that report what they sent (WeightGrad): where the unsent part of a site's update
            goes: ``"global"`` into ``hidden`` (added to the next pseudo-gradient; the weights become the global
            ones), ``"gaia"`` into the site's weights; ``None``: the exchange keeps its own error feedback.
    """

    #: the user-facing name of ``sync_every``, for messages (WeightGrad's schedule is its ``staleness_bound``)
    schedule_option = "sync_every"

    def __init__(
        self,
        params: Mapping[str, Tensor],
        buffers: Sequence[Tensor],
        groups: SiteGroups,
        exchange: OuterExchange,
        outer_optimizer: Callable[[list[Tensor]], Optimizer],
        fragments: Sequence[Sequence[str]],
        sync_every: int,
        sync_delay: int = 0,
        mixing: float = 0.0,
        state_device: Optional[torch.device] = None,
        unsent: Optional[UnsentView] = None,
    ) -> None:
        self.params = params
        self.buffers = list(buffers)
        self.groups = groups
        self.exchange = exchange
        self.fragments = [list(f) for f in fragments]
        self.sync_every = sync_every
        self.sync_delay = sync_delay
        self.mixing = mixing
        self.unsent = unsent
        with torch.no_grad():
            # leaf tensors the outer optimizer steps; their .grad is set to the averaged pseudo-gradient
            self.anchor = {n: p.detach().to(state_device or p.device, copy=True) for n, p in params.items()}
        self.outer_optimizer = outer_optimizer([self.anchor[n] for n in sorted(self.anchor)])
        #: the part of a site's update not yet in the global weights nor in its own (``unsent="global"``), by name:
        #: the hook's error feedback in update units (``theta - anchor``), ``residual = g_u - sent``
        self.memory = ResidualMemory()
        self.inner_steps = 0
        self.rounds = 0
        self.tokens = 0
        self._in_flight: dict[int, InFlight] = {}
        self._launched_at: dict[int, float] = {}
        self._last_sync = [0] * len(self.fragments)
        #: fragments applied since :meth:`take_landed` last looked
        self.landed: list[int] = []
        #: statistics of the latest step, as tensors (for ``CompressionMonitor`` and ``bytes_per_step``)
        self.stats: dict[str, Tensor] = {}

    @property
    def hidden(self) -> MutableMapping[str, Tensor]:
        """The unsent part of this site's update by name (:attr:`memory`'s residuals; empty unless ``unsent="global"``)."""
        return self.memory.residuals

    # -- every inner step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def after_inner_step(self, tokens: int = 0) -> None:
        """Count one inner step (``tokens`` processed by this rank); apply and launch the fragments now due."""
        self.inner_steps += 1
        self.tokens += tokens
        step = self.inner_steps
        for f in range(len(self.fragments)):
            flight = self._in_flight.get(f)
            if flight is not None and step - flight.launch_step >= self.sync_delay:
                self.finish(f)
            if due(step, sync_offset(f, len(self.fragments), self.sync_every), self.sync_every):
                self.start(f)
                if self.sync_delay == 0:
                    self.finish(f)
        self.stats["inner_steps_since_sync"] = torch.tensor(step - max(self._last_sync))
        self.stats["rounds"] = torch.tensor(self.rounds)
        self.close_step()
        if self.tokens:
            self.stats["bytes_per_token"] = torch.tensor(self.wan_bytes_total / self.tokens)

    def close_step(self) -> None:
        """The inner step is over: what the exchange recorded on its ledger's ``"wan"`` channel outside the rounds
        (WeightGrad's trigger flags) joins the step's rounds there, the step's bytes between sites
        (:meth:`~lightning_gradcomp.exchange.ledger.Ledger.close_link_step`)."""
        self.exchange.ledger.close_link_step("wan")

    @property
    def wan(self) -> RunBytes:
        """What this rank put on the link between sites, inner step by inner step: the exchange's ledger keeps it
        (read-only here)."""
        return self.exchange.ledger.link_run("wan")

    @property
    def wan_bytes_total(self) -> int:
        """Every byte this rank put on the link between sites so far."""
        return self.wan.total

    def pseudo_gradient(self, name: str) -> Tensor:
        """DiLoCo's ``delta = anchor - theta`` of one parameter, less ``hidden`` (what the site has not sent yet):
        exactly the negated accumulated update ``g_u`` of WeightGrad (float32, on the parameter's device)."""
        p = self.params[name].detach()
        delta = self.anchor[name].to(p.device, torch.float32) - p.float()
        hidden = self.hidden.get(name)
        return delta if hidden is None else delta - hidden

    @torch.no_grad()
    def start(self, f: int) -> InFlight:
        """Take fragment ``f``'s pseudo-gradients now and start their exchange."""
        names = self.fragments[f]
        deltas = [self.pseudo_gradient(n) for n in names]
        self.stats[f"pseudo_gradient_norm/fragment_{f}"] = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(d) for d in deltas])
        )  # stays on the device: read by the monitor at its logging steps only
        flight = self.exchange.launch(f, deltas, self.inner_steps)
        self._in_flight[f] = flight
        self._launched_at[f] = time.monotonic()
        return flight

    @torch.no_grad()
    def finish(self, f: int, mixing: Optional[float] = None) -> InFlight:
        """Wait for fragment ``f``'s exchange; step the anchor with the mean; move this site's weights
        (``mixing``: the share of them kept, default the engine's)."""
        mixing = self.mixing if mixing is None else mixing
        flight = self._in_flight.pop(f)
        means = self.exchange.wait(flight)
        names = self.fragments[f]
        for name, mean in zip(names, means):
            anchor = self.anchor[name]
            anchor.grad = mean.to(anchor.device, anchor.dtype)
        self.outer_optimizer.step()  # parameters without a gradient (other fragments) are skipped
        for i, name in enumerate(names):
            p = self.params[name]
            self.anchor[name].grad = None
            new = self.anchor[name].to(p.device, p.dtype)
            if self.unsent is not None and flight.sent is not None and flight.deltas is not None:
                # in update units (theta - anchor, g_u = -delta): what this site did not send
                if self.unsent == "global":
                    p.copy_(new)
                    self.memory.update(name, flight.deltas[i].neg(), flight.sent[i].neg())
                else:
                    p.copy_(new + (flight.sent[i] - flight.deltas[i]).to(p.dtype))
                    self.hidden.pop(name, None)
            elif mixing == 0.0:
                p.copy_(new)
            else:
                p.lerp_(new, 1.0 - mixing)
        wan, lan = flight.wan_bytes, flight.lan_bytes
        if f == 0:
            buffer_wan, buffer_lan = self.exchange.sync_buffers(self.buffers)
            wan, lan = wan + buffer_wan, lan + buffer_lan
        self.rounds += 1
        self._last_sync[f] = self.inner_steps
        self.landed.append(f)
        self.exchange.ledger.record_link("wan", wan)
        self.stats["bytes_per_round"] = torch.tensor(wan)
        self.stats["lan_bytes_per_round"] = torch.tensor(lan)
        self.stats["compression_ratio"] = torch.tensor(flight.dense_bytes / max(1, flight.wan_bytes))
        self.stats[f"sync_seconds/fragment_{f}"] = torch.tensor(time.monotonic() - self._launched_at.pop(f, time.monotonic()))
        return flight

    @torch.no_grad()
    def final_round(self) -> list[int]:
        """End of training: every rank to the global weights, so that all replicas leave training identical.

        An exchange in flight lands as usual; then each fragment whose site weights may differ from the global ones
        (local steps since its last round, or a share of them kept by ``mixing``) has one more blocking round,
        applied without mixing. A fragment synced at the last step with ``mixing = 0`` has nothing to send. The
        choice depends only on the step count and the configuration, so every rank takes part in the same rounds.

        Returns:
            The fragments that had a final round.
        """
        for f in sorted(self._in_flight):
            self.finish(f)
        final = [f for f in range(len(self.fragments)) if self.inner_steps > self._last_sync[f] or self.mixing > 0]
        for f in final:
            self.start(f)
            self.finish(f, mixing=0.0)
        self.exchange.ledger.fold_link_step("wan")  # after the last inner step: its rounds count in that step
        self.stats["inner_steps_since_sync"] = torch.tensor(0)
        self.stats["rounds"] = torch.tensor(self.rounds)
        return final

    def agreed(self, fragments: Sequence[int]) -> tuple[list[str], list[Tensor]]:
        """What every rank of the world holds identically right after ``fragments`` landed, by name: the sites'
        weights where a landing takes the global weights (``mixing = 0``, ``unsent`` not ``"gaia"``), else only the
        global weights (anchor; a site keeps part of its own weights). On the parameters' device."""
        names = [n for f in fragments for n in self.fragments[f]]
        own = self.mixing == 0.0 and self.unsent != "gaia"
        return names, [self.params[n] if own else self.anchor[n].to(self.params[n].device) for n in names]

    def take_landed(self) -> list[int]:
        """The fragments applied since the last call (for checks that must run right after a round)."""
        landed, self.landed = self.landed, []
        return landed

    def bytes_per_step(self) -> int:
        """Bytes this rank put on the link between sites per inner step, averaged over the run so far (floored:
        :meth:`~lightning_gradcomp.exchange.ledger.RunBytes.mean`)."""
        return self.wan.mean()

    def last_step_bytes(self) -> int:
        """Bytes this rank put on the link between sites in the latest inner step (its rounds and flags)."""
        return self.wan.last

    # -- checkpointing ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This site's state. Sites differ between rounds and Lightning saves rank 0's model only, so the site's
        weights are included; an exchange in flight is completed and its decoded mean saved."""
        in_flight = {}
        for f in sorted(self._in_flight):
            flight = self._in_flight[f]
            means = self.exchange.wait(flight)
            in_flight[f] = {"launch_step": flight.launch_step, "means": [m.detach().cpu().clone() for m in means],
                            "wan_bytes": flight.wan_bytes, "lan_bytes": flight.lan_bytes}
        return {
            "layout": list(self.groups.layout.sizes),
            "fragments": [list(f) for f in self.fragments],
            "params": {k: p.detach().cpu().clone() for k, p in self.params.items()},
            "anchor": {k: v.detach().cpu().clone() for k, v in self.anchor.items()},
            "hidden": self.memory.state_dict(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "wan_bytes_total": self.wan_bytes_total,
            "last_sync": list(self._last_sync),
            "in_flight": in_flight,
            "exchange": self.exchange.exchange_state(),
            "sync_every": self.sync_every,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state.

        Raises:
            ValueError: the checkpoint was written with another site layout or other fragments (sites differ
                between rounds: ranks regrouped into other sites would start a site from different weights).
        """
        fix = "resume with the site_size/site_sizes and fragments that wrote it, or pass `resume_compression='reset'`"
        if list(state["layout"]) != list(self.groups.layout.sizes):
            raise ValueError(
                f"Expected the site layout {list(state['layout'])} of the checkpoint, but got "
                f"{list(self.groups.layout.sizes)}. Fix: {fix}."
            )
        if [list(f) for f in state["fragments"]] != self.fragments:
            raise ValueError(
                f"Expected the checkpoint's {len(state['fragments'])} fragment(s) of the same layers, but got "
                f"{len(self.fragments)} fragment(s) of {'the same' if len(state['fragments']) == len(self.fragments) else 'other'} "
                f"layers. Fix: {fix}."
            )
        saved_every = state.get("sync_every", self.sync_every)
        if saved_every != self.sync_every:
            # allowed: anchor, outer momentum and the sites' weights stay valid under any schedule (H may be changed
            # on purpose between phases of a run); every rank follows the same new schedule, so no replica diverges
            rank_zero_warn(
                f"Expected `{self.schedule_option}` to be the checkpoint's {saved_every}, but got {self.sync_every}: "
                f"the outer state carries over and the rounds follow the new schedule from inner step "
                f"{state['inner_steps']} on (each fragment's next round falls on the next step of the new schedule). "
                f"Fix: pass `{self.schedule_option}={saved_every}` to continue the checkpoint's schedule.",
                category=UserWarning,
            )
        for k, v in state["params"].items():
            self.params[k].copy_(v)
        for k, v in state["anchor"].items():
            self.anchor[k].copy_(v)
        self.memory = ResidualMemory()
        for k, v in state["hidden"].items():
            self.memory.residuals[k] = v.to(self.params[k].device)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.exchange.load_exchange_state(state["exchange"])
        self.inner_steps = state["inner_steps"]
        self.rounds = state["rounds"]
        self.tokens = state["tokens"]
        self.exchange.ledger.restore_link_run("wan", state["wan_bytes_total"], state["inner_steps"])
        self._last_sync = list(state["last_sync"])
        self._in_flight = {}
        for f, saved in state["in_flight"].items():
            means = [m.to(self.params[n].device) for m, n in zip(saved["means"], self.fragments[int(f)])]
            self._in_flight[int(f)] = InFlight(means, None, saved["wan_bytes"], saved["lan_bytes"],
                                               sum(dense_bytes(m.numel()) for m in means), saved["launch_step"], done=True)
