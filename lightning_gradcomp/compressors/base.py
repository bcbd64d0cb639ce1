"""The compressor contract: pure tensor code, no process group, no Lightning.

A compressor turns one parameter's gradient into a :class:`Packet`. Only ``Packet.payload`` crosses the
wire; everything a receiver needs to decode it either travels inside the payload or is known identically
on every rank (the shape, a shared scaler agreed through ``local_statistic``), so a rank decodes a remote
payload with its own local context (:meth:`Packet.with_payload`).

Two ways to travel:

* ``Aggregation.SUM``: payloads of all ranks can be added element-wise (all-reduce); the compressor's
  ``decompress`` is linear in the payload, so decoding the sum gives the sum of the decoded tensors.
* ``Aggregation.GATHER``: payloads must be all-gathered and each decoded separately.

A compressor that can travel either way declares its variants (:meth:`Compressor.collectives`); a planner picks
one per bucket and uses :meth:`Compressor.for_collective` for that bucket, leaving the compressor itself as it is.
"""

import enum
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.kernels import triton_launch
from lightning_gradcomp.flat import FlatPacket, Packet, Segments
from lightning_gradcomp.validation import check_options


#: the kernels that run a compressor's group code on a device (:meth:`Compressor.kernels`): its torch ops, the compiled
#: CPU kernels (``"fused"``: compressors with a ``backend=`` option), or Triton's
Kernels = Literal["torch", "fused", "triton"]


class Aggregation(str, enum.Enum):
    """How packets of different ranks are combined on the wire."""

    SUM = "sum"
    GATHER = "gather"


@dataclass(frozen=True)
class CollectiveVariant:
    """One way a compressor's packets can travel, for a planner to choose between per bucket.

    Attributes:
        name: the compressor's name for it (a value of its ``collective=`` option), e.g. ``"allgather"`` or
            ``"allreduce_int8"``; a planner reports its choice under this name.
        aggregation: how the ranks' payloads are combined when the compressor travels this way.
    """

    name: str
    aggregation: Aggregation


def layer_segments(compressor: "Compressor", name: str, shape: torch.Size) -> Segments:
    """The group of one layer: how the per-layer methods call the group methods. Kept per (name, shape), so the
    group code's layouts and index tensors, cached per group layout, are built once per layer as in the hook."""
    groups: dict[tuple[str, torch.Size], Segments] = compressor.__dict__.setdefault("_groups_of_one", {})
    key = (name, torch.Size(shape))
    group = groups.get(key)
    if group is None:
        group = groups[key] = Segments([name], [shape])
    return group


def _layer_packet(group: FlatPacket) -> Packet:
    """The packet of a group of one, as the per-layer methods return it (its statistics as 0-d tensors)."""
    return Packet(group.payload, group.segments.shapes[0], group.dtype, dict(group.ctx),
                  {k: v.reshape(()) for k, v in group.stats.items()})


def layer_group_packet(compressor: "Compressor", packet: Packet) -> FlatPacket:
    """A per-layer packet as the group of one it came from (the layer's name plays no part in decoding)."""
    return FlatPacket(packet.payload, layer_segments(compressor, "", packet.shape), packet.dtype, (packet.nbytes,), dict(packet.ctx))


@dataclass
class SharedStatistic:
    """A group's local statistics, to be max-reduced over ranks as one float32 vector.

    Attributes:
        values: the 1-D float32 vector.
        lengths: elements of ``values`` per layer, ``-1`` for a layer without a statistic, when ``values`` holds the
            layers' statistics one after another (the default, looping layout, which a batched compressor may keep so
            that either path reads the other's); ``None`` when a batched compressor lays ``values`` out its own way.
    """

    values: Tensor
    lengths: Optional[tuple[int, ...]] = None

    def with_values(self, values: Tensor) -> "SharedStatistic":
        return replace(self, values=values)

    def per_layer(self) -> list[Optional[Tensor]]:
        """Each layer's statistic, 1-D (``None`` where it had none); only for the looping layout."""
        assert self.lengths is not None, "a batched compressor's own statistic layout has no per-layer split"
        out: list[Optional[Tensor]] = []
        offset = 0
        for n in self.lengths:
            if n < 0:
                out.append(None)
            else:
                out.append(self.values[offset : offset + n])
                offset += n
        return out


def max_or_zero(values: Tensor) -> Tensor:
    """The max of ``values`` as a 0-d tensor, 0 when ``values`` is empty (a statistic of an empty gradient)."""
    return values.max() if values.numel() else values.new_zeros(())


