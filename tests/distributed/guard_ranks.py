"""Rank bodies for the guard's shared-collective path (the flag in the statistics' all-reduce)."""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState, gradcomp_hook, registry
from tests.distributed.ranks import small_mlp


def shared_flag_run(rank: int, world_size: int, compressor: str) -> dict[str, Any]:
    """Three steps; at step 1 rank 1's input is NaN. Returns the parameters after each step and the counters."""
    dist.init_process_group("gloo")
    try:
        model = small_mlp()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)  # several buckets per step
        comp = registry.make_compressor(compressor)
        comp.setup(rank, world_size, torch.device("cpu"))
        state = GradCompState(compressor=comp, names={id(p): n for n, p in model.named_parameters()}, world_size=world_size)
        ddp.register_comm_hook(state, gradcomp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        params, counters = [], []
        for step in range(3):
            x = torch.randn(16, 20, generator=gen)
            if step == 1 and rank == 1:
                x[0, 0] = float("nan")
            y = torch.randint(0, 5, (16,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            if state.guard.step_nonfinite:  # what GradCompStrategy does on a skipped step: no update anywhere
                opt.zero_grad(set_to_none=True)
            opt.step()
            params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
            counters.append(dict(state.ledger.collectives))
        skipped = state.guard.skipped_steps
        del ddp, opt  # DDP's reducer goes while the group still exists (a teardown after it can hang)
        dist.barrier()
        return {"params": params, "collectives": counters, "skipped": skipped}
    finally:
        dist.destroy_process_group()
