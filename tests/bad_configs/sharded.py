"""Invalid ShardedGradCompStrategy and ShardedGradCompFabricStrategy configurations (constructor)."""

from lightning_gradcomp import ShardedGradCompStrategy
from lightning_gradcomp.strategies.fabric import ShardedGradCompFabricStrategy
from tests.bad_configs import BadConfig

BAD_CONFIGS = [
    # the DDP engine's site options: a replica of `shard_size` ranks is the sharded engine's site
    BadConfig("sharded-site-size", lambda: ShardedGradCompStrategy(site_size=2), "site_size", "2"),
    BadConfig("sharded-site-sizes", lambda: ShardedGradCompStrategy(site_sizes=[2, 2]), "site_sizes", "[2, 2]"),
    BadConfig("sharded-hierarchy", lambda: ShardedGradCompStrategy(hierarchy="node"), "hierarchy", "'node'"),
    BadConfig("sharded-misspelt-option", lambda: ShardedGradCompStrategy(shardsize=2), "shardsize", "2"),
    BadConfig("fabric-sharded-site-size", lambda: ShardedGradCompFabricStrategy(site_size=2), "site_size", "2"),
    BadConfig("fabric-sharded-misspelt-option", lambda: ShardedGradCompFabricStrategy(compresor="terngrad"),
              "compresor", "'terngrad'"),
]
