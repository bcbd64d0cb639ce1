"""Rank bodies for the sharded strategy under ``lightning.fabric``: several Fabric runs in one world of 4 Gloo ranks.

Ranks form a (2, 2) mesh: ranks 0 and 1 shard replica 0, ranks 2 and 3 replica 1 (rank r and r + 2 hold the same
shard). Every rank reads its own batches (drawn from its global rank), so the stock reference, whose sampler would
give both ranks of a shard group the same data, sees exactly the batches ours does.
"""

import math
from typing import Any, Optional

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn

import lightning_gradcomp  # noqa: F401  (registers the strategy names in Fabric's registry)
from lightning_gradcomp import ShardedGradCompFabricStrategy
from lightning_gradcomp.strategies.resilience import ResumeCompression


def make_model() -> nn.Sequential:
    """Three Linear layers (each its own FSDP2 unit under :func:`shard_layers`), as in ``sharded_ranks.py``."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


class Blocks(nn.Module):
    """Two blocks in an ``nn.ModuleList`` and a head: what the default ``parallelize_fn`` shards block by block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 12)])
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def shard_layers(model: nn.Sequential, device_mesh: Any) -> nn.Sequential:
    """The user's ``parallelize_fn``: each layer, then the root, over the mesh's ``"shard"`` dimension."""
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=device_mesh["shard"])
    fully_shard(model, mesh=device_mesh["shard"])
    return model


def shard_hsdp(model: nn.Sequential, device_mesh: Any) -> nn.Sequential:
    """Stock HSDP: the same units over the whole 2-D mesh (FSDP2 all-reduces densely between its rows)."""
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model


def shard_nothing(model: nn.Sequential, device_mesh: Any) -> nn.Sequential:
    """Forgets to shard."""
    return model


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(steps)]


def _local(model: nn.Module) -> torch.Tensor:
    """This rank's shard of every parameter, flat."""
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).clone()
                      for p in model.parameters()])


def _poison_at(net: nn.Sequential, step: list[int], nan_at: int, rank: int) -> None:
    """At step ``nan_at``, rank 0's gradient of one bias element of the first layer (it lands in shard 0 only) is
    NaN. The gradient hook goes on the unsharded parameter of that step, after FSDP2's own pre-forward hook."""
    def pre_forward(layer: nn.Module, args: Any) -> None:
        if step[0] != nan_at or rank != 0 or not torch.is_grad_enabled():
            return
        handles: list[Any] = []

        def poison(grad: torch.Tensor) -> torch.Tensor:
            handles[0].remove()
            return grad.index_fill(0, torch.tensor([0]), math.nan)

        bias = layer.bias
        assert isinstance(bias, torch.Tensor)
        handles.append(bias.register_hook(poison))

    net[0].register_forward_pre_hook(pre_forward)


def _launch(world_size: int, strategy: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()  # ranks are started externally: joins the group
    return fabric


def _setup(fabric: Fabric, optimizer: str, blocks: bool = False) -> tuple[Any, Any, Any]:
    net = Blocks() if blocks else make_model()
    model = fabric.setup(net)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.01))
    return net, model, fabric.setup_optimizers(opt)


def _train(fabric: Fabric, model: Any, optimizer: Any, batches: list, steps: range, step: list[int],
           record: Optional[dict[str, list]] = None) -> None:
    for i in steps:
        step[0] = i
        x, y = batches[i]
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if record is not None:
            state = getattr(fabric.strategy, "comm_state", None)
            record["shards"].append(_local(model))
            record["bytes"].append(0 if state is None else state.last_step_bytes())
            record["skipped"].append(0 if state is None else state.guard.skipped_steps)


