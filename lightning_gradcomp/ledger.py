"""What the hook did: per-layer records, bytes on the wire, collectives issued, bucket calls.

The one place bytes are counted: :meth:`Ledger.bytes_per_step` is what the monitor, the progress bar, WeightGrad and
the benchmarks report. Only the ledger's methods change it; the hook, the guard, the planner and the hierarchical
exchange report to it.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation


@dataclass
class LayerRecord:
    """What the hook last did for one parameter (tensors stay on device until someone logs them)."""

    nbytes: int
    numel: int
    aggregation: Aggregation
    stats: dict[str, Tensor]


class Ledger:
    """The hook's accounting for one :class:`~lightning_gradcomp.hook.GradCompState`.

    Args:
        keep_per_rank: keep each gathered parameter's per-rank decoded gradients (WeightGrad's serial per-worker
            application needs them).

    Attributes:
        records: the latest :class:`LayerRecord` per parameter name.
        shared_stat_bytes: bytes of the statistic all-reduce in the latest round, per bucket index.
        collectives: how many collectives of each kind ran.
        hook_calls: bucket hook calls since construction.
        per_rank: with ``keep_per_rank``, the per-rank decoded gradients of the latest exchange, by name.
    """

    def __init__(self, keep_per_rank: bool = False) -> None:
        self.records: dict[str, LayerRecord] = {}
        self.shared_stat_bytes: dict[int, int] = {}
        self.collectives: Counter = Counter()
        self.hook_calls = 0
        self.per_rank: Optional[dict[str, list[Tensor]]] = {} if keep_per_rank else None
        # whether DDP handed over its last bucket since :meth:`take_last_bucket_seen`: a bucket never handed over
        # holds a parameter this rank computed no gradient for
        self._last_bucket_seen = False

    def bucket_called(self, is_last: bool) -> None:
        """A bucket reached the hook."""
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

    def record(self, name: str, record: LayerRecord) -> None:
        self.records[name] = record

    def record_shared(self, bucket_index: int, nbytes: int) -> None:
        """Bytes of a bucket's shared-statistics all-reduce this round."""
        self.shared_stat_bytes[bucket_index] = nbytes

    def keep_per_rank(self, name: str, decoded: list[Tensor]) -> None:
        if self.per_rank is not None:
            self.per_rank[name] = decoded

    def bytes_per_step(self) -> int:
        """Bytes this rank contributed to the collectives of one full backward (payloads + shared statistics)."""
        return sum(r.nbytes for r in self.records.values()) + sum(self.shared_stat_bytes.values())

    def dense_bytes_per_step(self) -> int:
        """What plain fp32 DDP would have contributed for the same parameters."""
        return sum(4 * r.numel for r in self.records.values())
