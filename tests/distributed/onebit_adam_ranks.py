"""Rank bodies for the 1-bit Adam / 0/1 Adam tests: the compressed all-reduce alone, DDP with the strategy's hook
and the optimizer (no Trainer), and Trainer runs (wrong optimizer, resume, non-finite gradients)."""

import os
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState
from lightning_gradcomp.compressors import Identity
from lightning_gradcomp.exchange.transport import Workers
from lightning_gradcomp.onebit_adam.exchange import CompressedAllReduce
from lightning_gradcomp.onebit_adam.strategy import LINK_KEY, FrozenAdamLink, frozen_adam_hook
from lightning_gradcomp.optimizers import OneBitAdam, ZeroOneAdam
from lightning_gradcomp.optimizers.frozen_adam import FrozenVarianceAdam


def exchange_rounds(rank: int, world_size: int, tensors: list[tuple[str, int]], rounds: int,
                    block_size: Optional[int] = None) -> dict[str, Any]:
    """``rounds`` compressed all-reduces of random vectors (distinct per rank and round) made of ``tensors``, each
    of its own scale."""
    dist.init_process_group("gloo")
    try:
        exchange = CompressedAllReduce(tensors, rank, world_size, block_size=block_size)
        numel = exchange.numel
        scales = torch.cat([torch.full((n,), 10.0 ** (i % 4 - 2)) for i, (_, n) in enumerate(tensors)])
        gen = torch.Generator().manual_seed(100 + rank)
        inputs, outputs, nbytes = [], [], []
        for _ in range(rounds):
            x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) * scales
            inputs.append(x.clone())
            outputs.append(exchange.average(x).clone())
            nbytes.append(exchange.last_nbytes)
        return {"inputs": inputs, "outputs": outputs, "nbytes": nbytes, "expected": exchange.expected_nbytes(),
                "sizes": exchange.sizes, **_errors(exchange)}
    finally:
        dist.destroy_process_group()


def _errors(exchange: CompressedAllReduce) -> dict[str, torch.Tensor]:
    return {"worker": torch.cat([exchange.worker.residuals[n].reshape(-1) for n in exchange.worker_segments.names]),
            "server": torch.cat([exchange.server.residuals[n].reshape(-1) for n in exchange.server_segments.names])}


