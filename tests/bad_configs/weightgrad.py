"""Invalid WeightGradStrategy configurations."""

from lightning_gradcomp.weightgrad import WeightGradStrategy
from tests.bad_configs import BadConfig

# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig("weightgrad-site-sizes-empty", lambda: WeightGradStrategy(site_sizes=[]), "site_sizes", "[]"),
    BadConfig("weightgrad-site-sizes-int", lambda: WeightGradStrategy(site_sizes=2), "site_sizes", "2"),  # type: ignore[arg-type]
    BadConfig("weightgrad-flush-str", lambda: WeightGradStrategy(flush_at_bound="true"), "flush_at_bound", "'true'"),  # type: ignore[arg-type]
    BadConfig(
        "weightgrad-single-rank-str",
        lambda: WeightGradStrategy(allow_single_rank_sites="no"),  # type: ignore[arg-type]
        "allow_single_rank_sites",
        "'no'",
    ),
]
