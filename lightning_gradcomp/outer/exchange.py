"""The outer round's exchange: pseudo-gradients through the DDP hook's own pipeline, between site leaders.

One implementation of compression and exchange serves both levels. An outer round hands the fragment's
pseudo-gradients to :func:`~lightning_gradcomp.exchange.hook.gradcomp_hook` as one flat bucket, with a hook state of its
own whose group is the site leaders'. So every registered compressor (and any ``Compressor``) works on
pseudo-gradients exactly as on gradients: summable encodings with a shared scale (Int8, TernGrad's max-shared
scaler) travel by all-reduce, the others by all-gather, multi-round ones (PowerSGD) by their rounds; error
feedback is the hook's residual memory keyed by parameter name; bytes are the hook's count. Then the leader
broadcasts the decoded mean inside its site (dense, over the fast link), so all ranks of a site apply the same
bits.

Why through leaders and not sharded across a site's ranks: the pseudo-gradient is identical on the ranks of a
site, so one compressed copy per site is all the slow link must carry; sharding would split that same traffic
over the site's network cards (worth it when one card is the bottleneck, which the hierarchical exchange of the
per-step hook addresses) at the cost of an in-site all-gather instead of a broadcast. Leaders keep the
collective sequence simple: the leaders' group sees only outer traffic, the site group only inner DDP and the
broadcast.

A sharded site (FSDP2 inside the site, :class:`~lightning_gradcomp.outer.sharded.ShardedDiLoCoStrategy`) is the
other case: there the ranks of a site hold *different* parts of the model, so every rank exchanges its own shard of
the pseudo-gradient with the ranks holding the same shard in the other sites (``sharded=True``: the state's group is
the device mesh's replicate group), and nothing is broadcast inside the site. The site's traffic is then spread over
its ranks by construction, and each rank's bytes are its shard's.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_gradcomp.strategies import checkpoint as ckpt
from lightning_gradcomp.exchange.guard import NonFiniteGradientError
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.sites.layout import SiteGroups
from lightning_gradcomp.exchange.ledger import Ledger, dense_bytes
from lightning_gradcomp.sites.transport import SiteLeadersTransport
from lightning_gradcomp.exchange.groups import TensorBucket


class FlatBucket(TensorBucket):
    """A fragment's pseudo-gradients as one flat fp32 buffer (zeros until written), shaped as DDP's ``GradBucket``
    for the hook.

    ``parameters()`` are the model's own parameters (the hook names them through ``GradCompState.names``);
    ``gradients()`` are views of the buffer in ``shapes`` (default: the parameters' shapes; under FSDP2 the shapes
    of this rank's shards, which ``layer_shapes()`` tells the hook), which the hook overwrites with the mean.
    """

    def __init__(self, index: int, params: Sequence[nn.Parameter], device: torch.device,
                 shapes: Optional[Sequence[torch.Size]] = None) -> None:
        sizes = [p.shape for p in params] if shapes is None else [torch.Size(s) for s in shapes]
        buffer = torch.zeros(sum(s.numel() for s in sizes), dtype=torch.float32, device=device)
        super().__init__(buffer, params, sizes, index)
        self._views: list[Tensor] = []
        offset = 0
        for shape in sizes:
            self._views.append(buffer[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()

    def gradients(self) -> list[Tensor]:
        return self._views


@dataclass
class InFlight:
    """An outer exchange of one fragment, launched and not yet applied.

    Attributes:
        means: the all-site mean of the pseudo-gradients, per parameter of the fragment (valid once ``done``).
        future: the pending collectives (``None``: nothing pending on this rank).
        wan_bytes: what this rank put on the link between sites for this exchange.
        lan_bytes: what this rank put on the in-site link for it (read from the ledger once the mean has been
            fanned out inside the site).
        dense_bytes: the fragment's fp32 size (what a dense exchange would carry).
        launch_step: the inner step at which the pseudo-gradients were taken.
        done: whether ``means`` already holds the all-site mean on this rank.
        sent: this site's own contribution as decoded (pseudo-gradient units), for exchanges whose unsent part
            the engine keeps (WeightGrad); ``None`` when the exchange keeps its own error feedback.
        deltas: the pseudo-gradients as launched (kept only with ``sent``).
    """

    means: list[Tensor]
    future: Optional[torch.futures.Future]
    wan_bytes: int
    lan_bytes: int
    dense_bytes: int
    launch_step: int
    done: bool = False
    sent: Optional[list[Tensor]] = None
    deltas: Optional[list[Tensor]] = None
    #: the flat tensor ``means`` are views of (broadcast inside the site as one message)
    flat: Optional[Tensor] = None


def nonfinite_pseudo_gradient(names: Sequence[str], pseudo_gradients: Sequence[Tensor], site: int,
                              step: int) -> NonFiniteGradientError:
    """The error every leader raises for a NaN/Inf pseudo-gradient (the outer state runs ``nonfinite="raise"``).

    The guard's own message suggests ``nonfinite='skip'``, which is the inner steps' default and does not apply
    here: an outer round cannot be skipped, since the site's weights themselves are no longer finite.
    """
    local = [n for n, d in zip(names, pseudo_gradients) if not bool(torch.isfinite(d).all())]
    where = f"`{local[0]}` of site {site}" + (f" (also {local[1:]})" if local[1:] else "") if local else "another site"
    return NonFiniteGradientError(
        f"Non-finite pseudo-gradient (NaN or Inf) in {where} at the outer round of inner step {step}: that site's "
        f"weights are no longer finite, so no outer round can be skipped around it; every site stops here. Fix: make "
        f"the inner steps stable (a lower inner learning rate, gradient clipping such as `gradient_clip_val=1.0`, "
        f"checked data); `nonfinite` applies to the inner gradients only."
    )


class LeaderExchange:
    """Compressed all-site averaging of pseudo-gradients through the site leaders (see the module docstring).

    Args:
        state: the outer hook state: compressor (set up with this site's index among ``num_sites``), residual
            memory, names, float names; its group is the leaders' (``sharded``: the ranks holding this rank's shard
            in every site).
        groups: this rank's sites and groups.
        fragments: the parameters of each fragment, by name.
        params: the model's parameters by name (they name the tensors for the hook).
        device: where the flat buffers live (the parameters' device: collectives run there).
        shapes: the shape of what this rank exchanges of each parameter, by name (``None``: the parameters'
            shapes; under FSDP2, this rank's shard of each).
        sharded: every rank exchanges its own shard over the state's group and nothing is broadcast inside the
            site (FSDP2 sites, whose ranks hold different parts of the model); ``False``: the leaders exchange the
            site's one copy and broadcast the mean inside the site.
    """

    def __init__(
        self,
        state: GradCompState,
        groups: SiteGroups,
        fragments: Sequence[Sequence[str]],
        params: Mapping[str, nn.Parameter],
        device: torch.device,
        shapes: Optional[Mapping[str, torch.Size]] = None,
        sharded: bool = False,
    ) -> None:
        self.state = state
        self.groups = groups
        self.buckets = [FlatBucket(f, [params[n] for n in names], device,
                                   None if shapes is None else [shapes[n] for n in names])
                        for f, names in enumerate(fragments)]
        self.fragments = [list(names) for names in fragments]
        #: whether this rank exchanges between sites: a site's leader (one copy per site), or every rank of a
        #: sharded site (each holds a different shard)
        self.sends = sharded or groups.is_leader
        #: whether the decoded mean is then broadcast inside the site (the site's ranks hold one copy)
        self.fans_out = not sharded and groups.site_size > 1
        #: the sites' in-site broadcast (and buffers' way down), recording on the outer state's ledger
        self.transport = SiteLeadersTransport(groups, state.ledger)

    @property
    def ledger(self) -> Ledger:
        """Where this exchange's bytes are recorded: the outer hook state's ledger."""
        return self.state.ledger

    def launch(self, fragment: int, pseudo_gradients: Sequence[Tensor], step: int) -> InFlight:
        """Start averaging a fragment's pseudo-gradients over all sites; returns at once where the collectives
        allow (the shared-scale all-reduce and variable sizes block briefly; the payload transfer does not)."""
        bucket = self.buckets[fragment]
        for view, value in zip(bucket.gradients(), pseudo_gradients):
            view.copy_(value)
        g = self.groups
        future = None
        wan = 0
        if self.sends and g.layout.num_sites > 1:
            names = self.fragments[fragment]
            try:
                future = gradcomp_hook(self.state, bucket)
            except NonFiniteGradientError as exc:
                raise nonfinite_pseudo_gradient(names, pseudo_gradients, g.site, step) from exc
            wan = self.state.ledger.bytes_of(names, fragment)
        # the in-site bytes (the decoded mean's broadcast) are the ledger's once :meth:`wait` has fanned it out
        return InFlight(bucket.gradients(), future, wan, 0, dense_bytes(bucket.buffer().numel()), step, flat=bucket.buffer())

    def wait(self, flight: InFlight) -> list[Tensor]:
        """The all-site mean of the fragment's pseudo-gradients, bit-identical on every rank of every site."""
        if not flight.done:
            if flight.future is not None:
                flight.future.wait()
            if self.fans_out:
                assert flight.flat is not None
                self.transport.fan_out(flight.flat)
                flight.lan_bytes = self.state.ledger.take_channel("lan")
            flight.done = True
        return flight.means

    def exchange_state(self) -> dict[str, Any]:
        """The outer hook state's per-rank part: compressor streams, error feedback."""
        return ckpt.rank_state(self.state)

    def load_exchange_state(self, state: dict[str, Any]) -> None:
        ckpt.restore(self.state, state, self.buckets[0].buffer().device)

    def sync_buffers(self, buffers: Sequence[Tensor]) -> tuple[int, int]:
        """Copy global rank 0's floating-point buffers (batch-norm statistics) to every rank, through the
        leaders; returns this rank's (WAN, LAN) bytes, as the ledger recorded them."""
        return sync_buffers(buffers, self.transport)


def sync_buffers(buffers: Sequence[Tensor], transport: SiteLeadersTransport) -> tuple[int, int]:
    """Global rank 0's floating-point buffers to every rank: over the leaders, then inside each site
    (:meth:`~lightning_gradcomp.sites.transport.SiteLeadersTransport.broadcast_from_first_site`).

    Returns:
        This rank's (WAN, LAN) bytes, taken from the transport's ledger: the buffers leave site 0's leader over the
        WAN and every leader over the LAN.
    """
    if not buffers:
        return 0, 0
    ledger = transport.ledger
    assert ledger is not None, "sync_buffers counts its bytes on the transport's ledger"
    flat = torch.cat([b.detach().reshape(-1).float() for b in buffers])
    transport.broadcast_from_first_site(flat)
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b).to(b.dtype))
        offset += b.numel()
    return ledger.take_channel("wan"), ledger.take_channel("lan")
