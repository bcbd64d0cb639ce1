"""The DDP communication hook: compression inside each bucket, overlapping backward, in a fixed number of ops.

For each bucket DDP hands us (in the order buckets become ready, identical on every rank), the bucket is cut into
groups (:mod:`lightning_gradcomp.exchange.groups`: per pipelined chunk, the layers routed to one compressor, laid out back to
back; made once per layout), and each group goes through the compressor's flat methods, so the number of ops
dispatched (kernel launches on a GPU) grows with the number of groups, never with the number of layers:

1. per group: its gradients taken from the bucket's buffer in one op, layer transforms (clipping, momentum
   correction: per layer, only when a callback attached one), then error feedback on one flat residual;
2. one small max all-reduce of every group's statistics (TernGrad's shared scalers), waited for;
3. per pipelined chunk (``pipeline_bytes`` of input each; one chunk by default): compress each group, update its
   residual, record its statistics (as tensors, no host sync), then launch the chunk's collectives before
   compressing the next chunk, so compression of one chunk overlaps the transfer of the previous;
4. one collective per channel and chunk, in a fixed order: an all-reduce per payload dtype for summable
   packets, and one all-gather of the byte-concatenated packets that must be gathered (variable-size ones after
   an all-gather of their sizes: the bucket's one host read, at world size > 1);
5. when all of them complete: decode, average, and write each group into the bucket's buffer (straight into it when
   the group's layers are adjacent there).

Collectives are only launched here, never from ``.then`` callbacks (see :mod:`lightning_gradcomp.exchange.comm`), and travel
on the state's :class:`~lightning_gradcomp.exchange.transport.Transport`: every engine, the emulated workers and the codec
measurement run this one exchange and differ only in the bucket they hand it and the transport (``docs/design.md``,
"One exchange").
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.exchange import comm
from lightning_gradcomp.compressors.base import Aggregation, Compressor, GradientObserver, SharedStatistic
from lightning_gradcomp.flat import FlatPacket
from lightning_gradcomp.compressors.multiround import AllReduce, FlatExchanged, MultiRoundCompressor
from lightning_gradcomp.exchange.guard import (
    NonFinite,
    NonFiniteGuard,
    begin_step,
    bucket_is_nonfinite,
    can_share_collective,
    local_flag,
    observe_decoded,
)
from lightning_gradcomp.exchange.groups import HookBucket, LayerGroup, LayerViews, Layouts, layer_offsets, layer_shapes
from lightning_gradcomp.exchange.ledger import GroupRecord, Ledger, tensor_bytes
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.exchange.router import Planner, Router
from lightning_gradcomp.exchange.stats import NO_OBSERVER, HookObserver, HookStats
from lightning_gradcomp.exchange.transport import ProcessGroupTransport, Transport


@dataclass(frozen=True)
class Peers:
    """Whom a hook state exchanges with.

    Attributes:
        process_group: the group to exchange with (``None``: the default group).
        world_size: ranks in ``process_group``.
        hierarchy: the hierarchical exchange's sites and groups (:class:`~lightning_gradcomp.sites.hierarchy.SiteExchange`);
            ``None``: flat. When set, ``process_group`` is the cross-site group, ``world_size`` the number of sites,
            and the records hold this rank's share only, so ``bytes_per_step`` is what this rank puts on the link
            between sites.
    """

    process_group: Optional[dist.ProcessGroup] = None
    world_size: int = 1
    hierarchy: Optional[Any] = None


class GroupStepState(Protocol):
    """What the group step (:func:`group_step`; in the hook :func:`_prepare` and :func:`_compress_group`) reads and
    writes: :class:`GradCompState` for DDP's buckets, :class:`GroupState` for an engine that exchanges one flat vector
    on its own (1-bit Adam's compressed all-reduce)."""

    @property
    def memory(self) -> ResidualMemory: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def observer(self) -> HookObserver: ...

    @property
    def transforms(self) -> Sequence[LayerTransform]: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def world_size(self) -> int: ...

    @property
    def float_names(self) -> frozenset[str]: ...


@dataclass
class GroupState:
    """The group step's state for an engine that exchanges one flat vector on its own (:func:`group_step`): each of
    1-bit Adam's two compression stages has one (its own error feedback and ledger, the exchange's transport).

    Attributes:
        transport: what carries the exchange's collectives (and the shared statistics' max).
        memory: the residuals of the error feedback, by segment name.
        ledger: the group's record (bytes on the wire) and the collectives issued.
        transforms: per-layer transforms before compression (none by default).
        observer: a monitor's observer (none by default).
        float_names: names the transforms treat as excluded from compression.
    """

    transport: Transport
    memory: ResidualMemory = field(default_factory=ResidualMemory)
    ledger: Ledger = field(default_factory=Ledger)
    transforms: Sequence[LayerTransform] = ()
    observer: HookObserver = NO_OBSERVER
    float_names: frozenset[str] = frozenset()

    @property
    def world_size(self) -> int:
        return self.transport.world_size


class GradCompState:
    """Hyper-parameters and mutable state of :func:`gradcomp_hook`: one owner per concern.

    Args:
        compressor: compresses every parameter not sent in fp32.
        names: parameter object id -> parameter name (DDP hands the module's own parameter objects).
        float_names: names of parameters always sent uncompressed (fp32 all-reduce).
        transforms: per-layer transforms applied before compression, in order.
        process_group: the group to exchange with (``None``: the default group).
        world_size: ranks in ``process_group``.
        identity: the fp32 compressor (default :class:`~lightning_gradcomp.compressors.Identity`).
        memory: residuals for compressors with error feedback.
        nonfinite: what a NaN/Inf gradient on any rank does: ``"skip"`` the step everywhere, ``"raise"``, or
            ``"ignore"`` (see :mod:`lightning_gradcomp.exchange.guard`).
        keep_per_rank: keep each gathered parameter's per-rank decoded gradients in ``ledger.per_rank`` (WeightGrad's
            serial per-worker application needs them).
        planner: a :class:`~lightning_gradcomp.exchange.planner.CollectivePlanner` that picks each bucket's collective from a
            cost model of the link (``None``: always compress, the compressor's own collective).
        stats: where the hook records times and captured statistics for a monitor (``None``: not monitored).
        pipeline_bytes: bytes of input per pipelined group within a bucket (``None``: the whole bucket in one
            group). Each group gets its own collectives; results are identical either way.
        hierarchy: see :class:`Peers`.
        transport: what carries the collectives (:mod:`lightning_gradcomp.exchange.transport`); ``None``: torch.distributed
            over ``process_group``.
        layer_compressors: parameters with a compressor of their own (set up), by name (:class:`Router`).

    Attributes:
        names: as above.
        router: which compressor each layer uses (exclusions, the planner's choice, a dense warm-up).
        transforms: as above.
        peers: whom the hook exchanges with (:class:`Peers`).
        transport: what carries the collectives (:class:`~lightning_gradcomp.exchange.transport.Transport`).
        memory: the residuals, and the step transaction a skipped step rolls back.
        guard: the non-finite guard's decisions and counters (:class:`~lightning_gradcomp.exchange.guard.NonFiniteGuard`).
        ledger: records, bytes and collectives (:class:`~lightning_gradcomp.exchange.ledger.Ledger`).
        observer: the monitor's :class:`~lightning_gradcomp.exchange.stats.HookStats`, or a no-op observer.
        pipeline_bytes: as above.
        scratch: reused concatenation and all-gather buffers (see :class:`~lightning_gradcomp.exchange.comm.Scratch`).
        layouts: each bucket layout's groups of layers compressed together (:class:`~lightning_gradcomp.exchange.groups.Layouts`).
        extra: further per-rank state saved with the checkpoint: name -> object with ``state_dict`` /
            ``load_state_dict`` (WeightGrad's synchronizer, DiLoCo's outer state, per-rank optimizer states).
    """

    def __init__(
        self,
        compressor: Compressor,
        names: dict[int, str],
        float_names: frozenset[str] = frozenset(),
        transforms: Sequence[LayerTransform] = (),
        process_group: Optional[dist.ProcessGroup] = None,
        world_size: int = 1,
        identity: Optional[Compressor] = None,
        memory: Optional[ResidualMemory] = None,
        nonfinite: NonFinite = "skip",
        keep_per_rank: bool = False,
        planner: Optional[Planner] = None,
        stats: Optional[HookStats] = None,
        pipeline_bytes: Optional[int] = None,
        hierarchy: Optional[Any] = None,
        transport: Optional[Transport] = None,
        layer_compressors: Optional[Mapping[str, Compressor]] = None,
    ) -> None:
        self.names = names
        self.router = Router(compressor, float_names, identity, planner, layer_compressors)
        self.transforms: Sequence[LayerTransform] = tuple(transforms)
        self.peers = Peers(process_group, world_size, hierarchy)
        self.transport: Transport = ProcessGroupTransport(process_group, world_size) if transport is None else transport
        self.memory = ResidualMemory() if memory is None else memory
        self.guard = NonFiniteGuard(mode=nonfinite)
        self.ledger = Ledger(keep_per_rank)
        self.observer: HookObserver = NO_OBSERVER if stats is None else stats
        self.pipeline_bytes = pipeline_bytes
        self.scratch = comm.Scratch()
        self.layouts = Layouts()
        self.extra: dict[str, Any] = {}

    def observe(self, stats: Optional[HookStats]) -> None:
        """Attach a monitor's statistics (``None``: detach; the hook then records nothing for a monitor)."""
        self.observer = NO_OBSERVER if stats is None else stats

    def attach(self, key: str, obj: Any) -> None:
        """Save ``obj`` (with ``state_dict`` / ``load_state_dict``) in every rank's checkpoint state under ``key``."""
        self.extra[key] = obj

    # -- what the group step reads of any state (:class:`GroupStepState`; :class:`GroupState` holds them itself) --
    @property
    def float_names(self) -> frozenset[str]:
        return self.router.float_names

    @property
    def world_size(self) -> int:
        return self.peers.world_size

    @property
    def stats(self) -> Optional[HookStats]:
        """The monitor's statistics, or ``None`` when no monitor observes the hook (the observer narrowed)."""
        return self.observer if isinstance(self.observer, HookStats) else None

    def bytes_per_step(self) -> int:
        """Bytes this rank contributed to the collectives per backward, averaged over the run so far
        (:meth:`~lightning_gradcomp.exchange.ledger.Ledger.bytes_per_step`)."""
        return self.ledger.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes this rank contributed to the collectives of the latest backward (payloads + shared statistics)."""
        return self.ledger.last_step_bytes()

    def dense_bytes_per_step(self) -> int:
        """What plain fp32 DDP would have contributed for the same parameters."""
        return self.ledger.dense_bytes_per_step()


def _transform_group(state: GroupStepState, group: LayerGroup, x: Tensor) -> Tensor:
    """The layer transforms (clipping, momentum correction), layer by layer, on a group's flat gradients (a new
    flat tensor). Transforms are per-layer objects, so this is the one per-layer loop left on the hook's path; it
    runs only when a callback attached one."""
    parts = []
    for name, view in group.segments.items(x):
        is_float = name in state.float_names
        for transform in state.transforms:
            if transform.applies_to_float or not is_float:
                view = transform.before_compress(view, name)
        parts.append(view.reshape(-1))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _prepare(state: GroupStepState, group: LayerGroup, buffer: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A group's gradients, flat: as taken from the bucket, after the transforms, and as its compressor will see
    them (after error feedback)."""
    original = group.take(buffer)
    transformed = _transform_group(state, group, original) if state.transforms else original
    x = transformed
    if group.compressor.uses_memory:
        if isinstance(group.compressor, GradientObserver):
            group.compressor.observe_gradient_flat(x, group.segments)
        x = state.memory.compensate_flat(x, group.segments)
    return original, transformed, x


