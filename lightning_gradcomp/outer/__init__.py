"""Outer synchronization (DiLoCo, Streaming DiLoCo): local inner steps per site, compressed outer rounds between.

* :mod:`~lightning_gradcomp.outer.engine`: anchor, pseudo-gradients, outer optimizer, fragment schedule;
* :mod:`~lightning_gradcomp.outer.exchange`: pseudo-gradients through the DDP hook's pipeline between site leaders;
* :mod:`~lightning_gradcomp.outer.fragments`: strided fragments and their staggered sync steps;
* :mod:`~lightning_gradcomp.outer.strategy`: ``DiLoCoStrategy`` (``strategy="diloco"``, ``"streaming_diloco"``);
* :mod:`~lightning_gradcomp.outer.sharded`: ``ShardedDiLoCoStrategy`` (``strategy="sharded_diloco"``,
  ``"sharded_streaming_diloco"``), the same rounds over FSDP2 sites, each rank sending its own shard.
"""

from lightning_gradcomp._deprecated import moved_names as _moved_names
from lightning_gradcomp.outer.engine import OuterSync
from lightning_gradcomp.outer.sharded import ShardedDiLoCoStrategy
from lightning_gradcomp.outer.strategy import DiLoCoStrategy

__all__ = ["DiLoCoStrategy", "OuterSync", "ShardedDiLoCoStrategy"]

# a spelling of an earlier release, kept for one more with a DeprecationWarning (not in __all__)
__getattr__ = _moved_names(__name__, {"register": "lightning_gradcomp.outer.strategy:register"})
