"""N emulated workers in one process, for worker counts beyond the machine's cores.

TernGrad's experiments use up to 64 workers with a total batch of 64; the original code emulates them by
splitting each batch into N "towers" in one process. :class:`TowerStrategy` does the same with the real
compressors: each tower is a worker r of N with its own compressor state (random stream seeded from r, its
own residuals, its own :class:`~lightning_gradcomp.exchange.hook.GradCompState`), and each tower's gradients, laid out flat
as one DDP bucket, go through the hook's exchange itself (:func:`~lightning_gradcomp.exchange.hook.gradcomp_hook`), each
tower in its own thread; only the carrier of the collectives differs (:class:`~lightning_gradcomp.exchange.transport.Workers`:
the towers meet at each collective, the shared statistic is the max over towers, summable payloads are summed in
rank order, gathered ones decoded in rank order).

Relation to a real multi-process run with N ranks and per-rank batch M/N: tower r takes the samples
``batch[r::N]``, which are the samples a ``DistributedSampler`` (no shuffling) gives rank r, so the same
data, seeds and decoding produce the same update; only fp32 sums of summable payloads may differ in the last
bits (a ring all-reduce adds in another order). ``tests/integration/test_towers.py`` checks agreement at N=2.
"""

import copy
import inspect
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.groups import TensorBucket
from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.exchange.ledger import LayerRecord, Ledger
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.exchange.transport import Workers
from lightning_gradcomp.strategies.wiring import select_float_names
from lightning_gradcomp.validation import UnknownOptionError, check_int, check_options


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
    """The compressor, or a ``ValueError`` naming what was passed instead."""
    if not isinstance(compressor, Compressor):
        raise ValueError(
            f"Expected `compressor` to be a Compressor or a registered name, but got {compressor!r}. "
            f"Fix: use one of {registry.compressor_names()}."
        )
    return compressor


# options of the multi-process strategies that have no meaning for workers emulated in one process
_SITE_OPTIONS = ("site_size", "site_sizes", "hierarchy")


