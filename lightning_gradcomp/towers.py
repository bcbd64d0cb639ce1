"""N emulated workers in one process, for worker counts beyond the machine's cores.

TernGrad's experiments use up to 64 workers with a total batch of 64; the original code emulates them by
splitting each batch into N "towers" in one process. :class:`TowerStrategy` does the same with the real
compressors: each tower is a worker r of N with its own compressor state (random stream seeded from r, its
own residuals), the shared statistic is the max over towers, and each group of layers (the fp32 ones, the
compressed ones) goes through the compressor's flat methods exactly as the hook's groups do (payload sums in rank
order for summable encodings, ``decompress_flat_mean_into`` in rank order for gathered ones).

Relation to a real multi-process run with N ranks and per-rank batch M/N: tower r takes the samples
``batch[r::N]``, which are the samples a ``DistributedSampler`` (no shuffling) gives rank r, so the same
data, seeds and decoding produce the same update; only fp32 sums of summable payloads may differ in the last
bits (a ring all-reduce adds in another order). ``tests/integration/test_towers.py`` checks agreement at N=2.
"""

import copy
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.ledger import GroupRecord, LayerRecord, Ledger
from lightning_gradcomp.memory import ResidualMemory
from lightning_gradcomp.segments import Segments
from lightning_gradcomp.wiring import select_float_names
from lightning_gradcomp.validation import check_int


def _tower_slice(batch: Any, tower: int, towers: int) -> Any:
    if isinstance(batch, Tensor):
        if batch.shape[0] < towers:
            raise ValueError(
                f"Expected a batch of at least `num_workers={towers}` samples, but got {batch.shape[0]}. "
                f"Fix: raise the batch size to a multiple of the number of emulated workers."
            )
        return batch[tower::towers]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_tower_slice(b, tower, towers) for b in batch)
    if isinstance(batch, dict):
        return {k: _tower_slice(v, tower, towers) for k, v in batch.items()}
    return batch


def _emulable(compressor: Any) -> Compressor:
    """The compressor if the towers can run it as the hook does; a ``ValueError`` otherwise.

    The towers combine one packet per worker (a payload sum or ``decompress_sum``); a multi-round compressor
    (PowerSGD) exchanges through dependent all-reduce rounds in ``exchange``, which the towers do not run, so its
    single-process ``compress`` would train something other than the multi-process run.
    """
    if not isinstance(compressor, Compressor):
        raise ValueError(
            f"Expected `compressor` to be a Compressor or a registered name, but got {compressor!r}. "
            f"Fix: use one of {registry.compressor_names()}."
        )
    if isinstance(compressor, MultiRoundCompressor):
        raise ValueError(
            f"Expected `compressor` to be a one-round compressor (one packet per worker), but got "
            f"{type(compressor).__name__}, which exchanges in several all-reduce rounds that TowerStrategy does not "
            f"emulate. Fix: train it with real ranks (GradCompStrategy, e.g. `--trainer.devices 4` on CPU), or emulate "
            f"a one-round compressor."
        )
    return compressor


