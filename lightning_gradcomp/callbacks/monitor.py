"""``CompressionMonitor``: per-layer compression statistics to every attached Lightning logger.

On logging steps, rank 0 sends one dict per step to each logger (``for logger in trainer.loggers``):

* per layer, ``gradcomp/<statistic>/<parameter name>`` (dots as dashes): every statistic the compressor reports in its packets
  (TernGrad: ``sparsity``, ``scaler``), ``density`` (1 - sparsity), ``sparsity`` computed from what was sent
  when the compressor does not report it, ``clipped_fraction`` (with :class:`SigmaClipping`),
  ``residual_norm`` / ``residual_max`` / ``residual_p95`` (error-feedback compressors), ``bytes``,
  ``bits_per_element`` and ``compression_ratio`` (fp32 bits / bits sent);
* totals: ``gradcomp/bytes/total`` (the strategy's ``bytes_per_step()``: per rank and step, averaged over the run so
  far, warm-up included), ``gradcomp/last_step_bytes/total`` (the latest step's), ``gradcomp/bits_per_element/total``,
  ``gradcomp/compression_ratio/total`` (fp32 DDP's bytes over ``bytes_per_step()``, as ``comp_ratio``);
* the time split per step, ``gradcomp/time_ms/{compress,collective_wait,decompress}`` (see
  :mod:`lightning_gradcomp.exchange.stats`);
* with a ``WandbLogger``, in the same dict: ``gradcomp/histogram/<parameter name>/<kind>`` for ``kind`` in
  original, clipped, compressed, averaged (TernGrad Fig. 2); a ``TensorBoardLogger`` gets the same
  histograms under the same tags (``add_histogram_raw``), so ``gradcomp report`` can draw them.

Scalar statistics stay device tensors inside the hook; the monitor reads them with one transfer on logging
steps only.
"""

import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.callbacks.clipping import SigmaClip
from lightning_gradcomp.callbacks.progress import PROGRESS_BAR_KEY, show_compression_ratio  # noqa: F401  (re-export)
from lightning_gradcomp.extras import require
from lightning_gradcomp.exchange.hook import GradCompState
from lightning_gradcomp.exchange.host import HookHost
from lightning_gradcomp.exchange.ledger import ByteReport, dense_bytes
from lightning_gradcomp.exchange.stats import HookStats
from lightning_gradcomp.validation import check_int

PREFIX = "gradcomp"
#: W&B summary per statistic (``define_metric(summary=...)``); other statistics keep the last value
SUMMARIES = {
    "sparsity": "mean,last",
    "density": "mean,last",
    "scaler": "max,last",
    "energy_kept": "mean,last",
    "clipped_fraction": "mean,last",
    "residual_norm": "max,last",
    "residual_max": "max,last",
    "residual_p95": "max,last",
    "compression_ratio": "mean,last",
    "bits_per_element": "mean,last",
    "bytes": "mean,last",
    "last_step_bytes": "mean,last",
    "wan_bytes": "mean,last",
    "lan_bytes": "mean,last",
    "time_ms": "mean,last",
    "histogram": "none",
}
# residual percentiles are exact up to this many elements and estimated from a strided sample above
_EXACT_QUANTILE_NUMEL = 1 << 20


def strategy_statistics(strategy: Any) -> dict[str, float]:
    """A strategy's own statistics of the latest step (``strategy.stats``, tensors: WeightGrad's WAN rounds,
    DiLoCo's outer rounds) as ``gradcomp/<strategy_name>/<statistic>``, read to the host in one transfer."""
    stats = getattr(strategy, "stats", None)
    if not isinstance(stats, dict) or not stats:
        return {}
    prefix = getattr(strategy, "strategy_name", "strategy")
    keys = [f"{PREFIX}/{prefix}/{k.replace('.', '-')}" for k in stats]
    tensors = [torch.as_tensor(v).detach().float().mean() for v in stats.values()]
    values = torch.stack([t.to(tensors[0].device) for t in tensors]).tolist()  # one transfer, as _collect
    return dict(zip(keys, values))


def layer_key(statistic: str, name: str) -> str:
    """The metric key of one statistic of one parameter: ``gradcomp/sparsity/net-0-weight``.

    Dots become dashes: W&B reads a dot in a key as nesting, and ``define_metric`` globs then miss the key.
    """
    return f"{PREFIX}/{statistic}/{name.replace('.', '-')}"


