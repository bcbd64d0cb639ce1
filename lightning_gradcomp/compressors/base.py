"""The compressor contract: pure tensor code, no process group, no Lightning.

A compressor turns a *group* of layers, laid out back to back in one flat tensor (:class:`~lightning_gradcomp.flat.Segments`),
into a :class:`~lightning_gradcomp.flat.FlatPacket`. Only ``FlatPacket.payload`` crosses the wire; everything a receiver
needs to decode it either travels inside the payload or is known identically on every rank (the layout, a shared
scaler agreed through :meth:`Compressor.flat_statistic`), so a rank decodes a remote payload with its own local
context (:meth:`FlatPacket.with_payload`).

Two ways to travel:

* ``Aggregation.SUM``: payloads of all ranks can be added element-wise (all-reduce); the compressor's
  ``decompress_flat`` is linear in the payload, so decoding the sum gives the sum of the decoded tensors.
* ``Aggregation.GATHER``: payloads must be all-gathered and each decoded separately.

A compressor that can travel either way declares its variants (:meth:`Compressor.collectives`), each with the
compressor that travels that way; a planner picks one per bucket, leaving the compressor itself as it is.

This is the one contract. One tensor at a time (``compress(tensor)``, ``decompress(packet)``) and compressors written
per tensor are served by :mod:`lightning_gradcomp.compressors.per_tensor`.
"""

import enum
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.validation import check_options


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
        compressor: the compressor travelling this way, for one bucket: it shares the declaring compressor's per-rank
            state (random streams, counters, thresholds), so a run draws the same streams whichever variant each bucket
            takes; it is neither set up nor checkpointed on its own, and a later ``setup`` of the declaring
            compressor makes new ones.
    """

    name: str
    aggregation: Aggregation
    #: the compressor travelling this way (sharing the declaring compressor's per-rank state)
    compressor: "Compressor" = field(compare=False, repr=False, default=None)  # type: ignore[assignment]


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
    """Base class of all gradient compressors: the group contract.

    A subclass sets :attr:`aggregation` and implements :meth:`compress_flat` and :meth:`decompress_flat` for a group
    of layers; the rest have defaults. What only some compressors do is a class of its own they also derive from,
    which the runtime tests with ``isinstance``: :class:`CollectiveChoice` (more than one way to travel),
    :class:`GradientObserver` (looks at the fresh gradient apart from its residual), :class:`OptimizerCheck` (warns
    about optimizer settings), and :class:`~lightning_gradcomp.compressors.multiround.MultiRoundCompressor`
    (several dependent rounds). A compressor whose decode needs a value agreed by all ranks (TernGrad's shared
    scaler) returns it from :meth:`flat_statistic`; the hook reduces it with ``MAX`` over ranks before compressing.

    Compressors may hold per-rank state (random streams, thresholds); :meth:`setup` is called once with this rank's
    place in the group, and :meth:`state_dict` / :meth:`load_state_dict` round-trip that state.
    """

    #: how payloads of different ranks are combined (in this compressor's group, once :meth:`setup` has run: a
    #: compressor whose choice depends on the number of ranks makes it a property of ``world_size``)
    aggregation: Aggregation = Aggregation.GATHER
    #: whether what was not sent is kept as a residual and added to the next gradient (error feedback)
    uses_memory: bool = False
    #: whether the payload size depends only on the layers' shapes; sparse encodings set False, and the hook
    #: then exchanges sizes first (a rank may send an empty payload)
    fixed_size: bool = True

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

    # -- the group step ----------------------------------------------------------------------------------------
    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        """The group's local statistics, to be max-reduced over ranks before :meth:`compress_flat`, or ``None``
        (the default: nothing is shared).

        Args:
            flat: the group's gradients (after transforms and error feedback), laid out as ``segments``.
            segments: the group's layers.
        """
        return None

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """Compress the group ``flat`` (laid out as ``segments``; not modified).

        Args:
            flat: the group's gradients (after transforms and error feedback).
            segments: the group's layers (names, shapes, offsets).
            shared: the max over ranks of :meth:`flat_statistic`; ``None`` when used standalone, in which case the
                local statistic is used.
        """
        raise NotImplementedError(
            f"Expected {type(self).__name__} to implement `compress_flat` and `decompress_flat` (the group contract) "
            f"but got neither. Fix: implement them, or write it per tensor with "
            f"`lightning_gradcomp.compressors.per_tensor.LayerLoop`."
        )

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        """Decode a group packet to the flat ``[segments.total]`` tensor of ``packet.dtype`` (linear in the payload
        for ``Aggregation.SUM``)."""
        raise NotImplementedError(f"Expected {type(self).__name__} to implement `decompress_flat` but got none. "
                                  f"Fix: implement it beside `compress_flat`.")

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        """The ranks' mean of a gathered group, written into ``out`` (flat ``[segments.total]``); returns ``out``.

        The default decodes each packet with :meth:`decompress_flat`, sums in rank order in the packets' dtype and
        divides by their number. An override may fold the division into its decoder's pass over ``out`` but must
        round exactly as the default does (every rank gets the same bits).
        """
        total = self.decompress_flat(packets[0]).clone()  # a packet's decode may be a view of its payload
        for packet in packets[1:]:
            total.add_(self.decompress_flat(packet))
        return out.copy_(total).div_(len(packets))

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        """What this rank effectively contributed for the group (flat, its own packet decoded), for error feedback:
        ``residual = flat - sent``. The default is :meth:`decompress_flat`; override where an exact form is cheaper."""
        return self.decompress_flat(packet)

    # -- its state and settings -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (random generator state, adaptive thresholds)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> dict[str, Any]:
        """The compressor's settings, for logs and the run config."""
        return {"compressor": type(self).__name__}


class CollectiveChoice(Compressor):
    """A compressor that can travel more than one way (TernGrad: packed payloads gathered, or int8 values summed):
    a planner chooses between its variants per bucket."""

    def collectives(self, world_size: int) -> tuple[CollectiveVariant, ...]:
        """The variants a planner may choose between per bucket in a group of ``world_size`` ranks, in a fixed
        order (the same on every rank), each with the compressor that travels that way; empty (the default) when
        this compressor travels one way only, as :attr:`aggregation` says."""
        return ()


class GradientObserver(Compressor):
    """A compressor whose selection looks at the fresh gradient apart from its residual (AdaComp's
    ``H = residue + 2 dW``): the hook hands it each group's gradient before compressing the compensated group."""

    def observe_gradient_flat(self, flat: Tensor, segments: Segments) -> None:
        """Called by the hook with this rank's gradients of the group (after transforms, before the residual is
        added) just before the compensated group is compressed; the compressor keeps a reference until then."""


class OptimizerCheck(Compressor):
    """A compressor known to train badly with some optimizer settings (DeMo without its sign step, 1-bit SGD under
    heavy momentum): the strategy shows it the optimizers before the first step."""

    def check_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Called by the strategy once the optimizers exist, before the first step: warn or raise about an
        optimizer setting this compressor is known to train badly with."""


class SelectsElements(Compressor):
    """A compressor whose packet carries a selection of the elements with their positions (top-k, Gradient Dropping,
    AdaComp, DeMo's DCT coefficients) rather than every element encoded: made to be gathered to every rank, so a
    reduce-scatter across nodes, where the owner of a piece would decode each peer's selection alone, refuses it."""

