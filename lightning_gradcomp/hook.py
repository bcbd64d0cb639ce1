"""The DDP communication hook: per-parameter compression inside each bucket, overlapping backward.

For each bucket DDP hands us (in the order buckets become ready, identical on every rank):

1. per parameter, by name: layer transforms (clipping, momentum correction), then error feedback;
2. one small max all-reduce of the compressors' local statistics (TernGrad's shared scaler), waited for;
3. in pipelined groups of consecutive parameters (``pipeline_bytes`` of input each; one group by default):
   compress every parameter of the group, update residuals, record statistics (as tensors, no host sync),
   then launch the group's collectives before compressing the next group, so compression of one group
   overlaps the transfer of the previous;
4. one collective per channel and group, in a fixed order: an all-reduce per payload dtype for summable
   packets, and one all-gather of the byte-concatenated packets that must be gathered;
5. when all of them complete: decode, average, and write into the bucket's buffer in place (compressors
   that can decode straight into the bucket view do, see ``Compressor.decompress_mean_into``).

Collectives are only launched here, never from ``.then`` callbacks (see :mod:`lightning_gradcomp.comm`).
"""

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp import comm
from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.guard import (
    NonFinite,
    begin_step,
    bucket_is_nonfinite,
    can_share_collective,
    local_flag,
    observe_decoded,
    remember_residual,
)
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.memory import ResidualMemory
from lightning_gradcomp.pipeline import LayerTransform
from lightning_gradcomp.planner import BucketPlan
from lightning_gradcomp.stats import NO_TIMER, HookStats


@dataclass
class LayerRecord:
    """What the hook last did for one parameter (tensors stay on device until someone logs them)."""

    nbytes: int
    numel: int
    aggregation: Aggregation
    stats: dict[str, Tensor]


