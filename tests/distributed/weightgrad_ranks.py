"""Rank bodies for the WeightGrad tests: several Trainer fits in one spawned world (spawns are expensive)."""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from lightning_gradcomp.weightgrad import WeightGradStrategy
from tests.distributed.lightning_ranks import TinyClassifier, random_loader


class AdamClassifier(TinyClassifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Recorder(Callback):
    """Parameters and WeightGrad statistics after every optimizer step (after the WAN step)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.stats: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.params.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))
        stats = getattr(trainer.strategy, "stats", {})
        self.stats.append({k: v.clone() for k, v in stats.items()})


def _fit(world_size: int, strategy: Any, model: pl.LightningModule, max_steps: int) -> Recorder:
    recorder = Recorder()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(model, random_loader())
    return recorder


def fit_configs(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run each config (``strategy``: ``"ddp"`` or WeightGrad kwargs; ``model``: ``"sgd"``/``"adam"``) in turn."""
    out = []
    for config in configs:
        kwargs = dict(config.get("weightgrad", {}))
        strategy: Any = config["strategy"] if "strategy" in config else WeightGradStrategy(**kwargs)
        lr, momentum = config.get("lr", 0.1), config.get("momentum", 0.9)
        model = AdamClassifier() if config.get("model") == "adam" else TinyClassifier(lr=lr, momentum=momentum)
        recorder = _fit(world_size, strategy, model, config.get("steps", 6))
        out.append({"params": recorder.params, "stats": recorder.stats})
    return out


def site_transport(rank: int, world_size: int) -> dict[str, Any]:
    """The site leaders' transport on 2 sites of 2: every collective of the exchange, and one WAN message exchange
    through the hook, with each site's data on its leader (its other rank holds garbage, which must not be read).
    Returns what every rank ends with, and the bytes its ledger counted."""
    import torch.distributed as dist

    from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook
    from lightning_gradcomp.exchange.ledger import Ledger
    from lightning_gradcomp.sites.transport import SiteLeadersTransport
    from lightning_gradcomp.outer.exchange import FlatBucket
    from lightning_gradcomp.sites.layout import new_site_groups, site_layout
    from lightning_gradcomp.weightgrad import WanMessage

    dist.init_process_group("gloo")
    groups = new_site_groups(site_layout(world_size, site_size=2), rank)
    ledger = Ledger()
    transport = SiteLeadersTransport(groups, ledger)
    site = groups.site

    def data(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        value = torch.arange(numel, dtype=torch.float32) * (1 + site) - 3 * site  # the site's own values
        return (value if groups.is_leader else torch.full((numel,), -1000.0)).to(dtype)

    out: dict[str, Any] = {"site": site, "world_size": transport.world_size, "rank": transport.rank}
    out["max"] = data(5)
    transport.max_(out["max"])
    out["sum"] = data(5)
    transport.sum(out["sum"]).wait()
    out["sizes"] = transport.gather_sizes(data(3, torch.int64))
    gathered = torch.empty(2 * 4)
    future, out["gather"] = transport.gather(data(4), gathered)
    future.wait()
    out["lan_collectives"] = ledger.take_channel("lan")

    # the WAN round's exchange: fp32 messages of different lengths (site 1's layer is sparse)
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(2, 3))]
    state = GradCompState(WanMessage(), {id(p): f"p{i}" for i, p in enumerate(params)}, world_size=2,
                          nonfinite="ignore", transport=transport)
    transport.ledger = state.ledger
    state.router.compressor.setup(site, 2, torch.device("cpu"))
    bucket = FlatBucket(0, params, torch.device("cpu"))
    own = torch.cat([torch.linspace(-1.0, 1.0, 6), torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 0.0]) if site else
                     torch.arange(6.0)])
    bucket.buffer().copy_(own)
    gradcomp_hook(state, bucket).wait()
    out["mean"] = bucket.buffer().clone()
    out["own"] = own
    out["message_bytes"] = state.ledger.bytes_of(["p0", "p1"], 0)
    out["wan_bytes"] = state.ledger.bytes_of(["p0", "p1"], 0, sizes=True)
    out["lan_round"] = state.ledger.take_channel("lan")
    dist.destroy_process_group()
    return out
