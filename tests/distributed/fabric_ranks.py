"""Rank bodies that run a ``lightning.fabric.Fabric`` loop (joined through torchrun-style environment variables)."""

from typing import Any, Optional

import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_gradcomp  # noqa: F401  (registers the strategy names in Fabric's registry)
from tests.distributed.lightning_ranks import random_loader


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def fit_fabric(
    rank: int,
    world_size: int,
    strategy: Any,
    steps: int = 5,
    nan_at_step: Optional[int] = None,
    momentum: float = 0.0,
) -> dict[str, Any]:
    """A short Fabric loop on rank ``rank``'s shard; a NaN loss on the last rank at ``nan_at_step``."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()  # ranks are started externally: joins the group
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    model, optimizer = fabric.setup(model, optimizer)
    before_nan: Optional[torch.Tensor] = None
    batches = iter(random_loader(shard=(rank, world_size)))
    for step in range(steps):
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        if step == nan_at_step:
            before_nan = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            if rank == world_size - 1:
                loss = loss * float("nan")
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        if step == nan_at_step:
            after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert before_nan is not None and torch.equal(before_nan, after), "a skipped step changed the weights"
    state = getattr(fabric.strategy, "comm_state", None)
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "strategy": type(fabric.strategy).__name__,
        "compressor": type(getattr(fabric.strategy, "compressor", None)).__name__,
        "bytes_per_step": state.bytes_per_step() if state else None,
        "dense_bytes": state.dense_bytes_per_step() if state else None,
        "skipped_steps": state.guard.skipped_steps if state else None,
        "transforms": [type(t).__name__ for t in getattr(fabric.strategy, "transforms", ())],
    }


def _train(fabric: Fabric, model: nn.Module, optimizer: Any, batches: list, steps: range) -> None:
    for step in steps:
        x, y = batches[step]
        optimizer.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def resume_fabric(rank: int, world_size: int, name: str, path: str,
                  ways: tuple[str, ...] = ("exact", "reset")) -> dict[str, torch.Tensor]:
    """6 steps straight; 3 steps, ``fabric.save``, a fresh Fabric that ``fabric.load``s and runs 3 more (exact and
    reset; and ``full``: the whole checkpoint loaded, then the model and optimizer restored by hand)."""
    batches = list(random_loader(shard=(rank, world_size)))

    def fresh(resume: str = "exact") -> tuple[Fabric, nn.Module, Any]:
        from lightning_gradcomp import GradCompFabricStrategy

        fabric = Fabric(accelerator="cpu", devices=world_size,
                        strategy=GradCompFabricStrategy(name, resume_compression=resume))
        fabric.launch()
        model = make_model()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        return fabric, model, optimizer

    fabric, model, optimizer = fresh()
    _train(fabric, model, optimizer, batches, range(6))
    out = {"straight": _flat(model)}
    fabric, model, optimizer = fresh()
    _train(fabric, model, optimizer, batches, range(3))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    for resume in (w for w in ways if w != "full"):
        fabric, model, optimizer = fresh(resume)
        state = {"model": model, "optimizer": optimizer}
        remainder = fabric.load(path, state)
        assert not remainder, f"the compression state leaked into the remainder: {sorted(remainder)}"
        _train(fabric, model, optimizer, batches, range(3, 6))
        out[resume] = _flat(model)
    if "full" not in ways:
        return out
    # Fabric's other documented way: the whole checkpoint back, each object restored from it by the user
    fabric, model, optimizer = fresh()
    full = fabric.load(path)
    model.load_state_dict(full["model"])
    optimizer.load_state_dict(full["optimizer"])
    _train(fabric, model, optimizer, batches, range(3, 6))
    out["full"] = _flat(model)
    return out


def diverge_fabric(rank: int, world_size: int, perturb_at_step: Optional[int], steps: int = 3) -> dict[str, Any]:
    """``GradCompFabricStrategy("fp32", check_replicas_every=1)``; at ``perturb_at_step`` the last rank nudges one
    weight before ``optimizer.step()``, so the replicas differ right after that step. Returns the error, if any."""
    from lightning_gradcomp import GradCompFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=GradCompFabricStrategy("fp32", check_replicas_every=1))
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = iter(random_loader(shard=(rank, world_size)))
    try:
        for step in range(steps):
            x, y = next(batches)
            optimizer.zero_grad()
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            if step == perturb_at_step and rank == world_size - 1:
                with torch.no_grad():
                    model.module[2].weight[0, 0] += 1e-3
            optimizer.step()
    except Exception as exc:
        return {"error": (type(exc).__name__, str(exc)), "step": step}
    return {"error": None, "params": _flat(model)}


def hierarchy_fabric(rank: int, world_size: int, steps: int = 3) -> dict[str, Any]:
    """``fp32`` through the hierarchical exchange (sites of 2 ranks) under Fabric, and the same SGD steps computed in
    this process from every rank's batches (the mean gradient over the ranks), as the reference."""
    from lightning_gradcomp import GradCompFabricStrategy

    out = fit_fabric(rank, world_size, GradCompFabricStrategy("fp32", site_size=2), steps)
    reference = make_model()
    loaders = [iter(random_loader(shard=(r, world_size))) for r in range(world_size)]
    for _ in range(steps):
        grads = []
        for loader in loaders:
            x, y = next(loader)
            reference.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p.sub_(0.1 * torch.stack([g[i] for g in grads]).mean(dim=0))
    return {**out, "reference": _flat(reference)}
