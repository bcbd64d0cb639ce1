"""Rank bodies for the CompressionMonitor tests: Trainers with W&B (offline) and CSV loggers."""

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from torch import Tensor

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.compressors.per_tensor import LayerLoop
from lightning_gradcomp.flat import Packet
from tests.distributed.lightning_ranks import TinyClassifier, random_loader


class HalfWithFeedback(LayerLoop):
    """fp16 payloads with error feedback: a summable compressor whose residuals are never zero."""

    aggregation = Aggregation.SUM
    uses_memory = True

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        return Packet(payload=tensor.detach().reshape(-1).half(), shape=tensor.shape, dtype=tensor.dtype)

    def decompress(self, packet: Packet) -> Tensor:
        return packet.payload.to(packet.dtype).view(packet.shape)


def _fit(world_size: int, strategy: GradCompStrategy, loggers: Any, callbacks: list, steps: int = 6) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=steps,
        logger=loggers,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = TinyClassifier()
    trainer.fit(model, random_loader())
    trainer.params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # type: ignore[attr-defined]
    return trainer


def monitored_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Fail fast without a logger; TernGrad to W&B + CSV; the same run unmonitored; fp16 feedback to CSV + TB."""
    out: dict[str, Any] = {}
    try:
        _fit(world_size, GradCompStrategy("terngrad"), False, [CompressionMonitor(histogram_every=1)], steps=1)
    except ValueError as exc:
        out["no_logger_error"] = str(exc)

    wandb_logger = WandbLogger(offline=True, save_dir=tmp, project="gradcomp-test")
    csv_logger = CSVLogger(tmp, name="terngrad")
    monitored = _fit(world_size, GradCompStrategy("terngrad"), [wandb_logger, csv_logger], [CompressionMonitor(histogram_every=1)])
    out["params"] = monitored.params  # type: ignore[attr-defined]
    out["progress_bar"] = {k: float(v) for k, v in monitored.progress_bar_metrics.items()}
    state = monitored.strategy.comm_state  # type: ignore[attr-defined]
    out["ratio"] = state.dense_bytes_per_step() / state.bytes_per_step()
    out["numel"] = {n: r.numel for n, r in state.ledger.records.items()}
    out["csv_dir"] = csv_logger.log_dir
    if rank == 0:
        import wandb

        wandb.finish()  # Lightning's finalize does not finish the run; the summary is written on finish

    plain = _fit(world_size, GradCompStrategy("terngrad"), False, [])
    out["plain_params"] = plain.params  # type: ignore[attr-defined]

    half_csv = CSVLogger(tmp, name="half")
    half_tb = TensorBoardLogger(tmp, name="half_tb")
    half = _fit(world_size, GradCompStrategy(HalfWithFeedback()), [half_csv, half_tb], [CompressionMonitor(histogram_every=1)])
    residuals = half.strategy.comm_state.memory.residuals  # type: ignore[attr-defined]
    out["half_residual_norms"] = {n: float(r.norm()) for n, r in residuals.items()}
    out["half_residual_max"] = {n: float(r.abs().max()) for n, r in residuals.items()}
    out["half_csv_dir"] = half_csv.log_dir
    out["half_tb_dir"] = half_tb.log_dir
    out["wandb_dir"] = str(Path(tmp) / "wandb")
    return out