class TowerStrategy(SingleDeviceStrategy):
    """Emulate ``num_workers`` data-parallel workers with gradient compression in a single process.

    Args:
        num_workers: N, the number of emulated workers; each batch is split into N towers.
        compressor: a compressor instance (copied per worker) or a registered name; not a multi-round one such as
            PowerSGD (a ``ValueError``: its rounds are not emulated).
        exclude: parameter-name globs sent uncompressed (as in :class:`~lightning_gradcomp.GradCompStrategy`).
        min_numel: parameters with fewer elements are sent uncompressed.
        device: the device to train on.
        accelerator: see :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
        checkpoint_io: see ``SingleDeviceStrategy``.
        precision_plugin: see ``SingleDeviceStrategy``.
    """

    strategy_name = "towers"

    def __init__(
        self,
        num_workers: int,
        compressor: Union[Compressor, str] = "terngrad",
        exclude: Optional[list[str]] = None,
        min_numel: int = 1,
        device: Union[str, torch.device] = "cpu",
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        super().__init__(
            device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        check_int("num_workers", num_workers, minimum=1)
        check_int("min_numel", min_numel, minimum=1, fix="use 1 to compress every parameter")
        self.num_workers = num_workers
        self.compressor = _emulable(registry.make_compressor(compressor) if isinstance(compressor, str) else compressor)
        self.exclude = list(exclude or [])
        self.min_numel = min_numel
        self._workers: list[Compressor] = []
        self._memories: list[ResidualMemory] = []
        self._float_names: frozenset[str] = frozenset()
        self._identity = Identity()
        #: what the emulated hook did (bytes are those of ONE worker, as in the hook)
        self.ledger = Ledger()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None  # Lightning connects the module before setup
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self._float_names = select_float_names(named, self.exclude, self.min_numel)
        self._workers = []
        for rank in range(self.num_workers):
            worker = copy.deepcopy(self.compressor)
            worker.setup(rank, self.num_workers, self.root_device)
            self._workers.append(worker)
        self._memories = [ResidualMemory() for _ in range(self.num_workers)]

    def _exchange(self, index: int, segments: Segments, flats: list[Tensor], dense: bool) -> Tensor:
        """What every worker's hook would write for the group ``segments`` (each worker's gradients flat in
        ``flats``): the decoded average, flat. The hook's group step, with the ranks' collectives done in place:
        statistics max-reduced over the workers, payloads summed or decoded in rank order."""
        n = self.num_workers
        workers = [self._identity] * n if dense else self._workers
        xs = flats
        if workers[0].uses_memory:
            for w, x in zip(workers, flats):
                w.observe_gradient_flat(x, segments)
            xs = [self._memories[r].compensate_flat(x, segments) for r, x in enumerate(flats)]
        # a compressor has a shared statistic on every worker or on none
        local = [w.flat_statistic(x, segments) for w, x in zip(workers, xs)]
        shared = None
        if local[0] is not None:
            shared = local[0].with_values(torch.stack([s.values for s in local if s is not None]).amax(dim=0))
        self.ledger.record_shared(index, 0 if shared is None else 4 * shared.values.numel())
        packets = [w.compress_flat(x, segments, shared) for w, x in zip(workers, xs)]
        if workers[0].uses_memory:
            for r, (w, x, p) in enumerate(zip(workers, xs, packets)):
                self._memories[r].update_flat(segments, x, w.sent_flat(x, p))
        aggregation = workers[0].aggregation_for(n)
        self.ledger.record_group(GroupRecord.of(packets[0], aggregation))
        if aggregation is Aggregation.SUM:
            total = packets[0].payload.clone()
            for p in packets[1:]:
                total += p.payload
            decoded = workers[0].decompress_flat(packets[0].with_payload(total))
            return decoded.div_(n) if decoded.is_floating_point() else decoded.float() / n
        return workers[0].decompress_flat_mean_into(packets, torch.empty_like(flats[0]))

    @property
    def records(self) -> dict[str, LayerRecord]:
        """The latest record per parameter name (bytes are those of ONE worker, as in the hook)."""
        return self.ledger.records

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module = self.lightning_module
        assert module is not None  # Lightning connects the module before training
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        batch, rest = args[0], args[1:]
        losses: list[Tensor] = []
        per_tower: list[list[Tensor]] = []
        output: STEP_OUTPUT = None
        with self.precision_plugin.train_step_context():
            for tower in range(self.num_workers):
                output = module.training_step(_tower_slice(batch, tower, self.num_workers), *rest, **kwargs)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if not isinstance(loss, Tensor):
                    raise ValueError(
                        f"Expected `training_step` to return a loss tensor (or a dict with a 'loss' tensor) under "
                        f"TowerStrategy, but got {output!r}. Fix: return the loss; every tower must take its step, "
                        f"so a batch cannot be skipped by returning None here."
                    )
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                per_tower.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
                losses.append(loss.detach())
            averaged: list[Tensor] = [torch.empty(0)] * len(named)
            # two groups, as the hook's routing makes them: the layers sent in fp32, and the compressed ones
            for index, dense in enumerate((True, False)):
                members = [j for j, (name, _) in enumerate(named) if (name in self._float_names) == dense]
                if not members:
                    continue
                segments = Segments([named[j][0] for j in members], [params[j].shape for j in members])
                flats = [torch.cat([g[j].reshape(-1) for j in members]) for g in per_tower]
                for j, view in zip(members, segments.views(self._exchange(index, segments, flats, dense))):
                    averaged[j] = view
            # a surrogate whose gradient is exactly the exchanged average and whose value is the mean tower
            # loss, so Lightning's own backward, clipping and optimizer step run unchanged
            zero = torch.zeros((), device=self.root_device)
            surrogate = sum(((p * g.to(p.dtype)).sum() for p, g in zip(params, averaged)), zero)
            loss_out = surrogate - surrogate.detach() + torch.stack(losses).mean()
        if isinstance(output, Mapping):
            return {**output, "loss": loss_out}
        return loss_out

    def bytes_per_step(self) -> int:
        """Bytes one emulated worker contributes per step: payloads plus shared statistics, as in the hook."""
        return self.ledger.bytes_per_step()
