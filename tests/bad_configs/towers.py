"""Invalid TowerStrategy configurations (constructor)."""

from lightning_gradcomp.strategies.towers import TowerStrategy
from tests.bad_configs import BadConfig

# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig("towers-compressor-int", lambda: TowerStrategy(num_workers=2, compressor=3), "compressor", "3"),  # type: ignore[arg-type]
    BadConfig("towers-workers-zero", lambda: TowerStrategy(num_workers=0), "num_workers", "0"),
    # the towers are one flat group: a site option is named with the strategies that have sites, not a TypeError
    BadConfig("towers-site-size", lambda: TowerStrategy(site_size=2), "site_size", "2"),
    BadConfig("towers-unknown-option", lambda: TowerStrategy(num_workers=2, workers=4), "workers", "4"),
    BadConfig("towers-workers-missing", lambda: TowerStrategy(), "num_workers", "None"),
]
