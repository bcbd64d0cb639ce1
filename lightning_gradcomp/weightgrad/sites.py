"""Deprecated module: the sites serve every site strategy and live in :mod:`lightning_gradcomp.sites.layout`.

Its names still resolve here for one release, each with a ``DeprecationWarning`` naming the new place.
"""

from lightning_gradcomp._deprecated import moved_names as _moved_names

__getattr__ = _moved_names(__name__, {
    "SiteGroups": "lightning_gradcomp.sites.layout:SiteGroups",
    "SiteLayout": "lightning_gradcomp.sites.layout:SiteLayout",
    "check_site_options": "lightning_gradcomp.sites.layout:check_site_options",
    "new_site_groups": "lightning_gradcomp.sites.layout:new_site_groups",
    "site_layout": "lightning_gradcomp.sites.layout:site_layout",
    "start_sites_from_rank0": "lightning_gradcomp.sites.layout:start_sites_from_rank0",
})
