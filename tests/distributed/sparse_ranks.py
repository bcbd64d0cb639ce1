"""Rank bodies for the Gradient Dropping and AdaComp tests: several runs in one process group (one spawn)."""

from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState, gradcomp_hook
from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.base import Compressor


def tiny_convnet() -> nn.Module:
    torch.manual_seed(1234)  # same initial replica on every rank
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 5))


def _train(rank: int, world_size: int, compressor: Optional[Compressor], steps: int, quiet_rank: Optional[int]) -> dict:
    model = tiny_convnet()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)  # several buckets per step
    state = None
    if compressor is not None:
        compressor.setup(rank, world_size, torch.device("cpu"))
        state = GradCompState(compressor=compressor, names={id(p): n for n, p in model.named_parameters()}, world_size=world_size)
        ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    params, grads, local, nbytes = [], [], [], []
    for _ in range(steps):
        x = torch.randn(16, 1, 8, 8, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        if rank == quiet_rank:
            loss = loss * 0.0  # an all-zero gradient: this rank sends nothing
        local.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)]))
        loss.backward()
        grads.append(torch.cat([cast(torch.Tensor, p.grad).reshape(-1).clone() for p in model.parameters()]))  # all set
        opt.step()
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        if state is not None:
            nbytes.append(state.last_step_bytes())
    out: dict[str, Any] = {"params": params, "grads": grads, "local_grads": local, "bytes": nbytes}
    if state is not None:
        out["collectives"] = dict(state.ledger.collectives)
        out["dense_bytes"] = state.dense_bytes_per_step()
    del ddp, opt
    dist.barrier()
    return out


def sparse_suite(rank: int, world_size: int, steps: int = 4) -> dict[str, dict]:
    """Plain DDP and the sparse compressors in several configurations, in one process group."""
    dist.init_process_group("gloo")
    try:
        runs: dict[str, tuple[Optional[Compressor], Optional[int]]] = {
            "plain": (None, None),
            "graddrop_ratio0": (GradientDropping(drop_ratio=0.0), None),
            "graddrop": (GradientDropping(), None),
            "graddrop_global_delta16": (GradientDropping(scope="global", index_encoding="delta16", values="bf16"), None),
            "graddrop_2bit": (GradientDropping(quantize="2bit", drop_ratio=0.9), None),
            "graddrop_quiet": (GradientDropping(drop_ratio=0.0), 1),
            "adacomp": (AdaComp(), None),
            "adacomp_ls_index32": (AdaComp(selection="local", wire="index32"), None),
            "adacomp_quiet": (AdaComp(), 1),
            # the two backends side by side: deterministic selections must give the same training, bit for bit
            "graddrop_torch": (GradientDropping(backend="torch"), None),
            "graddrop_strided_fused": (GradientDropping(sample="strided", max_sample=50, backend="fused"), None),
            "graddrop_strided_torch": (GradientDropping(sample="strided", max_sample=50, backend="torch"), None),
            "adacomp_ternary_fused": (AdaComp(quantizer="ternary", backend="fused"), None),
            "adacomp_ternary_torch": (AdaComp(quantizer="ternary", backend="torch"), None),
        }
        return {key: _train(rank, world_size, comp, steps, quiet) for key, (comp, quiet) in runs.items()}
    finally:
        dist.destroy_process_group()
