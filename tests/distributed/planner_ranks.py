"""Rank bodies for the planner tests: several trainings in one process group (one spawn for all checks)."""

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState, gradcomp_hook, registry
from lightning_gradcomp.exchange.costmodel import CompressionCost
from lightning_gradcomp.exchange.planner import CollectivePlanner
from tests.distributed.ranks import small_mlp


def _train(rank: int, world_size: int, compressor: str, planner: Optional[CollectivePlanner], steps: int = 3) -> dict[str, Any]:
    model = small_mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)  # several buckets per step
    comp = registry.make_compressor(compressor)
    comp.setup(rank, world_size, torch.device("cpu"))
    state = GradCompState(
        compressor=comp, names={id(p): n for n, p in model.named_parameters()}, world_size=world_size, planner=planner
    )
    ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    history = []
    for _ in range(steps):
        x = torch.randn(16, 20, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    out = {"params": history, "collectives": dict(state.ledger.collectives), "described": comp.describe()}
    if planner is not None:
        out["plans"] = sorted({p.choice for p in planner.plans.values()})
    del ddp, opt
    dist.barrier()
    return out


def planner_checks(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    try:
        return {
            "terngrad": _train(rank, world_size, "terngrad", None),
            "fp32": _train(rank, world_size, "fp32", None),
            # a slow link, measured compute: compression pays, and the all-gather's 2-bit packets beat int8's single
            # decode by a margin no machine load closes (at 1 Mbit/s, measured decode times on a loaded machine
            # sometimes tipped a bucket to int8)
            "slow": _train(rank, world_size, "terngrad", CollectivePlanner("100kbit@100us")),
            # a fast link and a dear compressor: compression is turned off
            "fast": _train(rank, world_size, "terngrad", CollectivePlanner("100gbit@1us", CompressionCost(1e-3, 0.0))),
            # decoding N packets is dear: the int8 all-reduce (one decode) wins
            "int8": _train(rank, world_size, "terngrad", CollectivePlanner("1mbit@100us", CompressionCost(0.0, 1e-5))),
            # ranks given different links: rank 0's slow link alone would compress, rank 1's fast one would not
            "split": _train(
                rank, world_size, "terngrad",
                CollectivePlanner("1mbit@100us" if rank == 0 else "100gbit@1us", CompressionCost(1e-7, 1e-7)),
            ),
            "split_rank0_alone": _train(rank, world_size, "terngrad", CollectivePlanner("1mbit@100us", CompressionCost(1e-7, 1e-7))),
        }
    finally:
        dist.destroy_process_group()
