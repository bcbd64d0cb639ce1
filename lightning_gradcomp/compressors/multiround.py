"""A small extension of the compressor contract for compressors that need several rounds of communication.

PowerSGD (Vogels et al., NeurIPS 2019) must all-reduce the left factors P before it can compute the right
factors Q, which it then all-reduces too. A one-shot :class:`~lightning_gradcomp.flat.Packet`
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

The hook calls :meth:`MultiRoundCompressor.exchange_flat`: the same exchange on a group of layers laid out back to
back in one flat tensor (:class:`~lightning_gradcomp.flat.Segments`), with flat results, so the hook's own work
(error feedback, writing the bucket, the ledger) is one op per group whatever the number of layers. Its default
runs :meth:`~MultiRoundCompressor.exchange` on the layers' views (ops per layer); a compressor that overrides it
(PowerSGD) gathers and scatters its shape classes in a fixed number of ops each.
"""

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.flat import Segments

AllReduce = Callable[[Tensor], Tensor]
"""Sums a tensor over ranks in place, waits for it, and returns it."""


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


@dataclass
class FlatExchanged:
    """The outcome of a multi-round exchange for a group of layers laid out as ``segments`` in one flat tensor.

    Attributes:
        mean: ``[segments.total]``: the average over ranks (written into DDP's bucket).
        sent: ``[segments.total]``: what this rank counts as sent; error feedback keeps ``input - sent``.
        layer_nbytes: exact bytes this rank contributed to the collectives for each layer (shapes determine them).
        stats: per-layer statistics as ``[layers]`` tensors (the keys every layer's :class:`Exchanged` had).
    """

    mean: Tensor
    sent: Tensor
    layer_nbytes: tuple[int, ...]
    stats: dict[str, Tensor] = field(default_factory=dict)


class MultiRoundCompressor(Compressor):
    """Base class of compressors that exchange in several dependent all-reduce rounds (PowerSGD).

    The hook routes a group to :meth:`exchange_flat` instead of ``compress_flat`` / collective / ``decompress_flat``:
    the exchange is this compressor's group step (its rounds depend on each other, so there is no packet to send).
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

    def exchange_flat(self, flat: Tensor, segments: Segments, all_reduce: AllReduce) -> FlatExchanged:
        """:meth:`exchange` for the layers of a group laid out as ``segments`` in ``flat`` (not modified).

        The collectives must be those :meth:`exchange` issues for the same layers (number, order, sizes), so a
        rank on either entry point pairs with the other. The default runs :meth:`exchange` on the layers' views and
        concatenates the results (ops per layer); overrides do the same in a number of ops that does not grow with
        the number of layers.
        """
        results = self.exchange(segments.views(flat), segments.names, all_reduce)
        if not results:
            return FlatExchanged(flat.new_empty(0), flat.new_empty(0), ())
        mean = torch.cat([r.mean.reshape(-1) for r in results])
        sent = torch.cat([r.sent.reshape(-1) for r in results])
        keys = [k for k in results[0].stats if all(k in r.stats for r in results)]
        stats = {k: torch.stack([r.stats[k] for r in results]) for k in keys}
        return FlatExchanged(mean, sent, tuple(r.nbytes for r in results), stats)
