"""Rank bodies for the quantized weight all-gather across nodes: the small model of ``fsdp_collectives_ranks`` under
``fully_shard`` over a 1-D CPU mesh of every rank with :class:`QuantizedAllGather`, and Trainer fits with
``ShardedGradCompStrategy(quantize_weights=True)``; several runs in one spawned world."""

from datetime import timedelta
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_gradcomp.strategies.fsdp_all_gather import QuantizedAllGather
from lightning_gradcomp.strategies.fsdp_collectives import CompressedReduceScatter
from lightning_gradcomp.strategies.sharded import ShardedGradCompStrategy
from tests.distributed.fsdp_collectives_ranks import _batch, _flat, _model
from tests.distributed.sharded_ranks import ShardedRegressor, Shards, fit


def dequantized(flat: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``flat`` as the quantized all-gather delivers it: blockwise int8, decoded (the reference of the tests)."""
    block = min(block, flat.numel())
    padded = -(-flat.numel() // block) * block
    x = torch.zeros(padded)
    x[: flat.numel()] = flat
    blocks = x.view(-1, block)
    # written out here, not the library's BlockInt8: the largest magnitude of a block maps to 127, rounded to nearest
    scales = blocks.abs().amax(dim=1, keepdim=True)
    codes = torch.round(blocks * torch.where(scales > 0, 127 / scales, 0.0)).to(torch.int8)
    return (codes.float() * (scales / 127)).reshape(-1)[: flat.numel()]


def train(rank: int, world_size: int, config: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """``steps`` SGD steps. Per step: the whole weights each Linear computed with in its forward, this rank's
    master shard (before the step) and its gradient, and the bytes recorded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(exact=False)
    if config.get("mixed"):  # a unit whose all-gather would be raw bytes (fp32 weight, fp64 bias)
        model[4].bias.data = model[4].bias.data.double()
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))["shard"]
            if config.get("hsdp") else init_device_mesh("cpu", (world_size,)))
    layers = (model[0], model[2], model[4])
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=config.get("reshard", True))
    fully_shard(model, mesh=mesh)
    seen: list[list[torch.Tensor]] = []

    def capture(layer: nn.Module, args: Any) -> None:
        # after FSDP2's pre-forward hook (prepended): the unsharded weights of this forward
        seen[-1].append(torch.cat([p.detach().reshape(-1).clone() for p in layer.parameters()]))

    for layer in layers:
        layer.register_forward_pre_hook(capture)
    rs: Optional[CompressedReduceScatter] = None
    ag: Optional[QuantizedAllGather] = None
    if "rs" in config:
        rs = CompressedReduceScatter(model, config["node_size"], config["rs"], timeout=timedelta(seconds=60))
    if config.get("ag"):
        ag = QuantizedAllGather(model, config["node_size"], timeout=timedelta(seconds=60),
                                groups=None if rs is None else rs.groups)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    weights, masters, grads, wan, dense, lan = [], [], [], [], [], []
    for step in range(steps):
        seen.append([])
        masters.append([p.to_local().detach().clone() for p in model.parameters()])  # type: ignore[attr-defined]
        x, y = _batch(rank, step, False)
        loss = ((model(x) - y) ** 2).sum() * 2.0**-4
        loss.backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        weights.append(seen[-1])
        if ag is not None:
            wan.append(ag.last_step_bytes())
            dense.append(ag.ledger.dense_bytes_per_step())
            lan.append(ag.ledger.take_channel("lan"))
    mean = None if ag is None else ag.bytes_per_step()
    seen.append([])
    with torch.no_grad():  # an evaluation forward: quantized too, not counted in a training step's bytes
        model(x)
    return {"weights": weights, "masters": masters, "grads": grads, "wan": wan, "dense": dense, "lan": lan,
            "mean": mean, "eval_weights": seen[-1],
            "after_eval": None if ag is None else (ag.last_step_bytes(), ag.bytes_per_step()),
            "full": _flat(model.parameters(), gather=True)}


class Losses(Callback):
    """The training loss of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


class FastRegressor(ShardedRegressor):
    """The sharded regressor with a larger step, so that a few epochs lower its loss clearly."""

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.03)


def fit_config(world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """A Trainer fit of :class:`FastRegressor` under ``ShardedGradCompStrategy(**config["strategy"])``."""
    losses = Losses()
    record = Shards()
    try:
        out = fit(world_size, ShardedGradCompStrategy(**config["strategy"]), FastRegressor(),
                  config.get("steps", 4), record=record, extra=[losses], gather=True)
    except (ValueError, RuntimeError) as error:  # bad input: refused on every rank alike, before step 0
        return {"error": str(error), "steps_done": len(record.shards)}
    return dict(out, losses=losses.losses)


def run_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for config in configs:
        if "strategy" in config:  # the Trainer makes the process group (or finds it made)
            out.append(fit_config(world_size, config))
            continue
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        try:
            out.append(train(rank, world_size, config))
        except ValueError as error:  # bad input: refused on every rank alike, before step 0
            out.append({"error": str(error)})
    if dist.is_initialized():
        dist.destroy_process_group()
    return out
