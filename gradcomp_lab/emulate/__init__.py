"""An emulated multi-machine cluster on one Linux host (network namespaces, veth pairs, bridges, ``tc tbf``).

``python -m gradcomp_lab.emulate --nproc 4 --bandwidth 1gbit -- python train.py`` runs four ranks, each in
its own namespace behind a 1 Gbit/s link, and deletes everything it created afterwards. Needs root and iproute2.
"""

from gradcomp_lab.emulate.cluster import (
    Cluster,
    EmulationUnavailable,
    check_available,
    cleanup_stale,
    list_namespaces,
)
from gradcomp_lab.emulate.launcher import RankFailed, launch, rank_env, run_on_cluster

__all__ = [
    "Cluster",
    "EmulationUnavailable",
    "RankFailed",
    "check_available",
    "cleanup_stale",
    "launch",
    "list_namespaces",
    "rank_env",
    "run_on_cluster",
]
