"""Rank bodies for the baseline tests: several runs per spawned group, to keep the suite's wall time small."""

from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp import GradCompState, gradcomp_hook, registry
from lightning_gradcomp.compressors import PowerSGD
from tests.distributed.lightning_ranks import comm_state, random_loader
from tests.distributed.ranks import small_mlp


def _ddp_run(model: nn.Module, rank: int, steps: int, state: Optional[GradCompState] = None,
             torch_hook: Any = None, dense_steps: int = 0, bucket_cap_mb: float = 0.005) -> dict[str, Any]:
    """Train ``model`` with DDP, our hook (``state``), torch's hook (``torch_hook=(state, hook)``) or neither."""
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if state is not None:
        ddp.register_comm_hook(state, gradcomp_hook)
    elif torch_hook is not None:
        ddp.register_comm_hook(*torch_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    in_features = next(model.parameters()).shape[1]
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    history, bytes_per_step = [], []
    for step in range(steps):
        if state is not None:
            state.router.set_dense(step < dense_steps)
        x = torch.randn(16, in_features, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        out = ddp(x)
        nn.functional.cross_entropy(out[:, :5], y).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        if state is not None:
            bytes_per_step.append(state.last_step_bytes())
    result: dict[str, Any] = {"params": history}
    if state is not None:
        result.update(bytes=bytes_per_step, dense_bytes=state.dense_bytes_per_step(),
                      collectives=dict(state.ledger.collectives), hook_calls=state.ledger.hook_calls)
    del ddp, opt
    return result


def _state(model: nn.Module, compressor: Any, rank: int, world_size: int) -> GradCompState:
    compressor.setup(rank, world_size, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    return GradCompState(compressor=compressor, names=names, world_size=world_size)


def baselines_suite(rank: int, world_size: int, names: list[str], steps: int = 3) -> dict[str, Any]:
    """Every named compressor through our hook on small buckets, and PowerSGD against torch's hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    dist.init_process_group("gloo")
    try:
        out: dict[str, Any] = {}
        for name in names:
            model = small_mlp()
            out[name] = _ddp_run(model, rank, steps, _state(model, registry.make_compressor(name), rank, world_size))
        # a dense first step through the multi-round compressor, then PowerSGD
        model = small_mlp()
        out["powersgd_dense_first"] = _ddp_run(model, rank, steps, _state(model, PowerSGD(), rank, world_size),
                                               dense_steps=1)
        # one tensor, one bucket (where torch's hook works): torch's PowerSGD maths against ours
        for kind in ("torch", "ours"):
            torch.manual_seed(4321)
            model = nn.Linear(40, 30, bias=False)
            if kind == "torch":
                torch_state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            use_error_feedback=True, warm_start=True, random_seed=0)
                out["parity_torch"] = _ddp_run(model, rank, 6, torch_hook=(torch_state, powerSGD_hook), bucket_cap_mb=25)
            else:
                state = _state(model, PowerSGD(rank=2, seed=0), rank, world_size)
                out["parity_ours"] = _ddp_run(model, rank, 6, state, dense_steps=2, bucket_cap_mb=25)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


# -- Lightning: callbacks end to end --------------------------------------------------------------------------


class _Classifier(pl.LightningModule):
    def __init__(self, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
        self.momentum, self.weight_decay = momentum, weight_decay

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum, weight_decay=self.weight_decay)


class _BytesPerStep(Callback):
    def __init__(self) -> None:
        self.bytes: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.bytes.append(comm_state(trainer.strategy).last_step_bytes())


def _fit(world_size: int, strategy: Any, model: _Classifier, callbacks: list, max_steps: int = 6) -> dict[str, Any]:
    recorder = _BytesPerStep()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=max_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[*callbacks, recorder])
    trainer.fit(model, random_loader())
    state = comm_state(trainer.strategy)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "bytes": recorder.bytes,
            "dense_bytes": state.dense_bytes_per_step(), "global_step": trainer.global_step}


def callbacks_suite(rank: int, world_size: int) -> dict[str, Any]:
    """Momentum correction's equivalence, DGC with all its parts, and the fail-fast optimizer check."""
    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.callbacks import CompressionSchedule, LocalGradientClipping, MomentumCorrection

    out: dict[str, Any] = {}
    out["sgd_momentum"] = _fit(world_size, "fp32", _Classifier(momentum=0.9, weight_decay=1e-3), [])
    out["momentum_correction"] = _fit(world_size, "fp32", _Classifier(),
                                      [MomentumCorrection(momentum=0.9, weight_decay=1e-3)])
    schedule = CompressionSchedule("ratio", [0.25, 0.05], unit="step", period=4, dense_steps=2)
    out["dgc"] = _fit(world_size, GradCompStrategy("dgc", bucket_cap_mb=0.005), _Classifier(),
                      [LocalGradientClipping(1.0), MomentumCorrection(0.9), schedule], max_steps=8)
    out["powersgd"] = _fit(world_size, GradCompStrategy("powersgd", bucket_cap_mb=0.005), _Classifier(momentum=0.9), [])
    try:
        _fit(world_size, "fp32", _Classifier(momentum=0.9), [MomentumCorrection(0.9)])
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    return out
