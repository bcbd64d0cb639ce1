"""Rank bodies of the reliability tests: several Trainer runs per spawned group, to keep the spawn count low.

Each body loops over compressors and catches per-compressor failures, so one broken compressor reports
itself instead of hiding the others (a hang still fails the whole group through the harness timeout).
"""

import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy, registry
from lightning_gradcomp.exchange.ledger import ByteReport
from tests.distributed.lightning_ranks import TinyClassifier, comm_state, random_loader
from tests.distributed.memory_probe import MemoryProbe

#: compressors every reliability test covers: all registered names, plus the test-only stateful probe
PROBES: dict[str, Callable[[], Any]] = {"memory_probe": MemoryProbe}


def compressors_under_test() -> list[str]:
    return registry.compressor_names() + sorted(PROBES)


class StepDataClassifier(TinyClassifier):
    """Draws its batch from (rank, global step) instead of the loader: the data of step t is the same whether or
    not the run was interrupted before t (Lightning restores a loader's position only for stateful loaders)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * self.global_rank + self.trainer.global_step)
        x = torch.randn(16, 20, generator=gen)
        return super().training_step((x, x[:, :5].argmax(dim=1)), batch_idx)


def step_loader(batches: int = 6) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(batches * 2, 1)), batch_size=1)


def make_strategy(name: str, **kwargs: Any) -> GradCompStrategy:
    compressor = PROBES[name]() if name in PROBES else name
    return GradCompStrategy(compressor=compressor, **kwargs)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def fit(
    world_size: int,
    strategy: Any,
    max_steps: int,
    model: Optional[pl.LightningModule] = None,
    loader: Optional[DataLoader] = None,
    ckpt_path: Optional[str] = None,
    save_to: Optional[str] = None,
    **trainer_kwargs: Any,
) -> tuple[pl.LightningModule, pl.Trainer]:
    model = model if model is not None else TinyClassifier(momentum=0.9)
    options: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(trainer_kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=max_steps, **options)
    trainer.fit(model, loader if loader is not None else random_loader(128, 16), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return model, trainer


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception:
        return {"error": traceback.format_exc()}


# -- checkpoint / resume ------------------------------------------------------------------------------------
def resume_runs(
    rank: int, world_size: int, names: list[str], tmpdir: str, total: int, at: int, **options: Any
) -> dict[str, Any]:
    """Per compressor: parameters of an uninterrupted run, of a run stopped at ``at`` and resumed, of a resume
    that drops the compression state, and the error of resuming a checkpoint claiming another world size.

    ``options``: further strategy options (e.g. ``site_sizes`` for the hierarchical exchange); with them, only the
    uninterrupted and the resumed run."""
    out: dict[str, Any] = {}
    for name in names:

        def one() -> dict[str, Any]:
            res: dict[str, Any] = {}
            # the uninterrupted run writes a checkpoint at step `at` (mid-epoch), as a run that then crashed would
            folder = os.path.join(tmpdir, name)
            saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=at, save_top_k=-1)
            run: dict[str, Any] = dict(loader=step_loader(3 * world_size))  # 6 batches per rank per epoch, whatever the world size
            full, full_trainer = fit(world_size, make_strategy(name, **options), total,
                                     StepDataClassifier(momentum=0.9), enable_checkpointing=True, callbacks=[saver],
                                     **run)
            res["full"] = flat_params(full)
            res["full_bytes"] = cast(ByteReport, full_trainer.strategy).bytes_per_step()
            path = os.path.join(folder, f"epoch=0-step={at}.ckpt")
            resumed, trainer = fit(world_size, make_strategy(name, **options), total, StepDataClassifier(momentum=0.9),
                                   ckpt_path=path, **run)
            res["resumed"] = flat_params(resumed)
            res["resumed_bytes"] = cast(ByteReport, trainer.strategy).bytes_per_step()
            res["global_step"] = trainer.global_step
            saved = torch.load(path, weights_only=False)["gradcomp"]
            res["saved_ranks"] = len(saved["ranks"])
            res["saved_memory"] = sorted(saved["ranks"][rank]["memory"])
            if options:
                return res
            reset, _ = fit(world_size, make_strategy(name, resume_compression="reset"), total,
                           StepDataClassifier(momentum=0.9), ckpt_path=path, **run)
            res["reset"] = flat_params(reset)
            # a checkpoint that claims a third rank: refused (or accepted when it holds no per-rank state)
            if rank == 0:
                checkpoint = torch.load(path, weights_only=False)
                checkpoint["gradcomp"]["world_size"] = world_size + 1
                checkpoint["gradcomp"]["ranks"].append(checkpoint["gradcomp"]["ranks"][-1])
                torch.save(checkpoint, path + ".other")
            torch.distributed.barrier()
            try:
                fit(world_size, make_strategy(name), total, StepDataClassifier(momentum=0.9),
                    ckpt_path=path + ".other", **run)
                res["other_world_error"] = None
            except ValueError as exc:
                res["other_world_error"] = str(exc)
            return res

        out[name] = _guarded(one)
    return out


# -- non-finite gradients and the replica check ------------------------------------------------------------
class InjectingClassifier(StepDataClassifier):
    """Records the parameters after every step; on ``bad_rank`` at ``bad_step`` it poisons the input (NaN) or,
    with ``perturb``, nudges one parameter so that the replicas diverge."""

    def __init__(self, bad_rank: int, bad_step: int, perturb: bool = False) -> None:
        super().__init__(momentum=0.9)
        self.bad_rank, self.bad_step, self.perturb = bad_rank, bad_step, perturb
        self.history: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.bad_rank and self.trainer.global_step == self.bad_step and not self.perturb:
            loss = loss * float("nan")  # every gradient of this rank becomes NaN
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.perturb and self.global_rank == self.bad_rank and self.trainer.global_step == self.bad_step:
            layer = self.net[2]
            assert isinstance(layer, torch.nn.Linear)
            with torch.no_grad():
                layer.bias[0] += 1e-3

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.history.append(flat_params(self))


class NormInjectingClassifier(InjectingClassifier):
    """With a BatchNorm layer; on ``bad_rank`` at ``bad_step`` the input is NaN, so that step's forward writes NaN
    into the running statistics. Records the buffers after every step."""

    def __init__(self, bad_rank: int, bad_step: int) -> None:
        super().__init__(bad_rank, bad_step, perturb=True)  # no loss poisoning: the input carries the NaN
        torch.manual_seed(99)
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 5))
        self.buffer_history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.global_rank == self.bad_rank and self.trainer.global_step == self.bad_step:
            x = x * float("nan")
        return self.net(x)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass  # no parameter perturbation

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.buffer_history.append(torch.cat([b.detach().reshape(-1).double().clone() for b in self.buffers()]))


def guard_runs(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    """Per compressor: NaN on rank 1 at step 2 with ``nonfinite='skip'`` and with ``'raise'``; a NaN batch on rank
    0 at step 2 through a BatchNorm layer; once: a replica perturbed on rank 1 at step 2 under
    ``check_replicas_every=1``."""
    out: dict[str, Any] = {}
    for name in names:

        def one() -> dict[str, Any]:
            res: dict[str, Any] = {}
            model, trainer = fit(world_size, make_strategy(name), 5, InjectingClassifier(1, 2), loader=step_loader())
            state = comm_state(trainer.strategy)
            res["history"] = model.history
            res["skipped"] = state.guard.skipped_steps
            res["residuals_finite"] = all(bool(torch.isfinite(r).all()) for r in state.memory.residuals.values())
            res["residual_names"] = sorted(state.memory.residuals)
            norm, trainer = fit(world_size, make_strategy(name), 5, NormInjectingClassifier(0, 2), loader=step_loader())
            res["norm_skipped"] = comm_state(trainer.strategy).guard.skipped_steps
            res["norm_buffers"] = norm.buffer_history
            with torch.no_grad():
                res["norm_eval_finite"] = bool(torch.isfinite(norm.eval()(torch.randn(4, 20))).all())
            try:
                fit(world_size, make_strategy(name, nonfinite="raise"), 5, InjectingClassifier(1, 2), loader=step_loader())
                res["raised"] = None
            except Exception as exc:
                res["raised"] = (type(exc).__name__, str(exc))
            return res

        out[name] = _guarded(one)

    def replicas() -> dict[str, Any]:
        started = time.perf_counter()
        try:
            fit(world_size, make_strategy("fp32", check_replicas_every=1), 5, InjectingClassifier(1, 2, perturb=True),
                loader=step_loader())
            return {"raised": None}
        except Exception as exc:
            return {"raised": (type(exc).__name__, str(exc)), "seconds": time.perf_counter() - started}

    out["__replicas__"] = _guarded(replicas)
    return out


# -- training modes ------------------------------------------------------------------------------------------
class ChunkClassifier(TinyClassifier):
    """Batch ``b`` is the concatenation of data chunks ``b*per_batch ...``: an accumulating run over 1-chunk
    batches sees exactly the data of a run over ``per_batch``-chunk batches."""

    def __init__(self, per_batch: int = 1) -> None:
        super().__init__(momentum=0.9)
        self.per_batch = per_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        xs = []
        for i in range(batch_idx * self.per_batch, (batch_idx + 1) * self.per_batch):
            xs.append(torch.randn(8, 20, generator=torch.Generator().manual_seed(1000 * self.global_rank + i)))
        x = torch.cat(xs).to(self.dtype)
        return torch.nn.functional.cross_entropy(self(x), x[:, :5].argmax(dim=1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.training_step(batch, batch_idx), sync_dist=True)


class GraphNet(ChunkClassifier):
    """Tied weights (``dec.weight is enc.weight``), a frozen layer and a layer that no loss uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4321)
        self.enc = torch.nn.Linear(20, 20)
        self.dec = torch.nn.Linear(20, 20)
        self.dec.weight = self.enc.weight
        self.frozen = torch.nn.Linear(20, 20).requires_grad_(False)
        self.unused = torch.nn.Linear(20, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dec(torch.relu(self.enc(x))))
        return self.net(self.frozen(h))