def _observe_inputs(state: GradCompState, groups: Sequence[LayerGroup], prepared: Sequence[tuple[Tensor, ...]]) -> None:
    """The monitor's input statistics: each gradient before and after the transforms (before error feedback)."""
    if state.observer.active:
        for group, (original, transformed, _) in zip(groups, prepared):
            for name, before, after in zip(group.segments.names, group.segments.views(original),
                                           group.segments.views(transformed)):
                state.observer.observe_input(name, before, after, group.compressor)


def _shared_statistics(
    state: GroupStepState,
    bucket_index: int,
    groups: Sequence[LayerGroup],
    inputs: Sequence[Tensor],
    flag: Optional[Tensor] = None,
) -> tuple[list[Optional[SharedStatistic]], Optional[int]]:
    """Each group's local statistics, max-reduced over ranks in one small collective per bucket.

    ``flag`` (the non-finite guard's, one float32) is reduced in the same collective, after the statistics;
    returns the statistics and the reduced flag (``None`` without one).
    """
    local = [g.compressor.flat_statistic(x, g.segments) for g, x in zip(groups, inputs)]
    present = [s.values for s in local if s is not None]
    if not present and flag is None:
        state.ledger.record_shared(bucket_index, 0)
        return local, None
    parts = present + ([] if flag is None else [flag.reshape(1).float()])
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    if state.world_size > 1:
        with state.observer.blocking():
            state.transport.max_(flat)
        state.ledger.count("allreduce_max")
    worst = None if flag is None else int(flat[-1].item())
    # the statistics' bytes (the guard's flag is not counted, as when it travels alone)
    state.ledger.record_shared(bucket_index, tensor_bytes(flat, flat.numel() - (flag is not None)))
    shared: list[Optional[SharedStatistic]] = []
    offset = 0
    for s in local:
        if s is None:
            shared.append(None)
        else:
            n = s.values.numel()
            shared.append(s.with_values(flat[offset : offset + n]))
            offset += n
    return shared, worst