def _refusing_unknown_options(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` with unknown keyword arguments refused by name, listing the class's options (Python's own
    ``TypeError`` names neither the class's options nor, from a config file, where the name came from)."""
    parameters = inspect.signature(init).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return init
    valid = [n for n, p in list(parameters.items())[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(init)
    def checked(self: "Compressor", *args: Any, **kwargs: Any) -> None:
        check_options(type(self).__name__, kwargs, valid, kwargs)
        init(self, *args, **kwargs)

    return checked


class Compressor:
    """Base class of all gradient compressors.

    Subclasses set :attr:`aggregation` and implement either the group methods (:meth:`compress_flat`,
    :meth:`decompress_flat`, and :meth:`flat_statistic` where ranks agree on a value), which the hook calls, or
    the per-layer ones (:meth:`compress`, :meth:`decompress`, :meth:`local_statistic`). Each side defaults to the
    other: a single tensor is a group of one (:meth:`compress` of a compressor with group methods is
    :meth:`compress_flat` of a one-layer group), and the default group methods loop over the layers with the
    per-layer ones. A compressor whose decode needs a value agreed by all ranks (TernGrad's shared scaler) returns
    it from its statistic; the hook reduces it with ``MAX`` over ranks before compressing.

    Compressors may hold per-rank state (a random generator, thresholds); :meth:`setup` is called once with
    this rank's place in the group, and :meth:`state_dict` / :meth:`load_state_dict` round-trip that state.
    """

    #: how payloads of different ranks are combined
    aggregation: Aggregation = Aggregation.GATHER
    #: whether what was not sent is kept as a residual and added to the next gradient (error feedback)
    uses_memory: bool = False
    #: whether the payload size depends only on the tensor's shape; sparse encodings set False, and the hook
    #: then exchanges sizes first (a rank may send an empty payload)
    fixed_size: bool = True
    #: whether a packet carries a selection of the elements with their positions (top-k, Gradient Dropping, DeMo's
    #: DCT coefficients) rather than every element encoded; a reduce-scatter across nodes refuses those
    sparse: bool = False

    @_refusing_unknown_options
    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _refusing_unknown_options(init)  # type: ignore[method-assign]

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        """Called once before the first step with this rank's place in the process group.

        Args:
            rank: this rank's index in the group that exchanges the packets.
            world_size: number of ranks in that group.
            device: the device gradients live on.
        """
        self.rank = rank
        self.world_size = world_size
        self._kernels_chosen = self._choose_kernels(device)

    def aggregation_for(self, world_size: int) -> Aggregation:
        """How this compressor travels in a group of ``world_size`` ranks (default: :attr:`aggregation`)."""
        return self.aggregation

    def collectives(self, world_size: int) -> tuple[CollectiveVariant, ...]:
        """The variants a planner may choose between per bucket in a group of ``world_size`` ranks, in a fixed
        order (the same on every rank); empty (the default) when this compressor travels one way only, as
        :meth:`aggregation_for` says."""
        return ()

    def for_collective(self, name: str) -> "Compressor":
        """This compressor travelling as its variant ``name`` (one of :meth:`collectives`), for one bucket.

        The result shares this compressor's per-rank state (random streams, counters, thresholds), so a run
        draws the same streams whichever variant each bucket takes; it is neither set up nor checkpointed on its
        own, and a later :meth:`setup` of this compressor makes new ones.
        """
        names = [v.name for v in self.collectives(self.world_size)]
        if name not in names:
            raise ValueError(
                f"Expected `collective` to be one of {type(self).__name__}'s variants {names} but got {name!r}. "
                f"Fix: choose among `collectives({self.world_size})`."
            )
        return self._variant(name)

    def _variant(self, name: str) -> "Compressor":
        """The compressor behind :meth:`for_collective` for a declared variant ``name``; a compressor that
        declares :meth:`collectives` overrides it."""
        raise NotImplementedError(f"{type(self).__name__} declares collective variants but makes none")

    def observe_gradient(self, grad: Tensor, name: str) -> None:
        """Called by the hook, for compressors with :attr:`uses_memory`, with this rank's gradient of ``name``
        (after transforms, before the residual is added) just before the compensated tensor is compressed.

        Compressors whose selection looks at the fresh gradient apart from the residual (AdaComp's
        ``H = residue + 2 dW``) keep a reference here; the default ignores it.
        """

    def local_statistic(self, tensor: Tensor, name: str) -> Optional[Tensor]:
        """A small float32 tensor to be max-reduced over ranks before :meth:`compress`, or ``None``.

        The default is :meth:`flat_statistic` of the group of one when the compressor has group methods, else ``None``.

        Args:
            tensor: the gradient (after transforms and residual) of parameter ``name``.
            name: the parameter's name.
        """
        if not self._has_group_methods():
            return None
        shared = self.flat_statistic(tensor.reshape(-1), layer_segments(self, name, tensor.shape))
        return None if shared is None else shared.values

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        """Compress ``tensor`` (the gradient of parameter ``name``) into a packet.

        The default is :meth:`compress_flat` of the group of one (a compressor without group methods overrides it).

        Args:
            tensor: the gradient to compress; not modified.
            name: the parameter's name, for per-layer settings and state.
            shared: the max over ranks of :meth:`local_statistic`; ``None`` when used standalone, in which case
                the local statistic is used.
        """
        self._require_group_methods("compress")
        statistic = None if shared is None else SharedStatistic(shared.reshape(-1).float(), (shared.numel(),))
        return _layer_packet(self.compress_flat(tensor.reshape(-1), layer_segments(self, name, tensor.shape), statistic))

    def decompress(self, packet: Packet) -> Tensor:
        """Decode one packet to a dense tensor of ``packet.shape`` and ``packet.dtype``.

        For ``Aggregation.SUM`` compressors this must be linear in ``packet.payload``. The default is
        :meth:`decompress_flat` of the group of one.
        """
        self._require_group_methods("decompress")
        return self.decompress_flat(layer_group_packet(self, packet)).view(packet.shape)

    def _has_group_methods(self) -> bool:
        """Whether this compressor is written at group level: it implements the group methods and not the per-layer
        ones (then a single tensor is a group of one). A compressor with both keeps its own per-layer code."""
        cls = type(self)
        return cls.compress is Compressor.compress and cls.compress_flat is not Compressor.compress_flat

    def _require_group_methods(self, method: str) -> None:
        # the per-layer defaults call the group methods, whose defaults call the per-layer ones: one side must exist
        if not self._has_group_methods():
            raise NotImplementedError(
                f"Expected {type(self).__name__} to implement `{method}` or the group methods (`compress_flat`, "
                f"`decompress_flat`) but got neither. Fix: override one of them."
            )

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        """The sum of the decoded packets, in the given (rank) order.

        Every rank calls this with the same packets in the same order, so the result is bit-identical
        everywhere. Subclasses may override it with a cheaper exact equivalent.
        """
        total = self.decompress(packets[0]).clone()
        for packet in packets[1:]:
            total.add_(self.decompress(packet))
        return total

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """:meth:`decompress_sum` written into ``out`` (a tensor of the packets' shape and dtype); returns ``out``.

        The hook decodes straight into DDP's bucket view with this, so a compressor that can decode in place
        saves a full-size allocation and copy per parameter. The result must equal :meth:`decompress_sum`
        bit for bit; the default copies it.
        """
        return out.copy_(self.decompress_sum(packets))

    def decompress_mean_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        """The ranks' mean of gathered packets, in ``out``; returns ``out``.

        For a compressor written at group level, this is :meth:`decompress_flat_mean_into` of the group of one, as
        the hook averages (DeMo's mean over the ranks that selected a coefficient included). Otherwise the result
        must equal ``decompress_sum_into(packets, out).div_(len(packets))`` bit for bit (what the default does), so
        a compressor may fold the division into its decoder's pass over ``out`` but never change the rounding.
        """
        if self._has_group_methods():
            flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            self.decompress_flat_mean_into([layer_group_packet(self, p) for p in packets], flat)
            return out if flat.data_ptr() == out.data_ptr() else out.copy_(flat.view(out.shape))
        return self.decompress_sum_into(packets, out).div_(len(packets))

    def sent(self, tensor: Tensor, packet: Packet) -> Tensor:
        """What this rank effectively contributed for ``tensor`` (its own packet decoded).

        Used for error feedback: ``residual = tensor - sent``. Override where an exact form is cheaper. The
        default is :meth:`sent_flat` of the group of one when the compressor has group methods.
        """
        if not self._has_group_methods():
            return self.decompress(packet)
        return self.sent_flat(tensor.reshape(-1), layer_group_packet(self, packet)).view(packet.shape)

    # -- a group of layers in one flat tensor (the hook's batched pipeline) -------------------------------------
    # The defaults below loop over the layers with the per-layer methods above, so every compressor travels through
    # the hook's one pipeline; a batched compressor overrides them with a fixed number of ops per group (see
    # :mod:`lightning_gradcomp.flat`) and sets :attr:`batched`, and its per-layer methods are then these
    # methods on a group of one. Where a compressor keeps both, overrides must give what the loop gives: the same
    # values bit for bit where the compressor is deterministic, the same statistics where it draws.

    #: whether the ``*_flat`` methods run a fixed number of ops per group rather than the default loop over layers
    batched: bool = False

    #: whether a compressor with Triton group kernels runs them: ``None`` chooses by device (CUDA with Triton
    #: importable, :func:`~lightning_gradcomp.kernels.triton_launch.usable`); ``True`` forces them (on CPU tensors
    #: they need ``TRITON_INTERPRET=1``: the tests); ``False`` never
    triton: Optional[bool] = None
    _kernels_chosen: Optional[Kernels] = None

    def _choose_kernels(self, device: torch.device) -> Kernels:
        """The kernels that run this compressor's groups on ``device``: Triton's where :attr:`triton` says so, else
        the torch ops (a compressor with compiled kernels adds its own rule:
        :class:`~lightning_gradcomp.compressors.backends.KernelBacked`)."""
        use_triton = triton_launch.usable(device) if self.triton is None else self.triton
        return "triton" if use_triton else "torch"

    def kernels(self, device: torch.device) -> Kernels:
        """The kernels that run the groups: chosen once in :meth:`setup` for its device, or at the first group call
        for ``device`` when this compressor is used without ``setup`` (then kept until ``setup``)."""
        if self._kernels_chosen is None:
            self._kernels_chosen = self._choose_kernels(device)
        return self._kernels_chosen

    def uses_triton(self, tensor: Tensor) -> bool:
        """Whether Triton's kernels run the groups on ``tensor``'s device (:meth:`kernels`). Meaningful for
        compressors that have such kernels."""
        return self.kernels(tensor.device) == "triton"

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        """The group's local statistics (:meth:`local_statistic` of every layer) as one vector, or ``None``."""
        if type(self).local_statistic is Compressor.local_statistic:
            return None
        local = [self.local_statistic(x, name) for name, x in segments.items(flat)]
        if all(s is None for s in local):
            return None
        present = [s.reshape(-1).float() for s in local if s is not None]
        return SharedStatistic(torch.cat(present), tuple(-1 if s is None else s.numel() for s in local))

    def observe_gradient_flat(self, flat: Tensor, segments: Segments) -> None:
        """:meth:`observe_gradient` for every layer of the group (nothing when the compressor does not override it)."""
        if type(self).observe_gradient is not Compressor.observe_gradient:
            for name, x in segments.items(flat):
                self.observe_gradient(x, name)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """Compress the group ``flat`` (laid out as ``segments``); ``shared``: its reduced :meth:`flat_statistic`."""
        per_layer = shared.per_layer() if shared is not None else [None] * len(segments)
        packets = [self.compress(x, name, s) for (name, x), s in zip(segments.items(flat), per_layer)]
        dtypes = {p.payload.dtype for p in packets}
        parts = [p.payload.reshape(-1) if len(dtypes) == 1 else p.payload.reshape(-1).view(torch.uint8) for p in packets]
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        return FlatPacket(payload, segments, flat.dtype, tuple(p.nbytes for p in packets), layers=packets)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        """Decode a group packet to the flat ``[segments.total]`` tensor of ``packet.dtype`` (linear in the payload
        for ``Aggregation.SUM``)."""
        assert packet.layers is not None, f"{type(self).__name__} makes batched packets but decodes them by layer"
        parts = [self.decompress(p).reshape(-1) for p in packet.layers]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean of a gathered group, written into ``out`` (flat ``[segments.total]``); returns ``out``.

        Must equal :meth:`decompress_mean_into` of every layer bit for bit (the ranks summed in the given order).
        The default decodes looping packets layer by layer, and batched ones with :meth:`decompress_flat`, summed in
        rank order in the packets' dtype and divided by their number, as the per-layer default does.
        """
        if packets[0].layers is None:
            total = self.decompress_flat(packets[0]).clone()  # a packet's decode may be a view of its payload
            for packet in packets[1:]:
                total.add_(self.decompress_flat(packet))
            return out.copy_(total).div_(len(packets))
        segments = packets[0].segments
        for i, view in enumerate(segments.views(out)):
            layers = [p.layers[i] for p in packets if p.layers is not None]
            self.decompress_mean_into(layers, view)
        return out

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        """What this rank effectively contributed for the group (flat), for error feedback."""
        if packet.layers is None:
            return self.decompress_flat(packet)
        parts = [self.sent(x, p).reshape(-1) for x, p in zip(packet.segments.views(flat), packet.layers)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def check_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Called by the strategy once the optimizers exist, before the first step: warn or raise about an
        optimizer setting this compressor is known to train badly with (default: nothing)."""

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (random generator state, adaptive thresholds)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> dict[str, Any]:
        """The compressor's settings, for logs and the run config."""
        return {"compressor": type(self).__name__}