class TwoOptimizers(ChunkClassifier):
    """Manual optimization with one optimizer for the body and one for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizers = self.optimizers()
        assert isinstance(optimizers, list)
        body, head = optimizers
        loss = super().training_step(batch, batch_idx)
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        body.step()
        head.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.net[:4].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(self.net[4:].parameters(), lr=1e-3),
        ]


def _mode_result(model: pl.LightningModule, trainer: pl.Trainer, initial: torch.Tensor) -> dict[str, Any]:
    state = comm_state(trainer.strategy)
    params = flat_params(model).float()
    return {
        "params": params,
        "moved": not torch.equal(params, initial.float()),
        "finite": bool(torch.isfinite(params).all()),
        "hook_calls": state.ledger.hook_calls,
        "steps": trainer.global_step,
        "residuals": {n: r.detach().float().clone() for n, r in state.memory.residuals.items()},
        "names": sorted(state.names.values()),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "grad_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
    }


#: mode name -> (model factory, strategy options, Trainer options); modes are combined to keep the runs few
MODES: dict[str, tuple[Callable[[], pl.LightningModule], dict[str, Any], dict[str, Any]]] = {
    "accumulate_validate": (
        ChunkClassifier,
        {},
        {"accumulate_grad_batches": 2, "val_check_interval": 4, "limit_val_batches": 2},
    ),
    "big_batch": (lambda: ChunkClassifier(per_batch=2), {}, {}),
    "bf16_mixed_manual_two_optimizers": (TwoOptimizers, {}, {"precision": "bf16-mixed"}),
    "bf16_true": (ChunkClassifier, {}, {"precision": "bf16-true"}),
    "fp16_true_static_graph": (GraphNet, {"static_graph": True}, {"precision": "16-true"}),
    "unused_frozen_tied": (GraphNet, {"find_unused_parameters": True}, {}),
}


def mode_runs(rank: int, world_size: int, names: list[str], modes: list[str], steps: int = 4) -> dict[str, Any]:
    """Per compressor and mode: a short fit; returns what the tests compare across ranks and modes."""
    out: dict[str, Any] = {}
    for name in names:
        for mode in modes:
            factory, strategy_options, trainer_options = MODES[mode]

            def one() -> dict[str, Any]:
                model = factory()
                initial = flat_params(model)
                options = dict(trainer_options)
                batches = steps * options.get("accumulate_grad_batches", 1)
                val = step_loader(2) if "val_check_interval" in options else None
                trainer = pl.Trainer(
                    strategy=make_strategy(name, **strategy_options),
                    accelerator="cpu",
                    devices=world_size,
                    max_steps=steps,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    num_sanity_val_steps=0,
                    **options,
                )
                trainer.fit(model, DataLoader(TensorDataset(torch.zeros(batches * world_size, 1)), batch_size=1), val)
                res = _mode_result(model, trainer, initial)
                if val is not None:
                    trainer.test(model, step_loader(2), verbose=False)
                    res["metrics"].update({k: float(v) for k, v in trainer.callback_metrics.items()})
                return res

            out[f"{name}/{mode}"] = _guarded(one)
    return out


def suite(rank: int, world_size: int, names: list[str], tmpdir: str, total: int, at: int, modes: list[str]) -> dict:
    """All of the above in one spawned group (spawning is the slow part on a busy machine)."""
    return {
        "resume": resume_runs(rank, world_size, names, tmpdir, total, at),
        "guard": guard_runs(rank, world_size, names),
        "modes": mode_runs(rank, world_size, names, modes),
    }


# -- faults --------------------------------------------------------------------------------------------------
class DyingClassifier(StepDataClassifier):
    """Rank ``victim`` kills itself (SIGKILL: no cleanup, no goodbye to its peers) at step ``at``; with
    ``stall_s`` it stops answering instead (sleeps that long, its connections open)."""

    def __init__(self, victim: int, at: int, stall_s: Optional[float] = None) -> None:
        super().__init__()
        self.victim, self.at, self.stall_s = victim, at, stall_s

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == self.victim and self.trainer.global_step == self.at:
            if self.stall_s is None:
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                time.sleep(self.stall_s)


def survivor_run(
    rank: int, world_size: int, name: str, victim: int, timeout_s: float, stall_s: Optional[float] = None
) -> dict[str, Any]:
    """Train until rank ``victim`` dies (or stalls for ``stall_s``); the survivors report how they stopped and how
    long it took."""
    started = time.perf_counter()
    try:
        fit(world_size, make_strategy(name, timeout=timedelta(seconds=timeout_s)), 50,
            DyingClassifier(victim, 2, stall_s), loader=step_loader(50))
        outcome: dict[str, Any] = {"raised": None}
    except BaseException as exc:
        outcome = {"raised": (type(exc).__name__, str(exc))}
    outcome["seconds"] = time.perf_counter() - started
    return outcome


# -- WeightGrad: accumulators, staleness counter, G_thresh and per-site weights survive a resume -------------
def weightgrad_resume(rank: int, world_size: int, tmpdir: str, total: int, at: int) -> dict[str, Any]:
    """4 ranks in 2 sites, a WAN round every 2 steps, SGD with momentum 0.9 (each site's momentum buffers differ),
    checkpoint mid-cycle at ``at``: uninterrupted vs resumed, and a resume that drops the compression state (the
    control: it must differ)."""
    from lightning_gradcomp.weightgrad import WeightGradStrategy

    def strategy(**kwargs: Any) -> WeightGradStrategy:
        return WeightGradStrategy(site_size=2, staleness_bound=2, **kwargs)

    saver = ModelCheckpoint(dirpath=tmpdir, every_n_train_steps=at, save_top_k=-1)
    run: dict[str, Any] = dict(loader=step_loader())
    full, _ = fit(world_size, strategy(), total, StepDataClassifier(momentum=0.9),
                  enable_checkpointing=True, callbacks=[saver], **run)
    path = os.path.join(tmpdir, f"epoch=0-step={at}.ckpt")
    resumed, trainer = fit(world_size, strategy(), total, StepDataClassifier(momentum=0.9), ckpt_path=path, **run)
    reset, _ = fit(world_size, strategy(resume_compression="reset"), total, StepDataClassifier(momentum=0.9),
                   ckpt_path=path, **run)
    assert isinstance(trainer.strategy, WeightGradStrategy) and trainer.strategy.synchronizer is not None
    return {"full": flat_params(full), "resumed": flat_params(resumed), "reset": flat_params(reset),
            "rounds": trainer.strategy.synchronizer.rounds}


# -- a layer unused on one rank at one step (find_unused_parameters=False or a static graph) ----------------
class SometimesUnusedLayer(StepDataClassifier):
    """``extra`` feeds the loss on every rank and step except on rank ``victim`` at step ``at``."""

    def __init__(self, victim: int, at: int) -> None:
        super().__init__()
        self.victim, self.at = victim, at
        self.extra = torch.nn.Linear(5, 5)
        self.stalled_at: Optional[float] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.global_rank == self.victim and self.trainer.global_step == self.at:
            return out
        return self.extra(out)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.at:
            self.stalled_at = time.perf_counter()


def unused_layer_run(rank: int, world_size: int, name: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Train until rank 1 leaves ``extra`` unused at step 2; report how each rank stopped, and how long after
    that step began."""
    model = SometimesUnusedLayer(victim=1, at=2)
    try:
        fit(world_size, make_strategy(name, timeout=timedelta(seconds=timeout_s), **options), 6, model,
            loader=step_loader())
        outcome: dict[str, Any] = {"raised": None}
    except BaseException as exc:
        outcome = {"raised": (type(exc).__name__, str(exc))}
    outcome["seconds"] = None if model.stalled_at is None else time.perf_counter() - model.stalled_at
    return outcome


# -- a checkpoint written at the end of an epoch (ModelCheckpoint(every_n_epochs=1)) ----------------------------
class LoaderDataClassifier(TinyClassifier):
    """Trains on the loader's (shuffled, per-epoch) batches and records a checksum of each."""

    def __init__(self) -> None:
        super().__init__(momentum=0.9)
        self.seen: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.trainer.current_epoch, float(batch[0].sum())))
        return super().training_step(batch, batch_idx)