def emulated_rounds(tensors: list[tuple[str, int]], inputs: list[list[torch.Tensor]],
                    block_size: Optional[int] = None) -> list[dict[str, Any]]:
    """The compressed all-reduces of ``inputs`` (per worker, per round) between ``len(inputs)`` workers emulated in
    this process (one thread each, on a :class:`~lightning_gradcomp.exchange.transport.WorkerTransport`), each
    single-threaded as a rank is: per worker, the averages, the bytes and both errors."""
    workers = Workers(len(inputs), timeout=60.0)
    results: list[dict[str, Any]] = [{} for _ in inputs]

    def work(rank: int) -> None:
        try:
            exchange = CompressedAllReduce(tensors, rank, len(inputs), block_size=block_size,
                                           transport=workers.transport(rank))
            outputs, nbytes = [], []
            for x in inputs[rank]:
                outputs.append(exchange.average(x.clone()).clone())
                nbytes.append(exchange.last_nbytes)
            results[rank] = {"outputs": outputs, "nbytes": nbytes, **_errors(exchange)}
        except BaseException:
            workers.abort()
            raise

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [threading.Thread(target=work, args=(rank,)) for rank in range(len(inputs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(threads_before)
    assert all(results), "a worker failed (its traceback is above)"
    return results


class Small(nn.Module):
    """67 parameters (uneven chunks on 2 and 3 ranks), two layers and a scalar."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at step ``step`` (the reference draws the same)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)


def make_optimizer(method: str, params: Any, options: dict[str, Any]) -> Any:
    return (OneBitAdam if method == "onebit" else ZeroOneAdam)(params, **options)


def train_raw(rank: int, world_size: int, method: str, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """DDP with the strategy's hook and link, the optimizer bound to the exchange; per step: the parameters, the
    phase and the exchange's bytes."""
    dist.init_process_group("gloo")
    try:
        model = Small()
        named: dict[str, torch.Tensor] = dict(model.named_parameters())
        state = GradCompState(compressor=Identity(), names={id(p): n for n, p in named.items()}, world_size=world_size)
        link = FrozenAdamLink(rank, world_size, None, torch.device("cpu"))
        state.attach(LINK_KEY, link)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)  # several buckets
        ddp.register_comm_hook(state, frozen_adam_hook)
        opt = make_optimizer(method, model.parameters(), options)
        link.bind(opt, named)
        assert link.exchange is not None  # built by bind
        params, phases, nbytes, dense = [], [], [], []
        for step in range(steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            dense.append(link.dense_gradients())
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
            phases.append(opt.phase)
            nbytes.append(link.exchange.last_nbytes if opt.exchanged else 0)
        del ddp
        dist.barrier()
        return {"params": params, "phases": phases, "nbytes": nbytes, "dense": dense}
    finally:
        dist.destroy_process_group()


# -- Trainer runs ----------------------------------------------------------------------------------------------
def _lightning() -> Any:
    import lightning.pytorch as pl

    from tests.distributed.reliability_ranks import StepDataClassifier

    class AdamVariant(StepDataClassifier):
        """The reliability tests' per-step data, with 1-bit Adam, 0/1 Adam or AdamW; optionally a NaN loss on one
        rank at one step."""

        def __init__(self, method: str, options: dict[str, Any], nan_at: Optional[tuple[int, int]] = None) -> None:
            super().__init__()
            self.method, self.options, self.nan_at = method, options, nan_at

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            if self.nan_at == (self.global_rank, self.trainer.global_step):
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.method == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-3)
            return make_optimizer(self.method, self.parameters(), {"lr": 1e-3, **self.options})

    return pl, AdamVariant


def fit_unpaired(rank: int, world_size: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per case ``(strategy, method)``, 1-bit Adam or 0/1 Adam under a strategy that is not its own, in one world: a
    Trainer strategy name, or ``"fabric:<name>"`` for a Fabric loop. The error, the step reached and whether any
    parameter changed."""
    from lightning.fabric import Fabric

    pl, AdamVariant = _lightning()
    from tests.distributed.reliability_ranks import fit, step_loader
    from tests.distributed.sharded_ranks import ShardedRegressor
    from tests.distributed.sharded_ranks import fit as sharded_fit

    def full_params(model: nn.Module) -> torch.Tensor:  # under the sharded engine: gathered (every rank calls it)
        return torch.cat([getattr(p, "full_tensor", p.detach)().detach().reshape(-1).clone() for p in model.parameters()])

    out: list[dict[str, Any]] = []
    for strategy, method in cases:
        # the sharded engine needs a module that shards itself (configure_model)
        model = ShardedRegressor(optimizer=method) if strategy.startswith("sharded_") else AdamVariant(method, {})
        before = full_params(model)
        try:
            if strategy.startswith("sharded_"):
                sharded_fit(world_size, strategy, model)
            elif strategy.startswith("fabric:"):
                fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy.split(":", 1)[1])
                fabric.launch()  # ranks are started externally: joins the group
                module, optimizer = fabric.setup(model, model.configure_optimizers())
                for step in range(3):
                    x = torch.randn(16, 20, generator=torch.Generator().manual_seed(step))
                    optimizer.zero_grad()
                    fabric.backward(nn.functional.cross_entropy(module(x), x[:, :5].argmax(dim=1)))
                    optimizer.step()
            else:
                fit(world_size, strategy, 3, model, loader=step_loader())
            out.append({"raised": None})
        except ValueError as exc:
            step = 0 if strategy.startswith("fabric:") else model.trainer.global_step
            out.append({"raised": str(exc), "step": step, "changed": not torch.equal(before, full_params(model))})
    return out


def resume_run(rank: int, world_size: int, method: str, options: dict[str, Any], tmpdir: str, total: int,
               at: int) -> dict[str, Any]:
    """Uninterrupted vs resumed from the checkpoint at step ``at``, and (the control) resumed with the compression
    state reset; the strategy's counters and error norms at the end."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl, AdamVariant = _lightning()
    from lightning_gradcomp.onebit_adam import OneBitAdamStrategy, ZeroOneAdamStrategy
    from tests.distributed.lightning_ranks import comm_state
    from tests.distributed.reliability_ranks import fit, flat_params, step_loader

    cls = OneBitAdamStrategy if method == "onebit" else ZeroOneAdamStrategy
    saver = ModelCheckpoint(dirpath=tmpdir, every_n_train_steps=at, save_top_k=-1)
    # the replica check every step (0/1 Adam: at its synchronised steps; its replicas differ in between)
    full, trainer = fit(world_size, cls(check_replicas_every=1), total, AdamVariant(method, options), loader=step_loader(total),
                        enable_checkpointing=True, callbacks=[saver])
    path = os.path.join(tmpdir, f"epoch=0-step={at}.ckpt")
    saved = torch.load(path, weights_only=False)
    resumed, _ = fit(world_size, cls(), total, AdamVariant(method, options), loader=step_loader(total), ckpt_path=path)
    reset, _ = fit(world_size, cls(resume_compression="reset"), total, AdamVariant(method, options),
                   loader=step_loader(total), ckpt_path=path)
    entry = saved["gradcomp"]["ranks"][rank]["extra"][LINK_KEY] if "gradcomp" in saved else None
    strategy = trainer.strategy
    assert isinstance(strategy, OneBitAdamStrategy)
    return {
        "full": flat_params(full), "resumed": flat_params(resumed), "reset": flat_params(reset),
        "phase_at_save": saved["optimizer_states"][0]["frozen_adam"], "entry": entry,
        "stats": {k: float(v) for k, v in strategy.stats.items()}, "bytes": strategy.bytes_per_step(),
        "last_bytes": strategy.last_step_bytes(),
        "dense_bytes": comm_state(strategy).dense_bytes_per_step(),
    }


def nonfinite_run(rank: int, world_size: int, method: str, options: dict[str, Any], nonfinite: str, nan_at: int,
                  total: int) -> dict[str, Any]:
    """A NaN loss on rank 1 at step ``nan_at``: the final parameters, skipped steps and the optimizer's counters,
    or the error raised."""
    pl, AdamVariant = _lightning()
    from lightning_gradcomp.onebit_adam import OneBitAdamStrategy, ZeroOneAdamStrategy
    from tests.distributed.lightning_ranks import comm_state
    from tests.distributed.reliability_ranks import fit, flat_params, step_loader

    cls = OneBitAdamStrategy if method == "onebit" else ZeroOneAdamStrategy
    model = AdamVariant(method, options, nan_at=(1, nan_at))
    try:
        _, trainer = fit(world_size, cls(nonfinite=nonfinite), total, model, loader=step_loader(total))
    except BaseException as exc:  # the test asserts what came out
        return {"raised": (type(exc).__name__, str(exc))}
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, FrozenVarianceAdam)
    return {"raised": None, "params": flat_params(model), "skipped": comm_state(trainer.strategy).guard.skipped_steps,
            "counters": dict(optimizer.counters), "finite": bool(torch.isfinite(flat_params(model)).all())}


def final_sync_run(rank: int, world_size: int, tmpdir: str, cases: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """0/1 Adam fits that end between two synchronisations, one per case ``(max_steps, max_epochs, batches per
    rank)``, each with a ModelCheckpoint at the epoch's end: the parameters this rank leaves ``fit`` with, whether
    the optimizer is in sync, the checkpoint's weights and its per-rank entry."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl, AdamVariant = _lightning()
    from lightning_gradcomp.onebit_adam import ZeroOneAdamStrategy
    from tests.distributed.reliability_ranks import fit, flat_params, step_loader

    out = []
    for index, (max_steps, max_epochs, batches) in enumerate(cases):
        # frozen after step 2; synchronisations at steps 3, 4, 6, then every 4 steps (8, 12, ...)
        model = AdamVariant("zero_one", {"var_freeze_step": 1, "local_step_scaler": 2})
        saver = ModelCheckpoint(dirpath=os.path.join(tmpdir, str(index)))
        _, trainer = fit(world_size, ZeroOneAdamStrategy(), max_steps, model, loader=step_loader(batches),
                         max_epochs=max_epochs, enable_checkpointing=True, callbacks=[saver])
        optimizer = trainer.optimizers[0]
        assert isinstance(optimizer, ZeroOneAdam)
        saved = torch.load(saver.best_model_path, weights_only=False)
        out.append({
            "params": flat_params(model), "in_sync": optimizer.in_sync(), "step": trainer.global_step,
            "checkpoint": torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]),
            "entry": saved["gradcomp"]["ranks"][rank]["extra"][LINK_KEY],
        })
    return out


# -- the paired optimizers at their defaults on a model nobody tuned them on ------------------------------------
#: the MLP's widths (3 layers, 8 classes) and the run
MLP_WIDTHS, MLP_LR = (32, 256, 256, 8), 2e-3
MLP_STEPS = int(os.environ.get("MLP_STEPS", 120))


def _mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed classification task (the same on every rank): labels of a random teacher network."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2048, MLP_WIDTHS[0], generator=gen)
    teacher = torch.randn(MLP_WIDTHS[0], MLP_WIDTHS[-1], generator=gen)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def mlp_runs(rank: int, world_size: int, cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per case ``label: (strategy, optimizer options)``, a Trainer fit of the 3-layer MLP on ``world_size`` ranks
    (strategy ``"ddp"``: AdamW at the same lr) for :data:`MLP_STEPS` steps: this rank's loss on the whole task at
    the end, the steps whose gradients were not averaged densely, and the error raised, if any. Two options are not
    the optimizer's: ``nan_at`` puts a NaN into ``net.2.bias`` on every rank at that step, ``nan_loss_from`` makes
    rank 1's loss NaN from that step on (the parameters stay finite: every step is skipped)."""
    import lightning.pytorch as pl

    from lightning_gradcomp.onebit_adam import OneBitAdamStrategy
    from tests.distributed.reliability_ranks import fit, step_loader

    x_all, y_all = _mlp_data()

    class MLP(pl.LightningModule):
        def __init__(self, strategy: str, options: dict[str, Any]) -> None:
            super().__init__()
            torch.manual_seed(0)
            a, b, c, d = MLP_WIDTHS
            self.net = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d))
            self.nan_at = options.pop("nan_at", None)
            self.nan_loss_from = options.pop("nan_loss_from", None)
            self.strategy_name, self.options = strategy, options
            self.compressed = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(1000 * self.global_rank + self.trainer.global_step)
            index = torch.randint(0, len(x_all), (64,), generator=gen)
            if self.trainer.global_step == self.nan_at:
                layer = self.net[2]
                assert isinstance(layer, nn.Linear)
                with torch.no_grad():
                    layer.bias[0] = float("nan")
            strategy = self.trainer.strategy
            if isinstance(strategy, OneBitAdamStrategy):
                self.compressed += not strategy.link.dense_gradients()  # type: ignore[union-attr]
            loss = nn.functional.cross_entropy(self.net(x_all[index]), y_all[index])
            if self.nan_loss_from is not None and self.global_rank == 1 and self.trainer.global_step >= self.nan_loss_from:
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.strategy_name == "ddp":
                return torch.optim.AdamW(self.parameters(), lr=MLP_LR, weight_decay=0.0)
            method = "onebit" if self.strategy_name == "onebit_adam" else "zero_one"
            return make_optimizer(method, self.parameters(), {"lr": MLP_LR, **self.options})

    out: dict[str, Any] = {}
    for label, (strategy, options) in cases.items():
        model = MLP(strategy, dict(options))
        try:
            fit(world_size, strategy, MLP_STEPS, model, loader=step_loader(MLP_STEPS))
            raised = None
        except Exception as exc:  # the test asserts what came out
            raised = (type(exc).__name__, str(exc))
        with torch.no_grad():
            loss = float(nn.functional.cross_entropy(model.net(x_all), y_all))
        out[label] = {"loss": loss, "compressed": model.compressed, "raised": raised,
                      "global_step": model.trainer.global_step}
    # the setup-time checks in the same world (one process group fewer)
    out["__setup__"] = warmup_setup_runs(rank, world_size)
    return out


def warmup_setup_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Setup-time warm-up checks under the Trainer: a ``freeze_step`` past a 3-step run (the warnings and the setup
    line, per rank), then the default fraction in a run without end (the error, and the steps taken)."""
    import logging
    import warnings

    pl, AdamVariant = _lightning()
    from tests.distributed.reliability_ranks import fit, step_loader

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines()
    logging.getLogger("lightning_gradcomp.onebit_adam.strategy").addHandler(handler)
    logging.getLogger("lightning_gradcomp.onebit_adam.strategy").setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, trainer = fit(world_size, "onebit_adam", 3, AdamVariant("onebit", {"freeze_step": 100000}),
                             loader=step_loader(3))
        model = AdamVariant("zero_one", {})
        try:
            fit(world_size, "zero_one_adam", -1, model, loader=step_loader(3), max_epochs=-1)
            endless = None
        except ValueError as exc:
            endless = str(exc)
    finally:
        logging.getLogger("lightning_gradcomp.onebit_adam.strategy").removeHandler(handler)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, FrozenVarianceAdam)
    return {"warnings": [str(w.message) for w in caught if "freeze_step" in str(w.message)], "lines": lines,
            "compressed": optimizer.compressed_steps(3), "endless": endless,
            "endless_step": model.trainer.global_step}