def check_tower_options(kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments :class:`TowerStrategy` does not take, naming them (instead of Python's ``TypeError``).

    Raises:
        ValueError: a site option (the towers are one flat group of workers) or any other unknown keyword
            (:class:`~lightning_gradcomp.validation.UnknownOptionError`).
    """
    for name in _SITE_OPTIONS:
        if name in kwargs:
            raise UnknownOptionError(
                f"Expected no `{name}` for TowerStrategy (its workers are one flat group in one process), but got "
                f"{name}={kwargs[name]!r}. Fix: emulate the workers with `num_workers`, or train sites on real ranks "
                f"with `GradCompStrategy({name}=...)`, `DiLoCoStrategy` or `WeightGradStrategy` (e.g. `devices=4`)."
            )
    check_options("TowerStrategy", kwargs, list(inspect.signature(TowerStrategy.__init__).parameters)[1:-1], kwargs)


class TowerStrategy(SingleDeviceStrategy):
    """Emulate ``num_workers`` data-parallel workers with gradient compression in a single process.

    Args:
        num_workers: N, the number of emulated workers; each batch is split into N towers.
        compressor: a compressor instance (copied per worker) or a registered name (multi-round ones such as
            PowerSGD too: each round is a sum among the workers).
        exclude: parameter-name globs sent uncompressed (as in :class:`~lightning_gradcomp.GradCompStrategy`).
        min_numel: parameters with fewer elements are sent uncompressed.
        device: the device to train on.
        accelerator: see :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
        checkpoint_io: see ``SingleDeviceStrategy``.
        precision_plugin: see ``SingleDeviceStrategy``.
        **kwargs: refused with the option named (a site option, or a typo), as a ``ValueError``.
    """

    strategy_name = "towers"

    def __init__(
        self,
        num_workers: Optional[int] = None,
        compressor: Union[Compressor, str] = "terngrad",
        exclude: Optional[list[str]] = None,
        min_numel: int = 1,
        device: Union[str, torch.device] = "cpu",
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **kwargs: Any,
    ) -> None:
        check_tower_options(kwargs)
        if num_workers is None:
            raise ValueError(
                "Expected `num_workers` (how many workers to emulate), but got None. Fix: pass e.g. "
                "`TowerStrategy(num_workers=8)`."
            )
        super().__init__(
            device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        check_int("num_workers", num_workers, minimum=1)
        check_int("min_numel", min_numel, minimum=1, fix="use 1 to compress every parameter")
        self.num_workers = num_workers
        self.compressor = _emulable(registry.resolve_compressor(compressor))
        self.exclude = list(exclude or [])
        self.min_numel = min_numel
        #: one hook state per emulated worker (its compressor, residuals and records)
        self._states: list[GradCompState] = []
        self._float_names: frozenset[str] = frozenset()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None  # Lightning connects the module before setup
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self._float_names = select_float_names(named, self.exclude, self.min_numel)
        names = {id(p): n for n, p in named.items()}
        self._workers = Workers(self.num_workers)
        self._states = []
        for rank in range(self.num_workers):
            worker = copy.deepcopy(self.compressor)
            worker.setup(rank, self.num_workers, self.root_device)
            # "ignore": a tower's step cannot be skipped alone (Lightning steps once for all of them)
            self._states.append(GradCompState(worker, names, self._float_names, world_size=self.num_workers,
                                              nonfinite="ignore", transport=self._workers.transport(rank)))

    @property
    def ledger(self) -> Ledger:
        """What the emulated hook did: worker 0's records (bytes are those of ONE worker, as in the hook)."""
        return self._states[0].ledger if self._states else Ledger()

    def _exchange(self, buffers: list[Tensor], params: Sequence[Tensor]) -> Tensor:
        """What every worker's hook would write for one bucket of ``params`` (each worker's gradients flat in
        ``buffers``, overwritten with the mean): the hook's exchange, run by each worker in its own thread over
        the in-process :class:`~lightning_gradcomp.exchange.transport.Workers`; returns worker 0's buffer (all are equal)."""
        errors: list[BaseException] = []

        def work(rank: int) -> None:
            try:
                gradcomp_hook(self._states[rank], TensorBucket(buffers[rank], params)).wait()
            except BaseException as error:  # noqa: B036 - re-raised below; the other workers must not wait for it
                errors.append(error)
                self._workers.abort()

        threads = [threading.Thread(target=work, args=(rank,), name=f"tower-{rank}") for rank in range(1, self.num_workers)]
        for thread in threads:
            thread.start()
        work(0)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return buffers[0]

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
            # each tower's gradients laid out as one DDP bucket: the hook's groups (fp32 layers, compressed ones)
            layout = Segments([name for name, _ in named], [p.shape for p in params])
            buffers = [torch.cat([g.reshape(-1) for g in grads]) for grads in per_tower]
            averaged = layout.views(self._exchange(buffers, params))
            # a surrogate whose gradient is exactly the exchanged average and whose value is the mean tower
            # loss, so Lightning's own backward, clipping and optimizer step run unchanged
            zero = torch.zeros((), device=self.root_device)
            surrogate = sum(((p * g.to(p.dtype)).sum() for p, g in zip(params, averaged)), zero)
            loss_out = surrogate - surrogate.detach() + torch.stack(losses).mean()
        if isinstance(output, Mapping):
            return {**output, "loss": loss_out}
        return loss_out

    def bytes_per_step(self) -> int:
        """Bytes one emulated worker contributes per step, averaged over the run so far: payloads plus shared
        statistics, as in the hook (:class:`~lightning_gradcomp.exchange.ledger.ByteReport`)."""
        return self.ledger.bytes_per_step()

    def last_step_bytes(self) -> int:
        """Bytes one emulated worker contributed in the latest step."""
        return self.ledger.last_step_bytes()

    def dense_bytes_per_step(self) -> float:
        """What one fp32 DDP worker would send per step for the same parameters."""
        return self.ledger.dense_bytes_per_step()
