"""Rank bodies for the compressed reduce-scatter across nodes: a small model under ``fully_shard`` over a 1-D CPU
mesh of every rank, stock FSDP2 against :class:`CompressedReduceScatter`, several runs in one spawned world."""

from datetime import timedelta
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gradcomp.optimizers import SignSGD
from lightning_gradcomp.strategies.fsdp_collectives import CompressedReduceScatter


def _model(exact: bool) -> nn.Sequential:
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
    if exact:  # small multiples of 1/4: every gradient and every sum of them is exact in fp32, in any order
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-2, 3, p.shape) / 4)
    return model


def _batch(rank: int, step: int, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    if exact:
        return torch.randint(-2, 3, (4, 8), generator=gen).float(), torch.randint(-2, 3, (4, 4), generator=gen).float()
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def _flat(tensors: Iterable[Optional[torch.Tensor]], gather: bool = False) -> torch.Tensor:
    """DTensors' local shards (or, with ``gather``, the whole tensors), flat and back to back."""
    out = []
    for t in tensors:
        assert isinstance(t, DTensor)
        out.append((t.full_tensor() if gather else t.to_local()).detach().reshape(-1))
    return torch.cat(out)


def train(rank: int, world_size: int, config: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """``steps`` SGD steps (``config["steps"]`` if given; ``config["fixed"]``: the first batch at every step); each
    step's loss, full parameters (all-gathered), this rank's shard and the bytes recorded."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    exact = config.get("exact", False)
    model = _model(exact)
    if config.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    elif config.get("permuted"):  # every rank of the world, pairs swapped
        mesh = DeviceMesh("cpu", torch.tensor([1, 0, 3, 2]))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm: Optional[CompressedReduceScatter] = None
    if "node_size" in config:
        comm = CompressedReduceScatter(model, config["node_size"], config.get("compressor", "int8"),
                                       timeout=timedelta(seconds=60))
    # exact runs: sign steps of 1/4 keep every weight on a grid of 1/4, so every gradient stays exact in fp32
    optimizer = SignSGD(model.parameters(), lr=0.25) if exact else torch.optim.SGD(model.parameters(), lr=0.05)
    full, local, grads, lan, wan, dense, losses = [], [], [], [], [], [], []
    for step in range(config.get("steps", steps)):
        x, y = _batch(rank, 0 if config.get("fixed") else step, exact)
        if step == config.get("nan_at") and rank == 1:
            x[0, 0] = float("nan")
        loss = ((model(x) - y) ** 2).sum() * 2.0**-4
        loss.backward()
        losses.append(loss.item())
        grads.append(_flat(p.grad for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
        full.append(_flat(model.parameters(), gather=True))
        local.append(_flat(model.parameters()))
        if comm is not None:
            wan.append(comm.bytes_per_step())
            dense.append(comm.ledger.dense_bytes_per_step())
            lan.append(comm.ledger.take_channel("lan"))
    residuals = {} if comm is None else comm.residuals()
    return {"loss": losses, "full": full, "local": local, "grads": grads, "wan": wan, "dense": dense, "lan": lan,
            "units": None if comm is None else [any(k.startswith(f"{c.name}/") for k in residuals) for c in comm.comms],
            "residual_numels": {k: r.numel() for k, r in residuals.items()},
            "collectives": None if comm is None else dict(comm.ledger.collectives),
            "residuals_finite": all(bool(torch.isfinite(r).all()) for r in residuals.values())}


def run_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    out: list[dict[str, Any]] = []
    for config in configs:
        try:
            out.append(train(rank, world_size, config))
        except ValueError as error:  # bad input: refused on every rank alike, before step 0
            out.append({"error": str(error)})
    dist.destroy_process_group()
    return out
