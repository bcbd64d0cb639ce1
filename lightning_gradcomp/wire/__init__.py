"""Wire formats: bit packing, ternary packing, sparse encodings.
"""

from lightning_gradcomp.wire.ternary import *  # noqa: F403  (the names of the module this package replaced)
