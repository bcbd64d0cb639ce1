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
    # the compressed reduce-scatter across nodes
    BadConfig("sharded-node-size-alone", lambda: ShardedGradCompStrategy("int8", node_size=2), "node_size", "`node_size=2` without it"),
    BadConfig("sharded-node-size-zero", lambda: ShardedGradCompStrategy("int8", compress_across_nodes=True,
                                                                         node_size=0), "node_size", "got 0"),
    BadConfig("sharded-across-nodes-not-bool", lambda: ShardedGradCompStrategy("int8", compress_across_nodes=1),
              "compress_across_nodes", "True or False, but got 1"),
    BadConfig("sharded-across-nodes-sparse", lambda: ShardedGradCompStrategy("topk", compress_across_nodes=True),
              "compressor", "TopK (aggregation `gather`, sparse"),
    BadConfig("sharded-across-nodes-multi-round",
              lambda: ShardedGradCompStrategy("powersgd", compress_across_nodes=True), "compressor", "got PowerSGD"),
    BadConfig("fabric-sharded-node-size-alone", lambda: ShardedGradCompFabricStrategy(compressor="int8", node_size=2),
              "node_size", "`node_size=2` without it"),
    BadConfig("fabric-sharded-across-nodes-sparse",
              lambda: ShardedGradCompFabricStrategy(compressor="graddrop", compress_across_nodes=True), "compressor",
              "GradientDropping (aggregation `gather`, sparse"),
    # the quantized weight all-gather across nodes
    BadConfig("sharded-quantize-weights-alone", lambda: ShardedGradCompStrategy("int8", quantize_weights=True),
              "quantize_weights", "but got it without"),
    BadConfig("sharded-quantize-weights-not-bool",
              lambda: ShardedGradCompStrategy("int8", compress_across_nodes=True, quantize_weights="yes"),
              "quantize_weights", "True or False, but got 'yes'"),
    BadConfig("fabric-sharded-quantize-weights-alone",
              lambda: ShardedGradCompFabricStrategy(compressor="int8", quantize_weights=True), "quantize_weights",
              "but got it without"),
]
