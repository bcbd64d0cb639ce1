"""What the hook did: per-layer records, bytes on the wire, collectives issued, bucket calls.

The one place bytes are counted: :meth:`Ledger.bytes_per_step` (the run's mean per step, :class:`RunBytes`) and
:meth:`Ledger.last_step_bytes` are what the monitor, the progress bar, WeightGrad and the benchmarks report. Only the
ledger's methods change them; the hook, the guard, the planner and the hierarchical exchange report to it.

Every strategy of the library answers the same question the same way (:class:`ByteReport`):
``strategy.bytes_per_step()`` (per rank and step, averaged over the run so far, warm-up included, an int),
``strategy.last_step_bytes()`` and ``strategy.dense_bytes_per_step()``, read from its ledgers. The progress bar's
``comp_ratio`` and :class:`~lightning_gradcomp.callbacks.CompressionMonitor`'s totals are these two.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional, Protocol, Union, runtime_checkable

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.flat import FlatPacket, Segments


#: bytes per element of the reference every ratio is taken against: fp32 DDP
DENSE_ELEMENT_BYTES = 4


def dense_bytes(numel: int) -> int:
    """What fp32 DDP sends for ``numel`` elements: the one formula of the reference."""
    return DENSE_ELEMENT_BYTES * numel


def tensor_bytes(tensor: Tensor, numel: Optional[int] = None) -> int:
    """Bytes ``tensor`` puts on the wire as it is (or ``numel`` of its elements): the one formula of a dense
    tensor's size, for what travels uncompressed (a site's dense reduce, buffers, shared statistics)."""
    return (tensor.numel() if numel is None else numel) * tensor.element_size()


@runtime_checkable
class ByteReport(Protocol):
    """What every strategy of the library reports about its traffic (``GradCompStrategy``, ``DiLoCoStrategy``,
    ``WeightGradStrategy``, ``TowerStrategy``, ``GradCompFabricStrategy``, the sharded strategies).

    One meaning for every strategy: **bytes per rank per optimizer step, averaged over the run so far, warm-up
    included, an ``int``** (the run's total floored by its step count, :meth:`RunBytes.mean`), and the latest step
    apart (:meth:`last_step_bytes`). Both are read from what the exchange recorded as it ran (the hook's
    :class:`Ledger`; the outer rounds' :class:`RunBytes`, itself fed from the outer hook's ledger), never estimated;
    0 before the first exchange.

    The bytes are those this rank puts on the link the compression is for. Flat exchange (``GradCompStrategy``,
    Fabric, 1-bit Adam): everything this rank sends to the other ranks (payloads and shared statistics; a dense
    warm-up step's fp32). Hierarchical exchange: this rank's share between sites. ``TowerStrategy``: one emulated
    worker's. Strategies whose sites step apart (``DiLoCoStrategy``, ``WeightGradStrategy``): what this rank puts
    between sites (0 with one site, where nothing crosses between sites); the in-site exchange is the monitor's
    ``lan_bytes``.
    """

    def bytes_per_step(self) -> int:
        """Bytes this rank put on the link per optimizer step, averaged over the run so far (warm-up included)."""
        ...

    def last_step_bytes(self) -> int:
        """Bytes this rank put on the link in the latest optimizer step (the same link as :meth:`bytes_per_step`)."""
        ...

    def dense_bytes_per_step(self) -> float:
        """What fp32 DDP would send per rank and step for the same parameters (``bytes_per_step``'s reference)."""
        ...


class RunBytes:
    """Bytes one rank put on a link over a run, step by step: the one implementation of :class:`ByteReport`'s mean.

    A step's bytes may be an int or a device tensor of sizes (a variable-size group's per-layer bytes): tensors are
    kept as they are and summed on the host only when a total is read (a report), so counting a step never reads
    the device in the hook.

    Args:
        total: bytes so far (a resumed run's).
        steps: optimizer steps so far (a resumed run's).

    Attributes:
        steps: the steps closed so far (:meth:`end_step`).
    """

    #: device parts kept before they are folded into one (on the device, without a host read): bounds what a run
    #: that never reads its bytes holds
    FOLD_AFTER = 256

    def __init__(self, total: int = 0, steps: int = 0) -> None:
        self._total = int(total)
        self._pending: list[Tensor] = []
        self.steps = int(steps)
        self._last: list[Union[int, Tensor]] = []
        self._current: list[Union[int, Tensor]] = []

    def add(self, nbytes: Union[int, Tensor]) -> None:
        """``nbytes`` more put on the link in the step under way (a tensor: the sum of its elements)."""
        self._current.append(nbytes if isinstance(nbytes, Tensor) else int(nbytes))

    def end_step(self) -> None:
        """The step under way is over: its bytes become :attr:`last`."""
        self._count(self._current)
        self._last, self._current = self._current, []
        self.steps += 1

    def fold_into_last(self) -> None:
        """What :meth:`add` counted since the last step closed belongs to that step (a round run after the last
        step, such as DiLoCo's final round at the end of ``fit``): no step of its own."""
        self._count(self._current)
        self._last, self._current = self._last + self._current, []

    def _count(self, parts: list[Union[int, Tensor]]) -> None:
        for part in parts:
            if isinstance(part, Tensor):
                self._pending.append(part)
            else:
                self._total += part
        if len(self._pending) > self.FOLD_AFTER:
            folded = torch.zeros((), dtype=torch.int64, device=self._pending[0].device)
            for part in self._pending:
                folded += part.sum().to(folded.device)
            self._pending = [folded]

    @property
    def total(self) -> int:
        """Every byte counted in closed steps (reads the device once per kept tensor)."""
        if self._pending:
            self._total += sum(int(part.sum()) for part in self._pending)
            self._pending = []
        return self._total

    @property
    def last(self) -> int:
        """The bytes of the latest closed step (and of what :meth:`fold_into_last` counted into it)."""
        return _resolve(self._last)

    def mean(self, open_step: Optional[int] = None) -> int:
        """Bytes per step over the run so far, floored to an int (0 before the first step).

        Args:
            open_step: the bytes of a step under way that is counted as one more step (the hook's ledger closes a
                step when the next one begins, so the latest step is still open when read between steps).
        """
        steps = self.steps + (open_step is not None)
        return (self.total + (open_step or 0)) // steps if steps else 0


def _resolve(parts: Iterable[Union[int, Tensor]]) -> int:
    """The bytes of a step's parts (a host read per tensor)."""
    return sum(int(part.sum()) if isinstance(part, Tensor) else part for part in parts)


def joint_bytes_per_step(ledgers: Iterable["Ledger"]) -> int:
    """:meth:`Ledger.bytes_per_step` of exchanges recorded in several ledgers that step together (the reduce-scatter
    and the weight all-gather across nodes): their runs' bytes, the latest step included, over their step count
    (the largest, should one ledger have opened the next step already). Summing each ledger's floored mean instead
    could be a byte short."""
    states = [ledger.run_state() for ledger in ledgers]
    steps = max((state["steps"] for state in states), default=0)
    return sum(state["total"] for state in states) // steps if steps else 0


@dataclass
class LayerRecord:
    """What the hook last did for one parameter (tensors stay on device until someone logs them)."""

    nbytes: int
    numel: int
    aggregation: Aggregation
    stats: dict[str, Tensor]


@dataclass
class GroupRecord:
    """What the hook last did for a group of layers compressed together (the batched pipeline).

    Attributes:
        segments: the group's layout.
        layer_nbytes: bytes per layer, host integers or an int64 device tensor (read only when asked).
        aggregation: how the group travelled.
        stats: per-layer statistics as ``[layers]`` device tensors (a batched compressor's).
        layer_stats: per-layer statistics of the looping path, one dict per layer.
    """

    segments: Segments
    layer_nbytes: Union[tuple[int, ...], Tensor]
    aggregation: Aggregation
    stats: dict[str, Tensor]
    layer_stats: Optional[list[dict[str, Tensor]]] = None

    @classmethod
    def of(cls, packet: FlatPacket, aggregation: Aggregation) -> "GroupRecord":
        """The record of a group packet that travelled as ``aggregation``."""
        layer_stats = None if packet.layers is None else [p.stats for p in packet.layers]
        return cls(packet.segments, packet.layer_nbytes, aggregation, packet.stats, layer_stats)

    def nbytes(self) -> int:
        """Bytes of the whole group (one host read when the sizes are a device tensor)."""
        sizes = self.layer_nbytes
        return sum(sizes) if isinstance(sizes, tuple) else int(sizes.sum())

    def layers(self) -> dict[str, LayerRecord]:
        """One :class:`LayerRecord` per layer (a logging step's cost: a host read and a slice per statistic)."""
        sizes = self.layer_nbytes
        nbytes = list(sizes) if isinstance(sizes, tuple) else [int(n) for n in sizes.tolist()]
        out = {}
        for i, (name, numel) in enumerate(zip(self.segments.names, self.segments.numels)):
            stats = self.layer_stats[i] if self.layer_stats is not None else {k: v[i] for k, v in self.stats.items()}
            out[name] = LayerRecord(nbytes=nbytes[i], numel=numel, aggregation=self.aggregation, stats=stats)
        return out


class Ledger:
    """The hook's accounting for one :class:`~lightning_gradcomp.exchange.hook.GradCompState`.

    Args:
        keep_per_rank: keep each gathered parameter's per-rank decoded gradients (WeightGrad's serial per-worker
            application needs them).

    Attributes:
        records: the latest :class:`LayerRecord` per parameter name (a group's records are made when read).
        shared_stat_bytes: bytes of the statistic all-reduce in the latest round, per bucket index.
        size_bytes: bytes of the sizes a variable-size gather sent ahead of its payloads in the latest round, per
            (bucket index, chunk index); not in :meth:`last_step_bytes` (see :meth:`bytes_of`).
        lan_bytes: bytes this rank sent inside its site in the latest round of the hierarchical exchange, per
            bucket index (the site's reduce to the share owners and gather back; not in :meth:`last_step_bytes`,
            which counts the link between sites).
        channels: bytes this rank put on each named link of a transport that spans two, since
            :meth:`take_channel` last read it (``"lan"``: the fan-out inside a site of
            :class:`~lightning_gradcomp.sites.transport.SiteLeadersTransport`; ``"wan"``: what crosses between
            sites outside the exchange's records, such as buffers and WeightGrad's trigger flags).
        collectives: how many collectives of each kind ran.
        hook_calls: bucket hook calls since construction.
        per_rank: with ``keep_per_rank``, the per-rank decoded gradients of the latest exchange, by name.
        run: the bytes of the exchanges before the latest one (:class:`RunBytes`; one step per exchange that
            began at bucket 0, see :meth:`bucket_called`).
        link_runs: the run's bytes on each named link whose steps an engine closes itself (``"wan"``: the outer
            engine's bytes between sites, step by inner step; see :meth:`record_link`).
    """

    def __init__(self, keep_per_rank: bool = False) -> None:
        self._singles: dict[str, LayerRecord] = {}
        self._groups: dict[tuple[str, ...], GroupRecord] = {}
        self._owner: dict[str, tuple[str, ...]] = {}
        self._records: Optional[dict[str, LayerRecord]] = None
        self.shared_stat_bytes: dict[int, int] = {}
        self.size_bytes: dict[tuple[int, int], int] = {}
        self.lan_bytes: dict[int, int] = {}
        self.channels: Counter = Counter()
        self.collectives: Counter = Counter()
        self.hook_calls = 0
        self.per_rank: Optional[dict[str, list[Tensor]]] = {} if keep_per_rank else None
        # whether DDP handed over its last bucket since :meth:`take_last_bucket_seen`: a bucket never handed over
        # holds a parameter this rank computed no gradient for
        self._last_bucket_seen = False
        self.run = RunBytes()
        self.link_runs: dict[str, RunBytes] = {}
        # whether an exchange began (bucket 0) whose bytes are not in ``run`` yet: the latest step, read live from
        # the records until the next exchange begins (1-bit Adam records its step's exchange after the hook ran)
        self._step_open = False
        # the names recorded by :meth:`record_more` in the exchange under way
        self._more_this_exchange: set[str] = set()

    def bucket_called(self, is_last: bool, first: bool = False) -> None:
        """A bucket reached the hook (``first``: bucket 0, the start of a new exchange: the previous one's bytes,
        complete by now, go into :attr:`run`)."""
        if first:
            if self._step_open:
                for part in self._step_parts():
                    self.run.add(part)
                self.run.end_step()
            self._step_open = True
            self._more_this_exchange.clear()
        self.hook_calls += 1
        if is_last:
            self._last_bucket_seen = True

    def take_last_bucket_seen(self) -> bool:
        """Whether the last bucket arrived since the previous call (then forgotten: one answer per backward)."""
        seen, self._last_bucket_seen = self._last_bucket_seen, False
        return seen

    def count(self, kind: str, n: int = 1) -> None:
        """``n`` collectives of ``kind`` were issued."""
        self.collectives[kind] += n

    @property
    def records(self) -> dict[str, LayerRecord]:
        """The latest record of every parameter, by name (made once per change, from the groups and single records)."""
        if self._records is None:
            records = dict(self._singles)
            for group in self._groups.values():
                records.update(group.layers())
            self._records = records
        return self._records

    def record(self, name: str, record: LayerRecord) -> None:
        """One parameter's record."""
        self._release(name)
        self._singles[name] = record
        self._records = None

    def record_more(self, name: str, record: LayerRecord) -> None:
        """One more record of ``name`` in the exchange under way, added to its earlier ones of the same exchange (an
        FSDP2 unit all-gathers its weights twice a step, in forward and in backward); the first of an exchange
        replaces the previous exchange's."""
        earlier = self._singles.get(name) if name in self._more_this_exchange else None
        self._more_this_exchange.add(name)
        if earlier is not None:
            record = LayerRecord(earlier.nbytes + record.nbytes, earlier.numel + record.numel, record.aggregation,
                                 record.stats)
        self.record(name, record)

    def record_group(self, group: GroupRecord) -> None:
        """A group's record; replaces the records of its names, and a stale group (an old bucket layout) that held any."""
        key = group.segments.names
        for name in key:
            if self._owner.get(name) != key:
                self._release(name)
            self._singles.pop(name, None)
            self._owner[name] = key
        self._groups[key] = group
        self._records = None

    def drop_group(self, names: tuple[str, ...]) -> None:
        """Forget the records of ``names``: compressed, but kept on this rank (a reduce-scatter's own piece), so
        neither its bytes nor its fp32 reference count."""
        for name in names:
            self._release(name)
            self._singles.pop(name, None)
        self._records = None

    def _release(self, name: str) -> None:
        key = self._owner.get(name)
        if key is not None:
            group = self._groups.pop(key)
            for n in key:
                del self._owner[n]
            self._singles.update(group.layers())

    def record_shared(self, bucket_index: int, nbytes: int) -> None:
        """Bytes of a bucket's shared-statistics all-reduce this round."""
        self.shared_stat_bytes[bucket_index] = nbytes

    def record_sizes(self, key: tuple[int, int], nbytes: int) -> None:
        """Bytes of the sizes chunk ``key`` (bucket index, chunk index) sent ahead of its gathered payloads this round
        (0: none: fixed sizes, or nothing gathered)."""
        self.size_bytes[key] = nbytes

    def record_lan(self, bucket_index: int, nbytes: int) -> None:
        """Bytes this rank sent inside its site for a bucket this round (the hierarchical exchange's fast link)."""
        self.lan_bytes[bucket_index] = nbytes

    def lan_bytes_per_step(self) -> int:
        """Bytes this rank sent inside its site in the latest step of the hierarchical exchange (the monitor's
        ``lan_bytes``)."""
        return sum(self.lan_bytes.values())

    def record_channel(self, channel: str, nbytes: int) -> None:
        """``nbytes`` more put on the link ``channel`` (a transport's second link, e.g. ``"lan"``)."""
        self.channels[channel] += nbytes

    def take_channel(self, channel: str) -> int:
        """Bytes put on ``channel`` since the last call (then forgotten)."""
        return self.channels.pop(channel, 0)

    def record_link(self, channel: str, nbytes: int) -> None:
        """``nbytes`` this rank put on the link ``channel`` in the step under way, read off this ledger (an outer
        round's records and buffers), into the link's run bytes (:meth:`link_run`). Unlike :meth:`record_channel`,
        no later :meth:`take_channel` sees them."""
        self.link_run(channel).add(nbytes)

    def close_link_step(self, channel: str) -> None:
        """The step under way is over on ``channel``: what :meth:`record_channel` put on it since
        :meth:`take_channel` last read it (WeightGrad's trigger flags) joins the step's :meth:`record_link` bytes,
        and the step closes."""
        run = self.link_run(channel)
        run.add(self.take_channel(channel))
        run.end_step()

    def fold_link_step(self, channel: str) -> None:
        """What :meth:`record_link` put on ``channel`` since its last step closed belongs to that step (rounds run
        after the last step, such as DiLoCo's final round at the end of ``fit``)."""
        self.link_run(channel).fold_into_last()

    def link_run(self, channel: str) -> RunBytes:
        """The run's bytes on the link ``channel``, step by step (empty until something is recorded on it)."""
        return self.link_runs.setdefault(channel, RunBytes())

    def restore_link_run(self, channel: str, total: int, steps: int) -> None:
        """Continue a resumed run's bytes on ``channel`` (``total`` over ``steps`` closed steps)."""
        self.link_runs[channel] = RunBytes(total, steps)

    def keep_per_rank(self, name: str, decoded: list[Tensor]) -> None:
        if self.per_rank is not None:
            self.per_rank[name] = decoded

    def bytes_per_step(self) -> int:
        """Bytes this rank contributed per exchange (one full backward), averaged over the exchanges so far, the
        latest included (:meth:`RunBytes.mean`; :class:`ByteReport`'s meaning); 0 before the first."""
        return self.run.mean(self.last_step_bytes() if self._step_open else None)

    def last_step_bytes(self) -> int:
        """Bytes this rank contributed to the collectives of the latest full backward (payloads + shared statistics),
        from the latest record of every parameter."""
        return self.payload_bytes_per_step() + self.shared_bytes_per_step()

    def run_state(self) -> dict[str, int]:
        """The run's bytes so far as a checkpoint keeps them: the latest exchange counted as a closed step."""
        open_bytes = self.last_step_bytes() if self._step_open else 0
        return {"total": self.run.total + open_bytes, "steps": self.run.steps + int(self._step_open)}

    def load_run_state(self, saved: dict[str, int]) -> None:
        """Continue a resumed run's bytes (:meth:`run_state`), so that :meth:`bytes_per_step` stays the whole run's."""
        self.run = RunBytes(saved["total"], saved["steps"])
        self._step_open = False

    def _step_parts(self) -> list[Union[int, Tensor]]:
        """:meth:`last_step_bytes` as parts, without reading the device: a variable-size group's sizes stay a
        tensor (summed when a report reads :attr:`run`)."""
        parts: list[Union[int, Tensor]] = [r.nbytes for r in self._singles.values()]
        for group in self._groups.values():
            sizes = group.layer_nbytes
            parts.append(sum(sizes) if isinstance(sizes, tuple) else sizes)
        return parts + list(self.shared_stat_bytes.values())

    def payload_bytes_per_step(self) -> int:
        """The payloads' share of :meth:`last_step_bytes`."""
        return sum(r.nbytes for r in self._singles.values()) + sum(g.nbytes() for g in self._groups.values())

    def shared_bytes_per_step(self) -> int:
        """The shared statistics' share of :meth:`last_step_bytes` (their small all-reduce, every bucket)."""
        return sum(self.shared_stat_bytes.values())

    def dense_bytes_per_step(self) -> int:
        """What plain fp32 DDP would have contributed for the same parameters."""
        return dense_bytes(sum(r.numel for r in self._singles.values()) + sum(g.segments.total for g in self._groups.values()))

    def bytes_of(self, names: Iterable[str], bucket_index: int, sizes: bool = False) -> int:
        """Bytes of the latest records of ``names`` plus bucket ``bucket_index``'s shared statistics: one bucket's
        share of :meth:`last_step_bytes` (an outer round's fragment).

        Args:
            names: the bucket's parameters (or some of them).
            bucket_index: the bucket.
            sizes: also the sizes its variable-size gathers sent ahead of the payloads (:attr:`size_bytes`; a WAN
                message counted with its length, as WeightGrad reports it). The per-step reports of the other
                engines leave them out.
        """
        records = self.records
        total = sum(records[n].nbytes for n in names) + self.shared_stat_bytes.get(bucket_index, 0)
        if sizes:
            total += sum(n for (bucket, _), n in self.size_bytes.items() if bucket == bucket_index)
        return total