@dataclass
class GradCompState:
    """Hyper-parameters and mutable state of :func:`gradcomp_hook`.

    Attributes:
        compressor: compresses every parameter not kept in float.
        names: parameter object id -> parameter name (DDP hands the module's own parameter objects).
        float_names: names of parameters sent uncompressed (fp32 all-reduce).
        transforms: per-layer transforms applied before compression, in order.
        process_group: the group to exchange with (``None``: the default group).
        world_size: ranks in ``process_group``.
        memory: residuals for compressors with error feedback.
        records: the latest :class:`LayerRecord` per parameter name.
        shared_stat_bytes: bytes of the statistic all-reduce in the latest round per bucket index.
        collectives: how many collectives of each kind ran since the last reset.
        hook_calls: number of bucket hook calls since construction.
        nonfinite: what a NaN/Inf gradient on any rank does: ``"skip"`` the step everywhere, ``"raise"``, or
            ``"ignore"`` (see :mod:`lightning_gradcomp.guard`).
        step_nonfinite: whether the current (or last) step was found non-finite and skipped.
        skipped_steps: steps skipped for non-finite gradients since construction.
        residual_undo: residuals replaced so far in this step, to roll back if the step is skipped.
        per_rank: when not ``None``, each gathered parameter's per-rank decoded gradients (in rank order) are
            kept here by name after every exchange (WeightGrad's serial per-worker application needs them).
        dense: when set, every parameter is sent uncompressed (fp32 all-reduce) until it is cleared, e.g. for
            a dense warm-up (:class:`~lightning_gradcomp.callbacks.CompressionSchedule`). It must be set
            identically on every rank before the step's backward. Residuals are neither added nor cleared
            while it is set.
        planner: a :class:`~lightning_gradcomp.planner.CollectivePlanner` that picks each bucket's collective
            from a cost model of the link (``None``: always compress, the compressor's own collective).
        bucket_plan: the planner's plan of the bucket being exchanged (``None``: no planner, or nothing to plan).
        stats: where the hook records times and captured statistics for a monitor (``None``: not monitored).
        pipeline_bytes: bytes of input per pipelined group within a bucket (``None``: the whole bucket in one
            group). Each group gets its own collectives; results are identical either way.
        decoded_flags: this step's cheap non-finite flags of the decoded buckets (see ``guard.observe_decoded``).
        consecutive_skips: skipped steps in a row, counted by ``guard.end_backward``.
        counted_hook_calls: ``hook_calls`` when ``guard.end_backward`` last counted a step.
    """

    compressor: Compressor
    names: dict[int, str]
    float_names: frozenset[str] = frozenset()
    transforms: Sequence[LayerTransform] = ()
    process_group: Optional[dist.ProcessGroup] = None
    world_size: int = 1
    identity: Compressor = field(default_factory=Identity)
    memory: ResidualMemory = field(default_factory=ResidualMemory)
    records: dict[str, LayerRecord] = field(default_factory=dict)
    shared_stat_bytes: dict[int, int] = field(default_factory=dict)
    collectives: Counter = field(default_factory=Counter)
    hook_calls: int = 0
    # -- non-finite guard (lightning_gradcomp.guard) --
    nonfinite: NonFinite = "skip"
    step_nonfinite: bool = False
    skipped_steps: int = 0
    residual_undo: dict[str, Optional[Tensor]] = field(default_factory=dict)
    #: whether DDP handed over its last bucket since the strategy last cleared this (after each synchronizing
    #: backward): a bucket never handed over holds a parameter this rank computed no gradient for
    last_bucket_seen: bool = False
    per_rank: Optional[dict[str, list[Tensor]]] = None
    dense: bool = False
    planner: Optional[Any] = None
    bucket_plan: Optional[BucketPlan] = None
    #: further per-rank state saved with the checkpoint: name -> object with ``state_dict``/``load_state_dict``
    #: (e.g. WeightGrad's synchronizer: accumulators, staleness counters, G_thresh)
    extra: dict[str, Any] = field(default_factory=dict)
    stats: Optional[HookStats] = None
    pipeline_bytes: Optional[int] = None
    #: reused concatenation and all-gather buffers (see :class:`~lightning_gradcomp.comm.Scratch`)
    scratch: comm.Scratch = field(default_factory=comm.Scratch)
    # -- the guard's end of backward (guard.observe_decoded, guard.end_backward) --
    decoded_flags: list[Tensor] = field(default_factory=list)
    consecutive_skips: int = 0
    counted_hook_calls: int = 0
    #: the hierarchical exchange's sites and groups (:class:`~lightning_gradcomp.hierarchy.SiteExchange`); ``None``:
    #: flat. When set, ``process_group`` is the cross-site group, ``world_size`` the number of sites, and the records
    #: hold this rank's share only, so :meth:`bytes_per_step` is what this rank puts on the link between sites
    hierarchy: Optional[Any] = None

    def compressor_for(self, name: str) -> Compressor:
        if self.dense or name in self.float_names:
            return self.identity
        if self.bucket_plan is not None:
            return self.bucket_plan.compressor_for(self.compressor, self.identity)
        return self.compressor

    def bytes_per_step(self) -> int:
        """Bytes this rank contributed to the collectives of one full backward (payloads + shared statistics)."""
        return sum(r.nbytes for r in self.records.values()) + sum(self.shared_stat_bytes.values())

    def dense_bytes_per_step(self) -> int:
        """What plain fp32 DDP would have contributed for the same parameters."""
        return sum(4 * r.numel for r in self.records.values())


def _prepare(state: GradCompState, grads: Sequence[Tensor], names: Sequence[str], observe: bool = True) -> list[Tensor]:
    """Transforms and error feedback, per parameter; returns what each compressor will see.

    ``observe=False`` leaves the monitor's input statistics to a later :func:`_observe_inputs`, for a bucket whose
    non-finite check is decided later (a histogram of a NaN gradient fails).
    """
    transformed = []
    for grad, name in zip(grads, names):
        x = grad
        is_float = name in state.float_names
        for transform in state.transforms:
            if transform.applies_to_float or not is_float:
                x = transform.before_compress(x, name)
        transformed.append(x)
    if observe:
        _observe_inputs(state, grads, transformed, names)
    inputs = []
    for x, name in zip(transformed, names):
        if state.compressor_for(name).uses_memory:
            state.compressor_for(name).observe_gradient(x, name)
            x = state.memory.compensate(x, name)
        inputs.append(x)
    return inputs


def _observe_inputs(state: GradCompState, grads: Sequence[Tensor], inputs: Sequence[Tensor], names: Sequence[str]) -> None:
    """The monitor's input statistics: each gradient before and after the transforms (before error feedback)."""
    if state.stats is not None:
        for grad, x, name in zip(grads, inputs, names):
            state.stats.observe_input(name, grad, x, state.compressor_for(name))