def residual_statistics(residual: Tensor, quantile: float = 0.95) -> tuple[Tensor, Tensor, Tensor]:
    """L2 norm, max and ``quantile`` of ``|residual|`` as 0-d device tensors (no host sync).

    The quantile is exact up to 2**20 elements and taken from an evenly strided sample above.
    """
    magnitude = residual.detach().reshape(-1).float().abs()
    sample = magnitude
    if magnitude.numel() > _EXACT_QUANTILE_NUMEL:
        sample = magnitude[:: -(-magnitude.numel() // _EXACT_QUANTILE_NUMEL)]
    k = max(1, math.ceil(quantile * sample.numel()))
    return torch.linalg.vector_norm(magnitude), magnitude.max(), sample.kthvalue(k).values


class CompressionMonitor(Callback):
    """Log what compression does to each layer, on logging steps, to every attached logger.

    Needs a :class:`~lightning_gradcomp.GradCompStrategy` and at least one logger. Runs on rank 0 only; the
    other ranks' hooks are not instrumented. With a ``WandbLogger`` (or TensorBoard) it also logs histograms; with W&B it defines the step
    axis and summaries of every statistic, and the run config records the compressor's settings (every
    logger receives them through ``log_hyperparams``).

    Args:
        logging_interval: log every this many optimizer steps; ``None`` follows ``Trainer(log_every_n_steps)``.
        histogram_layers: fnmatch patterns of the parameters whose histograms W&B and TensorBoard receive
            (``[]``: none).
        histogram_bins: bins per histogram.
        histogram_every: take histograms on every this many logging steps (the first one included): four
            histograms of every layer cost a few passes over all gradients, about 3.5% of a small model's step
            at the default interval when taken on every logging step (``docs/monitoring.md``).
        progress_bar: show the current compression ratio (``comp_ratio``) in the progress bar.

    Example::

        trainer = Trainer(strategy="terngrad", logger=WandbLogger(), callbacks=[CompressionMonitor()])
    """

    def __init__(
        self,
        logging_interval: Optional[int] = None,
        histogram_layers: Sequence[str] = ("*",),
        histogram_bins: int = 64,
        histogram_every: int = 4,
        progress_bar: bool = True,
    ) -> None:
        if logging_interval is not None:
            check_int("logging_interval", logging_interval, minimum=1, fix="use None to follow `log_every_n_steps`")
        check_int("histogram_bins", histogram_bins, minimum=1, fix="use 64")
        check_int("histogram_every", histogram_every, minimum=1, fix="use 1 for histograms on every logging step")
        self.histogram_every = histogram_every
        self._logging_steps = 0
        if isinstance(histogram_layers, str):
            raise ValueError(
                f"Expected `histogram_layers` to be a list of patterns, but got the string {histogram_layers!r}. "
                f"Fix: use [{histogram_layers!r}]."
            )
        self.logging_interval = logging_interval
        self.histogram_layers = list(histogram_layers)
        self.histogram_bins = histogram_bins
        self.progress_bar = progress_bar
        self.stats: Optional[HookStats] = None
        self._state: Optional[GradCompState] = None
        self._armed_at: Optional[int] = None  # hook calls when capturing was armed
        self._seen_calls = 0
        self._steps = 0  # steps whose hook ran since the last log
        self._wandb_defined: dict[int, set[str]] = {}
        self._shown_ratio: Optional[float] = None

    # -- setup ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, HookHost):
            raise ValueError(
                f"Expected the Trainer's strategy to be a GradCompStrategy for CompressionMonitor, but got "
                f"{type(trainer.strategy).__name__}. Fix: use e.g. `strategy='terngrad'`, or `strategy='fp32'` to "
                f"monitor uncompressed training through the same hook."
            )
        if not trainer.loggers:
            raise ValueError(
                "Cannot use the CompressionMonitor callback with a Trainer that has no logger. Fix: pass "
                "`logger=WandbLogger(...)` (or CSVLogger, TensorBoardLogger) to the Trainer, or remove the callback."
            )
        if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
            require("wandb", "wandb", "CompressionMonitor's W&B logging")  # before the first step, not at the first log
        if self.logging_interval is None and trainer.log_every_n_steps == 0:  # type: ignore[attr-defined]  # set by Lightning's logger connector
            raise ValueError(
                "Expected `log_every_n_steps` >= 1 for CompressionMonitor, but the Trainer has `log_every_n_steps=0` "
                "(logging disabled). Fix: set `log_every_n_steps` or `CompressionMonitor(logging_interval=...)`."
            )

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        state = getattr(trainer.strategy, "comm_state", None)
        if state is None:
            raise RuntimeError("CompressionMonitor found no communication hook state: the model was not wrapped in DDP.")
        self._state = state
        self._seen_calls = state.ledger.hook_calls
        self._steps = 0
        self._logging_steps = 0
        self._shown_ratio = None
        if not trainer.is_global_zero:
            return
        # histograms only go to W&B and TensorBoard: the other loggers take scalars only
        histograms_wanted = any(isinstance(logger, (WandbLogger, TensorBoardLogger)) for logger in trainer.loggers)
        layers = self.histogram_layers if histograms_wanted else ()
        self.stats = HookStats(layers, self.histogram_bins, trainer.strategy.root_device)
        state.observe(self.stats)
        config = self._config(trainer)
        for logger in trainer.loggers:
            logger.log_hyperparams({PREFIX: config})

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._state is not None and self._state.stats is self.stats:
            self._state.observe(None)
        self.stats = None
        self._state = None
        self._armed_at = None

    @staticmethod
    def _config(trainer: "pl.Trainer") -> dict[str, Any]:
        strategy = trainer.strategy
        assert isinstance(strategy, HookHost)  # checked in setup
        state = strategy.comm_state
        assert state is not None
        return {
            **strategy.compressor.describe(),
            "world_size": trainer.world_size,
            "exclude": list(strategy.exclude),
            "min_numel": strategy.min_numel,
            "float_layers": sorted(state.float_names),
            "transforms": [type(t).__name__ for t in state.transforms],
        }

    def _define_wandb_metrics(self, logger: WandbLogger, keys: Iterator[str]) -> None:
        """Step axis and summary of each key W&B has not seen from us yet.

        By full name, not by glob: wandb-core picks among several matching globs (Lightning's own ``*`` and
        ``gradcomp/sparsity/*``) in no fixed order, so a glob's summary would apply to some keys only.
        """
        experiment = logger.experiment
        if not callable(getattr(experiment, "define_metric", None)):  # a disabled run
            return
        defined = self._wandb_defined.setdefault(id(logger), set())
        for key in keys:
            if key in defined:
                continue
            statistic = key.split("/")[1]
            summary = SUMMARIES.get(statistic, "last")
            experiment.define_metric(key, step_metric="trainer/global_step", summary=summary)
            defined.add(key)

    # -- per step -------------------------------------------------------------------------------------------
    def _is_logging_step(self, trainer: "pl.Trainer") -> bool:
        if self.logging_interval is None:
            return trainer._logger_connector.should_update_logs
        return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % self.logging_interval == 0

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.stats is None or self._armed_at is not None or self._state is None:
            return
        if self._is_logging_step(trainer):
            self.stats.capture = True
            self.stats.capture_histograms = self._logging_steps % self.histogram_every == 0
            self._logging_steps += 1
            self._armed_at = self._state.ledger.hook_calls

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state = self._state
        if self.stats is None or state is None or state.ledger.hook_calls == self._seen_calls:
            return  # not rank 0, or an accumulation micro-batch: the hook did not run
        self._seen_calls = state.ledger.hook_calls
        self._steps += 1
        # checked in setup; a cast, not an isinstance: a protocol check reads every member, on every step
        strategy = cast(HookHost, trainer.strategy)
        logging_step = self._armed_at is not None and state.ledger.hook_calls != self._armed_at
        if self.progress_bar:
            self._shown_ratio = show_compression_ratio(strategy, pl_module, self._shown_ratio,
                                                       force=logging_step or batch_idx == 0)
        if not logging_step:
            return
        metrics = self._collect(state, self.stats, strategy)
        metrics.update(strategy_statistics(trainer.strategy))
        histograms = self._read_histograms(self.stats)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step Lightning logs this batch's metrics at
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                wandb_extra = self._wandb_histograms(histograms)
                self._define_wandb_metrics(logger, iter([*metrics, *wandb_extra]))
                logger.log_metrics({**metrics, **wandb_extra}, step=step)
            else:
                logger.log_metrics(metrics, step=step)
                if isinstance(logger, TensorBoardLogger):
                    self._tensorboard_histograms(logger, histograms, step)
        self.stats.clear_capture()
        self._armed_at = None

    # -- reading the statistics -----------------------------------------------------------------------------
    def _collect(self, state: GradCompState, stats: HookStats, strategy: ByteReport) -> dict[str, float]:
        metrics: dict[str, float] = {}
        keys: list[str] = []
        tensors: list[Tensor] = []
        clip = next((t for t in state.transforms if isinstance(t, SigmaClip)), None)
        total_numel = 0
        for name in sorted(state.ledger.records):
            record = state.ledger.records[name]
            layer = {**record.stats, **stats.layer_stats.get(name, {})}
            if "sparsity" in layer and "density" not in layer:
                layer["density"] = 1.0 - layer["sparsity"]
            if clip is not None and name in clip.clipped_fraction:
                layer["clipped_fraction"] = clip.clipped_fraction[name]
            residual = state.memory.residuals.get(name)
            if residual is not None:
                norm, peak, p95 = residual_statistics(residual)
                layer.update(residual_norm=norm, residual_max=peak, residual_p95=p95)
            for statistic, value in layer.items():
                if not isinstance(value, Tensor):
                    metrics[layer_key(statistic, name)] = float(value)
                    continue
                value = value.detach().float()
                keys.append(layer_key(statistic, name))
                tensors.append(value.reshape(()) if value.numel() == 1 else value.mean())  # per-chunk stats: mean
            metrics[layer_key("bytes", name)] = float(record.nbytes)
            metrics[layer_key("bits_per_element", name)] = 8.0 * record.nbytes / record.numel
            if record.nbytes:  # an empty payload (nothing sent) has no finite ratio
                metrics[layer_key("compression_ratio", name)] = dense_bytes(record.numel) / record.nbytes
            total_numel += record.numel
        if tensors:
            # one device-to-host transfer for every tensor statistic
            metrics.update(zip(keys, torch.stack([t.to(tensors[0].device) for t in tensors]).tolist()))
        # the strategy's own answer (ByteReport): the hook's ledger, or DiLoCo's and WeightGrad's bytes between sites
        sent = strategy.bytes_per_step()
        metrics[layer_key("bytes", "total")] = float(sent)
        metrics[layer_key("last_step_bytes", "total")] = float(strategy.last_step_bytes())
        # what this rank put on the link between sites: all of it when flat, its share's when hierarchical, the
        # outer rounds' under DiLoCo (its hook runs inside a site)
        metrics[layer_key("wan_bytes", "total")] = float(sent)
        if state.peers.hierarchy is not None:  # and the dense bytes inside the site
            metrics[layer_key("lan_bytes", "total")] = float(state.ledger.lan_bytes_per_step())
        if total_numel:
            metrics[layer_key("bits_per_element", "total")] = 8.0 * sent / total_numel
        if sent:
            metrics[layer_key("compression_ratio", "total")] = strategy.dense_bytes_per_step() / sent
        steps = max(self._steps, 1)
        for phase, seconds in stats.take_times().items():
            metrics[layer_key("time_ms", phase)] = 1e3 * seconds / steps
        self._steps = 0
        return metrics

    @staticmethod
    def _read_histograms(stats: HookStats) -> dict[str, tuple[Any, Any]]:
        """Key -> (counts as int64, edges as float64) numpy arrays."""
        out: dict[str, tuple[Any, Any]] = {}
        for name in sorted(stats.histograms):
            for kind, (counts, edges) in stats.histograms[name].items():
                out[layer_key("histogram", name) + f"/{kind}"] = (
                    counts.cpu().round().long().numpy(),
                    edges.cpu().double().numpy(),
                )
        return out

    @staticmethod
    def _wandb_histograms(histograms: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
        if not histograms:
            return {}
        wandb = require("wandb", "wandb", "CompressionMonitor's W&B histograms")
        return {key: wandb.Histogram(np_histogram=value) for key, value in histograms.items()}

    @staticmethod
    def _tensorboard_histograms(logger: TensorBoardLogger, histograms: dict[str, tuple[Any, Any]], step: int) -> None:
        writer = logger.experiment
        for key, (counts, edges) in histograms.items():
            centres = (edges[:-1] + edges[1:]) / 2
            writer.add_histogram_raw(
                key,
                min=float(edges[0]),
                max=float(edges[-1]),
                num=int(counts.sum()),
                # TensorBoard wants these for its mean/std; the exact values are not kept, bin centres stand in
                sum=float((counts * centres).sum()),
                sum_squares=float((counts * centres**2).sum()),
                bucket_limits=edges[1:].tolist(),
                bucket_counts=counts.tolist(),
                global_step=step,
            )