def _as_bytes(payload: Tensor) -> Tensor:
    return payload.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(raw: Tensor, dtype: torch.dtype) -> Tensor:
    # a slice of the gathered byte buffer may be misaligned for wider dtypes: copy before reinterpreting
    return raw if dtype == torch.uint8 else raw.clone().view(dtype)


def gradcomp_hook(state: GradCompState, bucket: HookBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that compresses each parameter of ``bucket`` and exchanges the packets.

    Register with ``ddp_model.register_comm_hook(state, gradcomp_hook)``. Every rank ends with the same
    averaged, decoded gradient in ``bucket.buffer()``.

    Args:
        state: the hook state (compressors, process group or transport, residuals, ledger).
        bucket: DDP's ``dist.GradBucket``, or any :class:`~lightning_gradcomp.exchange.groups.HookBucket` (an
            outer round's pseudo-gradients, a gradient shard, a worker's flat gradients outside DDP).
    """
    # backward can run under the user's autocast (manual optimization); compression maths must keep the dtypes
    # it chose (autocast's type promotion rejects e.g. torch.cat of fp16 payloads under CPU bf16 autocast)
    with torch.autocast(bucket.buffer().device.type, enabled=False):
        return _exchange_bucket(state, bucket)


# DDP's register_comm_hook reads the hook's `bucket` annotation at run time and refuses any but dist.GradBucket
# (which satisfies HookBucket); the type checker reads the source's
gradcomp_hook.__annotations__["bucket"] = dist.GradBucket


def _exchange_bucket(state: GradCompState, bucket: HookBucket) -> torch.futures.Future[torch.Tensor]:
    state.ledger.bucket_called(bucket.is_last(), first=bucket.index() == 0)
    timer = state.observer.start_bucket()
    buffer = bucket.buffer()
    params = bucket.parameters()
    names = [state.names[id(p)] for p in params]
    shapes = layer_shapes(bucket)
    positions = layer_offsets(bucket)
    grads = LayerViews(buffer, positions, shapes)
    # one routing decision per bucket (may run one small agreed all-reduce the first time the planner sees it)
    route = state.router.route(state, names, grads)

    # non-finite guard: decided identically on every rank before transforms and residuals see the gradient
    if bucket.index() == 0:
        begin_step(state)
    multiround = isinstance(state.router.compressor, MultiRoundCompressor) and not state.router.dense
    # with nothing stateful before the statistics, the guard's flag rides in their all-reduce: one blocking
    # round trip per bucket instead of two (each one a point where every rank waits for the slowest)
    shared_flag = not multiround and can_share_collective(state, route)
    if not shared_flag and bucket_is_nonfinite(state, buffer, grads, names):
        return comm.completed(buffer.fill_(float("nan")))
    if multiround:
        return _multiround_exchange(state, bucket, names, route)

    groups = state.layouts.groups(names, shapes, positions, route, buffer.element_size(), state.pipeline_bytes)
    prepared = [_prepare(state, g, buffer) for g in groups]
    inputs = [p[2] for p in prepared]
    if not shared_flag:
        _observe_inputs(state, groups, prepared)
    flag = local_flag(state, buffer) if shared_flag else None
    shared, worst = _shared_statistics(state, bucket.index(), groups, inputs, flag)
    if shared_flag:
        if bucket_is_nonfinite(state, buffer, grads, names, worst=worst):
            return comm.completed(buffer.fill_(float("nan")))
        _observe_inputs(state, groups, prepared)

    decoders: list[Callable[[], None]] = []
    futures: list[torch.futures.Future] = []
    for chunk in range(groups[-1].chunk + 1 if groups else 0):
        # compress one chunk, then launch its collectives before compressing the next: the next chunk's
        # compression overlaps this chunk's transfer
        members = [k for k, g in enumerate(groups) if g.chunk == chunk]
        # without ``all_reduce`` the group step returns packets
        packets = cast(list[FlatPacket], [_compress_group(state, groups[k], inputs[k], shared[k]) for k in members])
        chunk_futures, decoder = _launch(state, (bucket.index(), chunk), [groups[k] for k in members], packets, buffer)
        futures.extend(chunk_futures)
        decoders.append(decoder)
    timer.launched()

    def decode(_: object) -> Tensor:
        timer.decode_started()
        for decoder in decoders:
            decoder()
        observe_decoded(state, buffer)  # an encoding may overflow: finite in, non-finite out
        timer.decode_done()
        return buffer

    if not futures:
        return comm.completed(decode(None))
    return torch.futures.collect_all(futures).then(lambda fut: decode(fut.wait()))


def _compress_group(
    state: GroupStepState,
    group: LayerGroup,
    x: Tensor,
    shared: Optional[SharedStatistic],
    all_reduce: Optional[AllReduce] = None,
) -> Union[FlatPacket, FlatExchanged]:
    """The group step, the one place a compressor encodes: compress one group (``x``: after transforms and error
    feedback), update its residuals and the transforms, record what was sent.

    A one-round compressor returns its packet, for the bucket's collectives. A multi-round one (with
    ``all_reduce``, its rounds' blocking sum) exchanges as it encodes and returns the exchanged mean.
    """
    compressor = group.compressor
    packet: Optional[FlatPacket] = None
    sent: Optional[Tensor] = None
    if all_reduce is not None and isinstance(compressor, MultiRoundCompressor):
        exchanged = compressor.exchange_flat(x, group.segments, all_reduce)
        sent = exchanged.sent
        record = GroupRecord(group.segments, exchanged.layer_nbytes, Aggregation.SUM, exchanged.stats)
    else:
        packet = compressor.compress_flat(x, group.segments, shared)
        if compressor.uses_memory or state.transforms:
            sent = compressor.sent_flat(x, packet)
        record = GroupRecord.of(packet, compressor.aggregation)
    if sent is not None:
        if compressor.uses_memory:
            state.memory.update_flat(group.segments, x, sent)
        if state.transforms:
            for (name, xi), si in zip(group.segments.items(x), group.segments.views(sent)):
                _after_transforms(state, name, xi, si)
    if state.observer.active and packet is not None:
        state.observer.observe_group(group.segments, compressor, x, packet, sent)
    state.ledger.record_group(record)
    return exchanged if packet is None else packet


def group_step(state: GroupStepState, group: LayerGroup, flat: Tensor, key: int = 0) -> FlatPacket:
    """The hook's group step on a vector an engine exchanges on its own (no DDP bucket): transforms, error
    feedback, the shared statistics (their max over ``state.transport``), compression, the residual update and the
    ledger's record, exactly as :func:`gradcomp_hook` runs them on a bucket's group.

    Args:
        state: the stage's transport, residuals and ledger (:class:`GroupState`).
        group: the group laid out over ``flat`` (``positions``: its segments' offsets).
        flat: the group's values, flat (read, not written).
        key: the index the shared statistics' bytes are recorded under in the ledger.

    Returns:
        The packet to exchange (its bytes are recorded in ``state.ledger``).
    """
    return group_steps(state, [group], flat, key)[0]


def group_steps(state: GroupStepState, groups: Sequence[LayerGroup], flat: Tensor, key: int = 0) -> list[FlatPacket]:
    """:func:`group_step` for several groups laid out over one vector, their shared statistics in one max (a
    compressed reduce-scatter's pieces, one group per owner: each piece's packet is decoded with its own context).

    Returns:
        One packet per group, in order (their bytes are recorded in ``state.ledger``).
    """
    for group in groups:
        if isinstance(group.compressor, MultiRoundCompressor):
            raise ValueError(
                f"Expected a one-round compressor for group_step, but got {type(group.compressor).__name__} "
                f"(multi-round: it exchanges as it encodes). Fix: exchange it through gradcomp_hook, whose rounds run "
                f"on the transport."
            )
    inputs = [_prepare(state, group, flat)[2] for group in groups]
    shared, _ = _shared_statistics(state, key, groups, inputs)
    packets = [_compress_group(state, g, x, s) for g, x, s in zip(groups, inputs, shared)]
    # without ``all_reduce`` the group step returns packets
    return [p for p in packets if isinstance(p, FlatPacket)]


def _after_transforms(state: GroupStepState, name: str, x: Tensor, sent: Tensor) -> None:
    is_float = name in state.float_names
    for transform in state.transforms:
        if transform.applies_to_float or not is_float:
            transform.after_compress(name, x, sent)


def _concat(state: GradCompState, key: tuple[object, ...], parts: Sequence[Tensor], numel: int) -> Tensor:
    """``parts`` (1-D, one dtype) concatenated into a reused buffer of ``numel >= sum`` elements, zero-padded."""
    used = sum(p.numel() for p in parts)
    flat = state.scratch.take(key, numel, parts[0].dtype, parts[0].device)
    torch.cat(list(parts), out=flat[:used])
    if numel > used:
        flat[used:].zero_()
    return flat


def _wire_sizes(packet: FlatPacket) -> "tuple[int, ...] | Tensor":
    """The sizes the receivers of a gathered packet must know before its payload: each layer's, or the total alone for
    a payload that carries its own layout (``self_describing``)."""
    return (packet.nbytes,) if packet.self_describing else packet.layer_nbytes


def _host_sizes(packet: FlatPacket) -> Tensor:
    sizes = _wire_sizes(packet)
    return sizes if isinstance(sizes, Tensor) else torch.tensor(sizes, dtype=torch.int64, device=packet.payload.device)


def _launch(
    state: GradCompState,
    key: tuple[int, int],
    groups: Sequence[LayerGroup],
    packets: Sequence[FlatPacket],
    buffer: Tensor,
) -> tuple[list[torch.futures.Future], Callable[[], None]]:
    """Start the collectives of one chunk's groups; returns their futures and the decoder to run after them.

    Channels: summable payloads grouped by dtype (one all-reduce each), the rest as bytes (one all-gather).
    ``key`` (bucket index, chunk index) names the chunk's reused buffers.
    """
    world = state.world_size
    sum_groups: dict[torch.dtype, list[int]] = {}
    gather_idx: list[int] = []
    for k, (group, packet) in enumerate(zip(groups, packets)):
        if group.compressor.aggregation is Aggregation.SUM:
            sum_groups.setdefault(packet.payload.dtype, []).append(k)
        else:
            gather_idx.append(k)

    futures = []
    sum_buffers: list[tuple[list[int], Tensor]] = []
    for dtype in sorted(sum_groups, key=str):  # same order on every rank
        idx = sum_groups[dtype]
        parts = [packets[k].payload.reshape(-1) for k in idx]
        flat = _concat(state, (*key, "sum", dtype), parts, sum(p.numel() for p in parts))
        if world > 1:
            futures.append(state.transport.sum(flat))
            state.ledger.count(f"allreduce_{str(dtype).removeprefix('torch.')}")
        sum_buffers.append((idx, flat))

    gathered: Optional[Tensor] = None
    # per rank, the byte length of each gathered layer's packet (of the whole packet where it is self-describing)
    sizes: list[list[int]] = []
    size_table = 0  # bytes of this rank's sizes sent ahead of the payloads
    if gather_idx and world > 1:
        parts = [_as_bytes(packets[k].payload) for k in gather_idx]
        known = [_wire_sizes(packets[k]) for k in gather_idx]
        if not all(groups[k].compressor.fixed_size and isinstance(n, tuple) for k, n in zip(gather_idx, known)):
            # variable-size payloads: per-layer sizes first (waited for: the bucket's one host read), then every
            # rank pads to the largest total
            own = torch.cat([_host_sizes(packets[k]) for k in gather_idx])
            with state.observer.blocking():
                table = state.transport.gather_sizes(own)
            state.ledger.count("allgather_sizes")
            size_table = tensor_bytes(own)
            sizes = table.tolist()
        else:
            sizes = [[n for row in known for n in row]] * world
        longest = max(sum(row) for row in sizes)
        flat = _concat(state, (*key, "gather"), parts, longest)
        if flat.numel() > 0:
            out = state.scratch.take((*key, "gathered"), world * flat.numel(), flat.dtype, flat.device)
            fut, gathered = state.transport.gather(flat, out)
            futures.append(fut)
            state.ledger.count("allgather")
        else:
            gathered = flat.new_zeros((world, 0))
    state.ledger.record_sizes(key, size_table)

    def decode() -> None:
        for idx, flat in sum_buffers:
            offset = 0
            for k in idx:
                group, packet = groups[k], packets[k]
                n = packet.payload.numel()
                total = group.compressor.decompress_flat(packet.with_payload(flat[offset : offset + n]))
                group.put(buffer, total.div_(world) if total.is_floating_point() else total.float() / world)
                _observe_averaged(state, group, buffer)
                offset += n
        starts = [0] * world
        layer = 0  # the first layer of the current group in the chunk's per-layer size rows
        for k in gather_idx:
            group, packet = groups[k], packets[k]
            compressor = group.compressor
            if gathered is None:  # one rank: its own packet is the gathered one
                per_rank = [packet]
            else:
                per_rank = []
                count = 1 if packet.self_describing else len(group.segments)
                for r in range(world):
                    row = tuple(sizes[r][layer : layer + count])
                    raw = gathered[r, starts[r] : starts[r] + sum(row)]
                    received = _from_bytes(raw, packet.payload.dtype)
                    # a self-describing payload's layer sizes are in the payload: its decoder reads them there
                    per_rank.append(packet.with_payload(received, layer_nbytes=None if packet.self_describing else row))
                    starts[r] += sum(row)
                layer += count
            # decoded and averaged straight into DDP's bucket when the group's layers are adjacent there
            group.put(buffer, compressor.decompress_flat_mean_into(per_rank, group.target(buffer)))
            if state.ledger.per_rank is not None:
                decoded = [group.segments.views(compressor.decompress_flat(q)) for q in per_rank]
                for i, name in enumerate(group.segments.names):
                    state.ledger.keep_per_rank(name, [d[i] for d in decoded])
            _observe_averaged(state, group, buffer)

    return futures, decode


def _observe_averaged(state: GradCompState, group: LayerGroup, buffer: Tensor) -> None:
    if state.observer.active:
        for name, view in group.segments.items(group.take(buffer)):
            state.observer.observe_averaged(name, view)


# -- multi-round compressors (PowerSGD) ------------------------------------------------------------------------
# A separate path on the one-shot path's pieces (groups, transforms, flat error feedback, ledger records, ``put``).
# Every round is a blocking all-reduce issued from the hook body, in the order the compressor calls it (which
# depends only on shapes and names), so the sequence of collectives is identical on every rank whatever the number
# of buckets. Nothing is left for ``.then``.


def _multiround_exchange(
    state: GradCompState, bucket: HookBucket, names: Sequence[str], route: Sequence[Compressor]
) -> torch.futures.Future[torch.Tensor]:
    """The one-shot path's groups (:meth:`~lightning_gradcomp.exchange.groups.Layouts.groups`), transforms and flat error
    feedback; then the fp32 group in one all-reduce, then the compressor's rounds on its group
    (:meth:`~lightning_gradcomp.compressors.multiround.MultiRoundCompressor.exchange_flat`). No per-layer view is
    made: each group is taken from the bucket, and its mean written back, in one op."""
    compressor = state.router.compressor
    assert isinstance(compressor, MultiRoundCompressor)
    world = state.world_size
    buffer = bucket.buffer()
    # one chunk: the rounds are the bucket's whole (two all-reduces), whatever ``pipeline_bytes``
    groups = state.layouts.groups(names, layer_shapes(bucket), layer_offsets(bucket), route,
                                  buffer.element_size(), None)
    prepared = [_prepare(state, g, buffer) for g in groups]
    _observe_inputs(state, groups, prepared)

    def all_reduce(tensor: Tensor) -> Tensor:
        if world > 1:
            state.transport.sum(tensor).wait()
            state.ledger.count("allreduce_round")
        return tensor

    # the layers routed to fp32 (the user's exclusions, and the planner's choice where compression would not pay)
    # in one all-reduce, before the compressor's rounds
    for group, (_, _, x) in zip(groups, prepared):
        if group.compressor is not compressor:
            packet = _compress_group(state, group, x, None)
            assert isinstance(packet, FlatPacket)
            # summed in place where nothing reads the input afterwards (no transform sees it): then, with the group
            # adjacent in the bucket and no transform, the bucket's own range is reduced and ``put`` copies nothing
            total = all_reduce(packet.payload if not state.transforms else packet.payload.clone())
            group.put(buffer, group.compressor.decompress_flat(packet.with_payload(total)).div_(world))
    for group, (_, _, x) in zip(groups, prepared):
        if group.compressor is compressor:
            exchanged = _compress_group(state, group, x, None, all_reduce)
            assert isinstance(exchanged, FlatExchanged)
            group.put(buffer, exchanged.mean)
    state.ledger.record_shared(bucket.index(), 0)
    observe_decoded(state, buffer)
    return comm.completed(buffer)