def _shared_statistics(
    state: GradCompState, bucket_index: int, inputs: Sequence[Tensor], names: Sequence[str], flag: Optional[Tensor] = None
) -> tuple[list[Optional[Tensor]], Optional[int]]:
    """Each compressor's local statistic, max-reduced over ranks in one small collective per bucket.

    ``flag`` (the non-finite guard's, one float32) is reduced in the same collective, after the statistics;
    returns the statistics and the reduced flag (``None`` without one).
    """
    local = [state.compressor_for(n).local_statistic(x, n) for x, n in zip(inputs, names)]
    present = [s.reshape(-1).float() for s in local if s is not None]
    if not present and flag is None:
        state.shared_stat_bytes[bucket_index] = 0
        return local, None
    flat = torch.cat(present + ([] if flag is None else [flag.reshape(1).float()]))
    if state.world_size > 1:
        with _waiting(state):
            comm.all_reduce_max_(flat, state.process_group)
        state.collectives["allreduce_max"] += 1
    worst = None if flag is None else int(flat[-1].item())
    # the statistics' bytes (the guard's flag is not counted, as when it travels alone)
    state.shared_stat_bytes[bucket_index] = (flat.numel() - (flag is not None)) * flat.element_size()
    shared: list[Optional[Tensor]] = []
    offset = 0
    for s in local:
        if s is None:
            shared.append(None)
        else:
            shared.append(flat[offset : offset + s.numel()].view_as(s))
            offset += s.numel()
    return shared, worst


def _waiting(state: GradCompState) -> contextlib.AbstractContextManager[None]:
    """Times a collective the hook body blocks on, when monitored."""
    return state.stats.blocking() if state.stats is not None else contextlib.nullcontext()


def _as_bytes(payload: Tensor) -> Tensor:
    return payload.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(raw: Tensor, dtype: torch.dtype) -> Tensor:
    # a slice of the gathered byte buffer may be misaligned for wider dtypes: copy before reinterpreting
    return raw if dtype == torch.uint8 else raw.clone().view(dtype)