def fit(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """One Fabric run of ``config["steps"]`` steps: this rank's shards, bytes and skip count after every step."""
    kind = config.get("kind", "sharded")
    if kind == "native":
        strategy: Any = ModelParallelStrategy(shard_hsdp, data_parallel_size=2, tensor_parallel_size=2)
    else:
        fn = {"unsharded": shard_nothing, "whole_mesh": shard_hsdp, "default_fn": None}.get(kind, shard_layers)
        strategy = ShardedGradCompFabricStrategy(fn, **config.get("strategy", {}))
    fabric = _launch(world_size, strategy)
    if kind == "optimizer_first":  # `fabric.setup(model, optimizer)`: the optimizer holds the unsharded parameters
        net = make_model()
        fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    net, model, optimizer = _setup(fabric, config.get("optimizer", "adamw"), blocks=kind == "default_fn")
    step = [0]
    if config.get("nan_at") is not None:
        _poison_at(net, step, config["nan_at"], rank)
    record: dict[str, list] = {"shards": [], "bytes": [], "skipped": []}
    _train(fabric, model, optimizer, _batches(rank, 4), range(4), step, record)
    return {**record, "shard_numel": sum(p.to_local().numel() for p in net.parameters()),
            "strategy": type(fabric.strategy).__name__,
            "units": None if kind == "native" else len(fabric.strategy.exchange.units)}  # type: ignore[attr-defined]


def resume(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """6 steps straight; 3 steps, ``fabric.save`` (``torch.distributed.checkpoint`` shards plus every rank's
    compression state), then a fresh Fabric that ``fabric.load``s and runs 3 more (exact, and reset as the control).
    Gradient Dropping with momentum SGD: the residual carries most of the gradient, so a lost residual shows."""
    batches = _batches(rank, 6)
    strategy: dict[str, Any] = dict(compressor="graddrop", shard_size=2)

    def fresh(resume_compression: ResumeCompression = "exact") -> tuple[Fabric, Any, Any]:
        fabric = _launch(world_size, ShardedGradCompFabricStrategy(shard_layers, resume_compression=resume_compression,
                                                                   **strategy))
        _, model, optimizer = _setup(fabric, "sgd")
        return fabric, model, optimizer

    fabric, model, optimizer = fresh()
    _train(fabric, model, optimizer, batches, range(6), [0])
    out: dict[str, Any] = {"straight": _local(model), "path": path}
    fabric, model, optimizer = fresh()
    _train(fabric, model, optimizer, batches, range(3), [0])
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    for way in ("exact", "reset"):
        fabric, model, optimizer = fresh(way)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = fabric.load(path, state)
        out[f"{way}_remainder"] = sorted(remainder)
        out[f"{way}_step"] = state["step"]
        _train(fabric, model, optimizer, batches, range(3, 6), [0])
        out[way] = _local(model)
    return out


def fit_configs(rank: int, world_size: int, configs: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """Every config of ``configs`` (an error, bad input refused on every rank alike, is recorded), then the resume
    runs writing under ``path``."""
    runs: list[Any] = []
    for config in configs:
        try:
            runs.append(fit(rank, world_size, config))
        except (ValueError, RuntimeError) as error:
            runs.append({"error": str(error)})
    return {"runs": runs, "resume": resume(rank, world_size, path)}


def across_nodes(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """``compress_across_nodes=True`` under Fabric (the model sharded over all 4 ranks): FSDP2 alone (one replica,
    the reference), fp32 between 4 nodes of 1 and 2 nodes of 2, int8 between 2 nodes of 2 (every rank's gathered parameters and the
    bytes), the same with the quantized weight all-gather, bad input; then int8 saved after 3 steps and loaded into a fresh Fabric for 3 more, against 6 straight."""
    batches = _batches(rank, 6)
    across: dict[str, Any] = {"shard_size": 4, "compress_across_nodes": True}
    out: dict[str, Any] = {}
    for name, options in (("fsdp2", {"compressor": "fp32", "shard_size": 4}),
                          ("fp32_4x1", dict(across, compressor="fp32", node_size=1)),
                          ("fp32_2x2", dict(across, compressor="fp32", node_size=2)),
                          ("int8_2x2", dict(across, compressor="int8", node_size=2)),
                          ("int8_weights_2x2", dict(across, compressor="int8", node_size=2, quantize_weights=True)),
                          ("bad_nodes", dict(across, compressor="int8", node_size=3)),
                          ("sparse", dict(across, compressor="graddrop", node_size=2))):
        try:
            fabric = _launch(world_size, ShardedGradCompFabricStrategy(shard_layers, **options))
            _, model, optimizer = _setup(fabric, "adamw")
        except ValueError as error:
            out[name] = {"error": str(error)}
            continue
        record: dict[str, list] = {"shards": [], "bytes": [], "skipped": []}
        _train(fabric, model, optimizer, batches, range(4), [0], record)
        strategy: Any = fabric.strategy
        out[name] = {"shards": record["shards"], "strategy_bytes": strategy.bytes_per_step(),
                     "dense_bytes": strategy.dense_bytes_per_step(),
                     "full": torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])}

    def fresh(resume_compression: ResumeCompression = "exact") -> tuple[Fabric, Any, Any]:
        fabric = _launch(world_size, ShardedGradCompFabricStrategy(shard_layers, compressor="int8", node_size=2,
                                                                   resume_compression=resume_compression, **across))
        _, model, optimizer = _setup(fabric, "sgd")
        return fabric, model, optimizer

    fabric, model, optimizer = fresh()
    _train(fabric, model, optimizer, batches, range(6), [0])
    out["straight"] = _local(model)
    out["path"] = path
    fabric, model, optimizer = fresh()
    _train(fabric, model, optimizer, batches, range(3), [0])
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    for way in ("exact", "reset"):
        fabric, model, optimizer = fresh(way)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        _train(fabric, model, optimizer, batches, range(3, 6), [0])
        out[way] = _local(model)
        out[f"{way}_step"] = state["step"]
    return out