def epoch_end_resume(rank: int, world_size: int, names: list[str], tmpdir: str, limits: dict[str, Any]) -> dict[str, Any]:
    """Per compressor: 2 epochs of 4 shuffled batches, checkpointed at the end of epoch 0, resumed from it."""
    out: dict[str, Any] = {}
    for name in names:

        def one() -> dict[str, Any]:
            folder = os.path.join(tmpdir, name)
            loader = DataLoader(random_loader(64, 8).dataset, batch_size=8, shuffle=True)
            saver = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
            runs = []
            for ckpt_path, callbacks in ((None, [saver]), (os.path.join(folder, "epoch=0-step=4.ckpt"), [])):
                model = LoaderDataClassifier()
                options: dict[str, Any] = dict(logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
                trainer = pl.Trainer(strategy=make_strategy(name), accelerator="cpu", devices=world_size, **limits,
                                     **options)
                trainer.fit(model, loader, ckpt_path=ckpt_path)
                runs.append((flat_params(model), model.seen, trainer.global_step))
            (full, full_seen, _), (resumed, resumed_seen, steps) = runs
            return {"full": full, "resumed": resumed, "full_seen": full_seen, "resumed_seen": resumed_seen,
                    "global_step": steps}

        out[name] = _guarded(one)
    return out
