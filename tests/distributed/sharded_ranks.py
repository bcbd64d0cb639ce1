"""Rank bodies for the sharded (FSDP2) strategy: several Trainer fits in one spawned world of 4 Gloo ranks."""

import math
import os
import signal
import time
import warnings
from datetime import timedelta
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import MomentumCorrection
from lightning_gradcomp.optimizers import OneBitAdam, SignSGD, ZeroOneAdam
from lightning_gradcomp.strategies.sharded import ShardedGradCompStrategy


class ShardedRegressor(pl.LightningModule):
    """Three Linear layers, each its own FSDP2 unit, and the root; AdamW. ``nan_at``: at that step, rank 0's
    gradient of one bias element (which lands in shard 0 only) is NaN."""

    def __init__(self, native: bool = False, nan_at: int = -1, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))
        self.native, self.nan_at, self.optimizer = native, nan_at, optimizer

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None  # set by the strategy before configure_model
        # native HSDP shards over the whole 2-D mesh (FSDP2's dense all-reduce between replicas)
        mesh = self.device_mesh if self.native else self.device_mesh["shard"]
        for layer in (self.net[0], self.net[2], self.net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.net[0].register_forward_pre_hook(self._poison)

    def _poison(self, layer: nn.Module, args: Any) -> None:
        # after FSDP2's own pre-forward hook: ``layer.bias`` is the unsharded parameter of this step (reading the
        # sharded one outside the forward would all-gather on this rank alone)
        if self.global_step == self.nan_at and self.global_rank == 0 and torch.is_grad_enabled():
            handles: list[Any] = []

            def poison(grad: torch.Tensor) -> torch.Tensor:
                handles[0].remove()  # once: FSDP2 keeps the same unsharded parameter object across steps
                return grad.index_fill(0, torch.tensor([0]), math.nan)

            bias = layer.bias
            assert isinstance(bias, torch.Tensor)
            handles.append(bias.register_hook(poison))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.optimizer == "sign":
            return SignSGD(self.parameters(), lr=0.01)
        if self.optimizer in ("onebit", "zero_one"):  # not the sharded engine's: refused at the first step
            return (OneBitAdam if self.optimizer == "onebit" else ZeroOneAdam)(self.parameters(), lr=0.01)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class UnshardedRegressor(ShardedRegressor):
    """Forgets to shard: ``configure_model`` does nothing."""

    @override
    def configure_model(self) -> None:
        pass


class NativeHSDP(ShardedGradCompStrategy):
    """Stock HSDP (FSDP2 over the 2-D mesh) with the same mesh, data and loop: the reference."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        ModelParallelStrategy.setup(self, trainer)


class Shards(Callback):
    """Each rank's local shards after every optimizer step, the skip count and the bytes between replicas."""

    def __init__(self) -> None:
        self.shards: list[torch.Tensor] = []
        self.bytes: list[int] = []
        self.skipped: list[int] = []
        self.strategy_bytes: list[int] = []
        self.across_residuals: list[torch.Tensor] = []
        self.lan: list[int] = []
        self.batches: list[float] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches.append(float(batch[0].sum()))
        self.shards.append(torch.cat([_local(p).detach().reshape(-1).clone() for p in pl_module.parameters()]))
        state = trainer.strategy.comm_state  # type: ignore[attr-defined]
        self.bytes.append(0 if state is None else state.last_step_bytes())
        self.skipped.append(0 if state is None else state.guard.skipped_steps)
        self.strategy_bytes.append(trainer.strategy.last_step_bytes())  # type: ignore[attr-defined]
        across = getattr(trainer.strategy, "reduce_scatter", None)  # the compressed reduce-scatter across nodes
        if across is not None:
            residuals = across.residuals()
            if residuals:
                self.across_residuals.append(torch.cat([residuals[k].reshape(-1).clone() for k in sorted(residuals)]))
            self.lan.append(across.ledger.take_channel("lan"))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _gathered(model: pl.LightningModule) -> torch.Tensor:
    """The whole parameters, flat (every rank of the shard group must call this)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])  # type: ignore[attr-defined]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _loader(n: int = 64, batch_size: int = 4) -> DataLoader:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=gen)
    y = torch.randn(n, 3, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fit(world_size: int, strategy: Any, model: pl.LightningModule, steps: int = 4, save: str = "",
        resume: str = "", record: Optional[Shards] = None, extra: Sequence[Callback] = (),
        gather: bool = False) -> dict[str, Any]:
    record = record or Shards()
    # a checkpoint at each epoch's end (4 batches per rank), as a user's ModelCheckpoint writes it
    callbacks: list[Callback] = [record, *extra] + (
        [ModelCheckpoint(dirpath=save, every_n_epochs=1, save_top_k=-1)] if save else [])
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                         enable_checkpointing=bool(save), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(model, _loader(), ckpt_path=resume or None)
    state = trainer.strategy.comm_state  # type: ignore[attr-defined]
    exchange = getattr(trainer.strategy, "exchange", None)
    return {
        "shards": record.shards,
        "bytes": record.bytes,
        "skipped": record.skipped,
        "batches": record.batches,
        "shard_numel": sum(_local(p).numel() for p in model.parameters()),
        # what this rank holds: its parameters (shards), AdamW's moments, the compressor's residuals
        "memory": {
            "params": _nbytes(_local(p) for p in model.parameters()),
            "optimizer": _nbytes(_local(v) for s in trainer.optimizers[0].state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0),
            "residuals": 0 if state is None else _nbytes(state.memory.residuals.values()),
        },
        "collectives": None if state is None else dict(state.ledger.collectives),
        "units": None if exchange is None else len(exchange.units),
        "strategy_bytes": trainer.strategy.bytes_per_step(),  # type: ignore[attr-defined]
        "strategy_last": record.strategy_bytes,
        "across_residuals": record.across_residuals,
        "lan": record.lan,
        "dense_bytes": trainer.strategy.dense_bytes_per_step(),  # type: ignore[attr-defined]
        # ``gather``: the whole parameters (a collective over the shard group: every rank of the world here)
        "full": _gathered(model) if gather else None,
    }


def fit_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[Any]:
    """One fit per config; kinds: ``"sharded"`` (default), ``"native"`` (stock HSDP over the 2-D mesh), ``"fsdp"``
    (stock FSDP2 over the shard dimension, no hook), ``"unsharded"``, ``"ddp"``; ``"momentum_correction": m`` adds
    that callback. Each result also holds the UserWarnings the fit emitted on this rank."""
    out: list[Any] = []
    for config in configs:
        kind = config.get("kind", "sharded")
        model_cls = UnshardedRegressor if kind in ("unsharded", "ddp") else ShardedRegressor
        model = model_cls(native=kind == "native", nan_at=config.get("nan_at", -1),
                          optimizer=config.get("optimizer", "adamw"))
        cls = {"native": NativeHSDP, "fsdp": NativeHSDP, "ddp": GradCompStrategy}.get(kind, ShardedGradCompStrategy)
        record = Shards()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                extra = [MomentumCorrection(config["momentum_correction"])] if "momentum_correction" in config else []
                out.append(fit(world_size, cls(**config.get("strategy", {})), model, config.get("steps", 4),
                               config.get("save", ""), config.get("resume", ""), record, extra,
                               config.get("gather", False)))
            except (ValueError, RuntimeError) as error:  # bad input (before step 0), a divergence: every rank alike
                out.append({"error": str(error), "steps_done": len(record.shards)})
        out[-1]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return out


class StallingRegressor(ShardedRegressor):
    """Rank ``victim`` sleeps ``stall_s`` at the start of step 2 (alive, connections open), or with ``kill`` dies
    there (SIGKILL); every rank records when that step began."""

    def __init__(self, victim: int, stall_s: float, kill: bool = False) -> None:
        super().__init__()
        self.victim, self.stall_s, self.kill = victim, stall_s, kill
        self.stalled_at: Optional[float] = None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == 2 and self.stalled_at is None:
            self.stalled_at = time.perf_counter()
            if self.global_rank == self.victim and self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.global_rank == self.victim:
                time.sleep(self.stall_s)


def stalled_run(rank: int, world_size: int, victim: int, timeout_s: float, stall_s: float,
                options: Optional[dict[str, Any]] = None, kill: bool = False) -> dict[str, Any]:
    """Train until rank ``victim`` stalls (or, with ``kill``, dies) at step 2; how this rank stopped, and how long
    after that step began. ``options``: the strategy's (default: TernGrad between 2 replicas of 2 shards)."""
    model = StallingRegressor(victim, stall_s, kill)
    strategy = ShardedGradCompStrategy(**(options or {"compressor": "terngrad", "shard_size": 2}),
                                       timeout=timedelta(seconds=timeout_s))
    try:
        fit(world_size, strategy, model, steps=8)
        outcome: dict[str, Any] = {"raised": None}
    except BaseException as exc:  # the test asserts what came out
        outcome = {"raised": (type(exc).__name__, str(exc))}
    outcome["seconds"] = None if model.stalled_at is None else time.perf_counter() - model.stalled_at
    return outcome
