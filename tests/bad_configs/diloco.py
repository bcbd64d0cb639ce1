"""Invalid DiLoCoStrategy and ShardedDiLoCoStrategy configurations (and the two checks that need the world size or the
model)."""

import torch

from lightning_gradcomp.outer import DiLoCoStrategy, ShardedDiLoCoStrategy
from lightning_gradcomp.outer.fragments import strided_fragments
from tests.bad_configs import BadConfig

_TWO_LAYERS = [n for n, _ in torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).named_parameters()]

# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig("diloco-sync-every-zero", lambda: DiLoCoStrategy(sync_every=0), "sync_every", "0"),
    BadConfig("diloco-sites-do-not-divide", lambda: DiLoCoStrategy(site_size=3).make_layout(4), "site_size", "3"),
    BadConfig("diloco-site-sizes-sum", lambda: DiLoCoStrategy(site_sizes=[2, 1]).make_layout(4), "site_sizes", "[2, 1]"),
    BadConfig("diloco-fragments-zero", lambda: DiLoCoStrategy(fragments=0), "fragments", "0"),
    BadConfig("diloco-fragments-over-layers", lambda: strided_fragments(_TWO_LAYERS, 3), "fragments", "3"),
    BadConfig("diloco-outer-optimizer-module", lambda: DiLoCoStrategy(outer_optimizer="torch.nn.Linear"),
              "outer_optimizer", "'torch.nn.Linear'"),
    BadConfig("diloco-outer-optimizer-instance", lambda: DiLoCoStrategy(outer_optimizer=3), "outer_optimizer", "3"),  # type: ignore[arg-type]
    BadConfig("diloco-mixing-above-one", lambda: DiLoCoStrategy(mixing=1.5), "mixing", "1.5"),
    BadConfig("diloco-mixing-negative", lambda: DiLoCoStrategy(mixing=-0.1), "mixing", "-0.1"),
    BadConfig("diloco-sync-delay-at-h", lambda: DiLoCoStrategy(sync_every=5, sync_delay=5), "sync_delay", "5"),
    BadConfig("diloco-sync-delay-negative", lambda: DiLoCoStrategy(sync_delay=-1), "sync_delay", "-1"),
    BadConfig("diloco-outer-lr-zero", lambda: DiLoCoStrategy(outer_lr=0.0), "outer_lr", "0.0"),
    BadConfig("diloco-outer-state-device", lambda: DiLoCoStrategy(outer_state_device="cuda"), "outer_state_device", "'cuda'"),  # type: ignore[arg-type]
    BadConfig("diloco-error-decay-above-one", lambda: DiLoCoStrategy(error_decay=1.5), "error_decay", "1.5"),
    BadConfig("diloco-compressor-unknown", lambda: DiLoCoStrategy(compressor="int4"), "`compressor`", "'int4'"),
    # the per-step compressor is named as the argument given, not as GradCompStrategy's `compressor`
    BadConfig("diloco-inner-compressor-unknown", lambda: DiLoCoStrategy(inner_compressor="tern"), "`inner_compressor`",
              "'tern'"),
    BadConfig("diloco-inner-compressor-type", lambda: DiLoCoStrategy(inner_compressor=3), "`inner_compressor`", "3"),  # type: ignore[arg-type]
    # the outer optimizer is built at the first round: its arguments are checked at construction
    BadConfig("diloco-outer-kwargs-unknown", lambda: DiLoCoStrategy(outer_optimizer="adam", outer_kwargs={"betaz": (0.9, 0.95)}),
              "outer_kwargs", "'betaz'"),
    BadConfig("diloco-outer-kwargs-sgd-unknown", lambda: DiLoCoStrategy(outer_kwargs={"betas": (0.9, 0.95)}),
              "outer_kwargs", "'betas'"),
    BadConfig("diloco-outer-kwargs-value", lambda: DiLoCoStrategy(outer_optimizer="adam", outer_kwargs={"betas": (1.5, 0.95)}),
              "outer_kwargs", "1.5"),
    BadConfig("diloco-outer-kwargs-lr", lambda: DiLoCoStrategy(outer_kwargs={"lr": 0.1}), "outer_lr", "0.1"),
]
BAD_CONFIGS.append(
    BadConfig("diloco-hierarchy", lambda: DiLoCoStrategy(hierarchy="node"), "hierarchy", "'node'"),
)
# the same outer options over FSDP2 sites (one validation for both strategies), and the sites' own option
BAD_CONFIGS += [
    BadConfig("sharded-diloco-sync-every-zero", lambda: ShardedDiLoCoStrategy(sync_every=0), "sync_every", "0"),
    BadConfig("sharded-diloco-sync-delay-at-h", lambda: ShardedDiLoCoStrategy(sync_every=3, sync_delay=3),
              "sync_delay", "3"),
    BadConfig("sharded-diloco-compressor-unknown", lambda: ShardedDiLoCoStrategy(compressor="int4"), "compressor", "'int4'"),
    BadConfig("sharded-diloco-shard-size-zero", lambda: ShardedDiLoCoStrategy(shard_size=0), "shard_size", "0"),
]
