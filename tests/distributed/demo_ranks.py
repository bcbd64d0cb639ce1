"""Rank body for the DeMo tests: a small model trained through the hook with DeMo and SignSGD."""

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState, gradcomp_hook
from lightning_gradcomp.compressors import DeMo
from lightning_gradcomp.optimizers import SignSGD


class OddShapes(nn.Module):
    """Dimensions that 64 does not divide (130 -> chunks of 26, 70 -> 35), an exact 64x128 layer, a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(70, 130)
        self.b = nn.Linear(130, 64)
        self.c = nn.Linear(64, 128, bias=False)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


def demo_suite(
    rank: int, world_size: int, steps: int = 4, topk: int = 8, beta: float = 0.9, average: str = "ranks"
) -> dict[str, Any]:
    """Trains with DeMo; returns per step every rank's own gradients, the averaged update and the parameters."""
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = OddShapes()
        compressor = DeMo(topk=topk, beta=beta, average=average)  # type: ignore[arg-type]
        compressor.setup(rank, world_size, torch.device("cpu"))
        names = {id(p): n for n, p in model.named_parameters()}
        state = GradCompState(compressor=compressor, names=names, world_size=world_size)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        ddp.register_comm_hook(state, gradcomp_hook)
        opt = SignSGD(ddp.parameters(), lr=0.01, weight_decay=0.1)
        gen = torch.Generator().manual_seed(10 + rank)
        local_grads, averaged, params, nbytes = [], [], [], []
        for _ in range(steps):
            x, target = torch.randn(8, 70, generator=gen), torch.randn(8, 128, generator=gen)
            # this rank's own gradient, before any exchange (a fresh module: a deepcopy would carry DDP's hooks)
            twin = OddShapes()
            twin.load_state_dict(model.state_dict())
            nn.functional.mse_loss(twin(x), target).backward()
            local_grads.append({n: cast(torch.Tensor, p.grad).clone() for n, p in twin.named_parameters()})  # all set
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), target).backward()
            averaged.append({n: cast(torch.Tensor, p.grad).clone() for n, p in model.named_parameters()})
            opt.step()
            params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
            nbytes.append(state.last_step_bytes())
        dense_bytes = state.dense_bytes_per_step()
        # DDP's reducer goes while the group is still registered: were it the group's last holder, its destructor
        # would join Gloo's worker threads holding the GIL while a worker needs the GIL to free the tensors of a
        # finished all-gather (a deadlock, caught by gdb in this fixture one run in about 20)
        del ddp, opt, state
        dist.barrier()  # no rank destroys the group while a peer still receives its last all-gather
        return {"local": local_grads, "averaged": averaged, "params": params, "bytes": nbytes, "dense_bytes": dense_bytes}
    finally:
        dist.destroy_process_group()