def gradcomp_hook(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that compresses each parameter of ``bucket`` and exchanges the packets.

    Register with ``ddp_model.register_comm_hook(state, gradcomp_hook)``. Every rank ends with the same
    averaged, decoded gradient in ``bucket.buffer()``.
    """
    # backward can run under the user's autocast (manual optimization); compression maths must keep the dtypes
    # it chose (autocast's type promotion rejects e.g. torch.cat of fp16 payloads under CPU bf16 autocast)
    with torch.autocast(bucket.buffer().device.type, enabled=False):
        return _exchange_bucket(state, bucket)


def _exchange_bucket(state: GradCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.hook_calls += 1
    if bucket.is_last():
        state.last_bucket_seen = True
    timer = state.stats.start_bucket() if state.stats is not None else NO_TIMER
    grads = bucket.gradients()
    names = [state.names[id(p)] for p in bucket.parameters()]
    if state.planner is not None:  # may run one small agreed all-reduce the first time it sees this bucket
        state.bucket_plan = state.planner.plan(state, names, grads)

    # non-finite guard: decided identically on every rank before transforms and residuals see the gradient
    if bucket.index() == 0:
        begin_step(state)
    multiround = isinstance(state.compressor, MultiRoundCompressor) and not state.dense
    # with nothing stateful before the statistics, the guard's flag rides in their all-reduce: one blocking
    # round trip per bucket instead of two (each one a point where every rank waits for the slowest)
    shared_flag = not multiround and can_share_collective(state, names)
    if not shared_flag and bucket_is_nonfinite(state, bucket.buffer(), grads, names):
        return comm.completed(bucket.buffer().fill_(float("nan")))
    if multiround:
        return _multiround_exchange(state, bucket, grads, names)

    inputs = _prepare(state, grads, names, observe=not shared_flag)
    flag = local_flag(state, bucket.buffer()) if shared_flag else None
    shared, worst = _shared_statistics(state, bucket.index(), inputs, names, flag)
    if shared_flag:
        if bucket_is_nonfinite(state, bucket.buffer(), grads, names, worst=worst):
            return comm.completed(bucket.buffer().fill_(float("nan")))
        _observe_inputs(state, grads, inputs, names)

    decoders = []
    futures: list[torch.futures.Future] = []
    for chunk in pipeline_chunks([x.numel() * x.element_size() for x in inputs], state.pipeline_bytes):
        # compress one chunk, then launch its collectives before compressing the next: the next chunk's
        # compression overlaps this chunk's transfer
        packets = [_compress_one(state, inputs[i], names[i], shared[i]) for i in chunk]
        key = (bucket.index(), len(decoders))
        chunk_futures, decoder = _launch(state, key, chunk, packets, names, grads)
        futures.extend(chunk_futures)
        decoders.append(decoder)
    timer.launched()

    def decode(_: object) -> Tensor:
        timer.decode_started()
        for decoder in decoders:
            decoder()
        observe_decoded(state, bucket.buffer())  # an encoding may overflow: finite in, non-finite out
        timer.decode_done()
        return bucket.buffer()

    if not futures:
        return comm.completed(decode(None))
    return torch.futures.collect_all(futures).then(lambda fut: decode(fut.wait()))


def pipeline_chunks(nbytes: Sequence[int], limit: Optional[int]) -> list[list[int]]:
    """Consecutive parameter indices grouped so each group holds about ``limit`` bytes of input.

    A group closes once it reaches ``limit``; a parameter is never split. ``None`` (or 0): one group. Sizes
    are the same on every rank, so every rank forms the same groups and issues the same collectives.
    """
    if not limit:
        return [list(range(len(nbytes)))] if nbytes else []
    chunks: list[list[int]] = [[]]
    filled = 0
    for i, n in enumerate(nbytes):
        if chunks[-1] and filled >= limit:
            chunks.append([])
            filled = 0
        chunks[-1].append(i)
        filled += n
    return chunks


def _compress_one(state: GradCompState, x: Tensor, name: str, shared: Optional[Tensor]) -> Packet:
    """Compress one parameter; update its residual and the transforms; record what was sent."""
    compressor = state.compressor_for(name)
    packet = compressor.compress(x, name, shared)
    sent: Optional[Tensor] = None
    if compressor.uses_memory or state.transforms:
        sent = compressor.sent(x, packet)
        if compressor.uses_memory:
            remember_residual(state, name)
            state.memory.update(name, x, sent)
        for transform in state.transforms:
            if transform.applies_to_float or name not in state.float_names:
                transform.after_compress(name, x, sent)
    if state.stats is not None:
        state.stats.observe_packet(name, compressor, x, packet, sent)
    state.records[name] = LayerRecord(
        nbytes=packet.nbytes,
        numel=x.numel(),
        aggregation=compressor.aggregation_for(state.world_size),
        stats=packet.stats,
    )
    return packet


def _concat(state: GradCompState, key: tuple[object, ...], parts: Sequence[Tensor], numel: int) -> Tensor:
    """``parts`` (1-D, one dtype) concatenated into a reused buffer of ``numel >= sum`` elements, zero-padded."""
    used = sum(p.numel() for p in parts)
    flat = state.scratch.take(key, numel, parts[0].dtype, parts[0].device)
    torch.cat(parts, out=flat[:used])
    if numel > used:
        flat[used:].zero_()
    return flat


def _launch(
    state: GradCompState,
    key: tuple[int, int],
    chunk: Sequence[int],
    packets: Sequence[Packet],
    names: Sequence[str],
    grads: Sequence[Tensor],
) -> tuple[list[torch.futures.Future], Callable[[], None]]:
    """Start the collectives of one group of packets; returns their futures and the decoder to run after them.

    Channels: summable payloads grouped by dtype (one all-reduce each), the rest as bytes (one all-gather).
    ``key`` (bucket index, group index) names the group's reused buffers.
    """
    world = state.world_size
    sum_groups: dict[torch.dtype, list[int]] = {}
    gather_idx: list[int] = []
    for k, (i, packet) in enumerate(zip(chunk, packets)):
        if state.compressor_for(names[i]).aggregation_for(world) is Aggregation.SUM:
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
            futures.append(comm.all_reduce_sum(flat, state.process_group))
            state.collectives[f"allreduce_{str(dtype).removeprefix('torch.')}"] += 1
        sum_buffers.append((idx, flat))

    gathered: Optional[Tensor] = None
    sizes: list[list[int]] = []  # per rank, the byte length of each gathered packet
    if gather_idx:
        own = [packets[k].nbytes for k in gather_idx]
        parts = [_as_bytes(packets[k].payload) for k in gather_idx]
        longest = sum(own)
        if world > 1 and not all(state.compressor_for(names[chunk[k]]).fixed_size for k in gather_idx):
            # variable-size payloads: sizes first (waited for), then every rank pads to the largest total
            with _waiting(state):
                table = comm.all_gather_sizes(torch.tensor(own, dtype=torch.int64, device=parts[0].device),
                                              state.process_group, world)
            state.collectives["allgather_sizes"] += 1
            sizes = table.tolist()
            longest = max(sum(row) for row in sizes)
        else:
            sizes = [own] * world
        flat = _concat(state, (*key, "gather"), parts, longest)
        if world > 1 and flat.numel() > 0:
            out = state.scratch.take((*key, "gathered"), world * flat.numel(), flat.dtype, flat.device)
            fut, gathered = comm.all_gather(flat, state.process_group, world, out=out)
            futures.append(fut)
            state.collectives["allgather"] += 1
        else:
            gathered = flat.new_zeros((world, 0)) if flat.numel() == 0 else flat.unsqueeze(0)

    def decode() -> None:
        for idx, flat in sum_buffers:
            offset = 0
            for k in idx:
                i, packet = chunk[k], packets[k]
                n = packet.payload.numel()
                total = state.compressor_for(names[i]).decompress(packet.with_payload(flat[offset : offset + n]))
                grads[i].copy_(total.div_(world) if total.is_floating_point() else total.float() / world)
                if state.stats is not None:
                    state.stats.observe_averaged(names[i], grads[i])
                offset += n
        if gather_idx:
            assert gathered is not None
            starts = [0] * world
            for j, k in enumerate(gather_idx):
                i, packet = chunk[k], packets[k]
                compressor = state.compressor_for(names[i])
                per_rank = []
                for r in range(world):
                    raw = gathered[r, starts[r] : starts[r] + sizes[r][j]]
                    per_rank.append(packet.with_payload(_from_bytes(raw, packet.payload.dtype)))
                    starts[r] += sizes[r][j]
                # decoded and averaged straight into DDP's bucket view: no full-size temporary
                compressor.decompress_mean_into(per_rank, grads[i])
                if state.per_rank is not None:
                    state.per_rank[names[i]] = [compressor.decompress(q) for q in per_rank]
                if state.stats is not None:
                    state.stats.observe_averaged(names[i], grads[i])

    return futures, decode


# -- multi-round compressors (PowerSGD) ------------------------------------------------------------------------
# A separate path: it leaves the one-shot path above untouched. Every round is a blocking all-reduce issued from
# the hook body, in the order the compressor calls it (which depends only on shapes and names), so the sequence
# of collectives is identical on every rank whatever the number of buckets. Nothing is left for ``.then``.


def _multiround_exchange(
    state: GradCompState, bucket: dist.GradBucket, grads: Sequence[Tensor], names: Sequence[str]
) -> torch.futures.Future[torch.Tensor]:
    """Transforms and error feedback, then fp32 layers in one all-reduce, then the compressor's rounds."""
    compressor = state.compressor
    assert isinstance(compressor, MultiRoundCompressor)
    world = state.world_size
    inputs = _prepare(state, grads, names)

    def all_reduce(tensor: Tensor) -> Tensor:
        if world > 1:
            comm.all_reduce_sum(tensor, state.process_group).wait()
            state.collectives["allreduce_round"] += 1
        return tensor

    def finish(i: int, mean: Tensor, sent: Tensor, nbytes: int, stats: dict[str, Tensor]) -> None:
        name, x = names[i], inputs[i]
        is_float = name in state.float_names
        if state.compressor_for(name).uses_memory:
            state.memory.update(name, x, sent)
        for transform in state.transforms:
            if transform.applies_to_float or not is_float:
                transform.after_compress(name, x, sent)
        state.records[name] = LayerRecord(nbytes=nbytes, numel=x.numel(), aggregation=Aggregation.SUM, stats=stats)
        grads[i].copy_(mean)

    float_idx = [i for i, n in enumerate(names) if n in state.float_names]
    if float_idx:
        flat = all_reduce(torch.cat([inputs[i].reshape(-1) for i in float_idx]))
        offset = 0
        for i in float_idx:
            n = inputs[i].numel()
            finish(i, flat[offset : offset + n].view_as(inputs[i]) / world, inputs[i], n * inputs[i].element_size(), {})
            offset += n
    compressed_idx = [i for i, n in enumerate(names) if n not in state.float_names]
    if compressed_idx:
        results = compressor.exchange([inputs[i] for i in compressed_idx], [names[i] for i in compressed_idx], all_reduce)
        for i, result in zip(compressed_idx, results):
            finish(i, result.mean, result.sent, result.nbytes, result.stats)
    state.shared_stat_bytes[bucket.index()] = 0
    observe_decoded(state, bucket.buffer())
    return comm.completed(bucket.buffer())
