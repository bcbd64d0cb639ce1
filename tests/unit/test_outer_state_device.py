"""``outer_state_device="cpu"``: the global weights, the outer momentum and the outer error feedback stay off the
accelerator while the parameters train on it. Needs a CUDA device (skipped otherwise: on a CPU-only machine both
places are the same device and nothing could fail)."""

from pathlib import Path
from typing import cast

import pytest
import torch

from lightning_gradcomp.exchange.memory import ResidualMemory

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_residual_memory_keeps_residuals_on_its_storage_device() -> None:
    memory = ResidualMemory(torch.device("cpu"))
    grad = torch.randn(100, device="cuda")
    compensated = memory.compensate(grad, "w")
    memory.update("w", compensated, torch.zeros_like(compensated))
    assert memory.residuals["w"].device.type == "cpu"
    again = memory.compensate(grad, "w")
    assert again.device.type == "cuda"
    torch.testing.assert_close(again, 2 * grad)


@cuda
def test_diloco_outer_state_on_cpu_while_training_on_cuda(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    import lightning_gradcomp  # noqa: F401
    from lightning_gradcomp.outer import DiLoCoStrategy
    from tests.distributed.lightning_ranks import random_loader
    from tests.distributed.weightgrad_ranks import AdamClassifier

    strategy = DiLoCoStrategy(sync_every=2, outer_state_device="cpu", process_group_backend="nccl")
    trainer = pl.Trainer(strategy=strategy, accelerator="cuda", devices=1, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    model = AdamClassifier()
    trainer.fit(model, random_loader())
    outer = strategy.outer
    assert outer is not None and outer.rounds == 2
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(a.device.type == "cpu" for a in outer.anchor.values())
    momentum = [s["momentum_buffer"] for s in outer.outer_optimizer.state.values()]
    assert momentum and all(m.device.type == "cpu" for m in momentum)
    # after the last round the weights are the global ones
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), outer.anchor[name])


@cuda
def test_sharded_diloco_outer_state_on_cpu_while_the_shards_train_on_cuda(tmp_path: Path) -> None:
    """Over FSDP2 (one site of one shard here: the outer round runs on the local shard, a plain CUDA tensor taken
    from the DTensor parameter), the anchor and the outer momentum stay on the CPU."""
    import lightning.pytorch as pl
    from torch.distributed.tensor import DTensor

    import lightning_gradcomp  # noqa: F401
    from lightning_gradcomp.outer import ShardedDiLoCoStrategy
    from tests.distributed.sharded_ranks import ShardedRegressor, _loader

    strategy = ShardedDiLoCoStrategy(sync_every=2, shard_size=1, outer_state_device="cpu", process_group_backend="nccl")
    trainer = pl.Trainer(strategy=strategy, accelerator="cuda", devices=1, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    model = ShardedRegressor()
    with pytest.warns(UserWarning, match="runs on one device"):
        trainer.fit(model, _loader())
    outer = strategy.outer
    assert outer is not None and outer.rounds == 2
    assert all(cast(DTensor, p).to_local().device.type == "cuda" for p in model.parameters())  # FSDP2's shards
    assert all(a.device.type == "cpu" for a in outer.anchor.values())
    momentum = [s["momentum_buffer"] for s in outer.outer_optimizer.state.values()]
    assert momentum and all(m.device.type == "cpu" for m in momentum)
    for name, p in model.named_parameters():
        torch.testing.assert_close(cast(DTensor, p).to_local().detach().cpu(), outer.anchor[name])
