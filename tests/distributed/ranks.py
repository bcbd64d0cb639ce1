"""Rank bodies shared by the distributed tests (module level so spawned ranks can import them)."""

from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState, gradcomp_hook, registry
from lightning_gradcomp.compressors.base import Compressor


def small_mlp() -> nn.Module:
    torch.manual_seed(1234)  # same initial replica on every rank
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def train_raw_ddp(
    rank: int,
    world_size: int,
    compressor: Optional[str],
    steps: int = 4,
    compressor_kwargs: Optional[dict] = None,
    bucket_cap_mb: float = 0.005,
    pipeline_bytes: Optional[int] = None,
) -> dict[str, Any]:
    """Plain torch DDP (``compressor=None``) or DDP with our hook; returns parameters after every step."""
    dist.init_process_group("gloo")
    try:
        model = small_mlp()
        # tiny buckets: several buckets per step, so ordering across buckets is exercised
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        state = None
        if compressor is not None:
            comp: Compressor
            if compressor == "sparse_probe":
                from tests.distributed.sparse_probe import RankSparseProbe

                comp = RankSparseProbe()
            else:
                comp = registry.COMPRESSORS[compressor][0](**(compressor_kwargs or {}))
            comp.setup(rank, world_size, torch.device("cpu"))
            names = {id(p): n for n, p in model.named_parameters()}
            state = GradCompState(compressor=comp, names=names, world_size=world_size, pipeline_bytes=pipeline_bytes)
            ddp.register_comm_hook(state, gradcomp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
        history = []
        local_grads = None
        for _ in range(steps):
            x = torch.randn(16, 20, generator=gen)
            y = torch.randint(0, 5, (16,), generator=gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            if state is not None:  # this rank's own gradient, for checking what the hook averaged
                local_grads = torch.cat(
                    [g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)]
                )
            loss.backward()
            opt.step()
            history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        out: dict[str, Any] = {"params": history}
        if state is not None:
            out["bytes_per_step"] = state.bytes_per_step()
            out["dense_bytes"] = state.dense_bytes_per_step()
            out["collectives"] = dict(state.ledger.collectives)
            out["hook_calls"] = state.ledger.hook_calls
            out["grads"] = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in model.parameters()])  # all set by backward
            out["local_grads"] = local_grads
        # release DDP (its reducer holds the group) on every rank before tearing the group down together
        del ddp, opt
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()
