"""WeightGrad (Akter & Adnan, KDD 2020): two-level LAN/WAN training with ternary gradients and weights."""

from lightning_gradcomp._deprecated import moved_names as _moved_names
from lightning_gradcomp.weightgrad.quantize import decode, encode
from lightning_gradcomp.weightgrad.significance import SignificanceFilter
from lightning_gradcomp.weightgrad.strategy import GatheredFP32, WeightGradStrategy
from lightning_gradcomp.weightgrad.synchronizer import GradientSynchronizer

__all__ = [
    "GatheredFP32",
    "GradientSynchronizer",
    "SignificanceFilter",
    "WeightGradStrategy",
    "decode",
    "encode",
]

# spellings of an earlier release, kept for one more with a DeprecationWarning (not in __all__): the sites serve
# every site strategy, not WeightGrad only
__getattr__ = _moved_names(__name__, {
    "SiteGroups": "lightning_gradcomp.sites.layout:SiteGroups",
    "SiteLayout": "lightning_gradcomp.sites.layout:SiteLayout",
    "new_site_groups": "lightning_gradcomp.sites.layout:new_site_groups",
    "register": "lightning_gradcomp.weightgrad.strategy:register",
    "site_layout": "lightning_gradcomp.sites.layout:site_layout",
})
