"""Sites: their layout and process groups, and the hierarchical exchange between them.
"""

from lightning_gradcomp.sites.layout import *  # noqa: F403  (the names of the module this package replaced)
