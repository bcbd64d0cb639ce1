"""Invalid WeightGradStrategy configurations."""

from lightning_gradcomp.weightgrad import WeightGradStrategy
from tests.bad_configs import BadConfig

BAD_CONFIGS = [
    BadConfig("weightgrad-site-sizes-empty", lambda: WeightGradStrategy(site_sizes=[]), "site_sizes", "[]"),
    BadConfig("weightgrad-site-sizes-int", lambda: WeightGradStrategy(site_sizes=2), "site_sizes", "2"),
    BadConfig("weightgrad-flush-str", lambda: WeightGradStrategy(flush_at_bound="true"), "flush_at_bound", "'true'"),
    BadConfig(
        "weightgrad-single-rank-str",
        lambda: WeightGradStrategy(allow_single_rank_sites="no"),
        "allow_single_rank_sites",
        "'no'",
    ),
]
