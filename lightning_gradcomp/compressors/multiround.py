"""A small extension of the compressor contract for compressors that need several rounds of communication.

PowerSGD (Vogels et al., NeurIPS 2019) must all-reduce the left factors P before it can compute the right
factors Q, which it then all-reduces too. A one-shot :class:`~lightning_gradcomp.compressors.base.Packet`
cannot express that. torch's own PowerSGD hook issues the second all-reduce from a ``Future.then`` callback;
on Gloo with two or more buckets the callbacks of different buckets interleave differently on each rank and
the collectives mismatch (hang or abort).

Here the hook hands the compressor an ``all_reduce`` callable instead. The compressor calls it for each
round, in a fixed order; every call is a blocking sum over ranks issued from the hook body, so the sequence
of collectives is identical on every rank by construction. The compressor stays free of process groups: in a
single process ``all_reduce`` can be ``lambda t: t``.

Contract for :meth:`MultiRoundCompressor.exchange`:

* it receives the tensors of one bucket (after transforms and error feedback) and their names;
* it may call ``all_reduce(t)`` any number of times, but the number, order and sizes of calls must depend only
  on what is identical on every rank (shapes, names, hyper-parameters, the step), never on values;
* ``all_reduce`` sums ``t`` over ranks *in place*, blocks until done, and returns ``t``;
* it returns, per tensor, the mean over ranks to write into the bucket, what this rank counts as sent (for
  error feedback: ``residual = input - sent``), and the exact bytes this rank put on the wire for it.
"""

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation, Compressor

#: sums a tensor over ranks in place, waits for it, and returns it
AllReduce = Callable[[Tensor], Tensor]


@dataclass
class Exchanged:
    """The outcome of a multi-round exchange for one tensor.

    Attributes:
        mean: the average over ranks, shaped like the input (written into DDP's bucket).
        sent: what this rank counts as sent; error feedback keeps ``input - sent``.
        nbytes: exact bytes this rank contributed to the collectives for this tensor.
        stats: per-tensor statistics as 0-d tensors.
    """

    mean: Tensor
    sent: Tensor
    nbytes: int
    stats: dict[str, Tensor] = field(default_factory=dict)


class MultiRoundCompressor(Compressor):
    """Base class of compressors that exchange in several dependent all-reduce rounds (PowerSGD).

    The hook routes a bucket to :meth:`exchange` instead of ``compress`` / collective / ``decompress``.
    ``compress`` and ``decompress`` remain the single-process form (a world of one), for tests and tools.
    """

    aggregation = Aggregation.SUM

    @abstractmethod
    def exchange(self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce) -> list[Exchanged]:
        """Compress, exchange (calling ``all_reduce`` per round) and decode the tensors of one bucket.

        Args:
            tensors: this rank's inputs (gradient after transforms and error feedback); not modified.
            names: the parameters' names, for per-layer state (warm-start factors).
            all_reduce: blocking in-place sum over the group's ``self.world_size`` ranks.
        """
