"""The dense exchange inside a site: which torch.distributed collectives move a bucket's shares fastest (issue 18).

The hierarchical hook (:mod:`lightning_gradcomp.sites.hierarchy`) needs a reduce that leaves each of the ``k`` ranks of
a site with the sum of its own share of the bucket, and the inverse gather. Measured side by side, on ``--ranks``
Gloo processes on this host (loopback) or under ``gradcomp_lab.emulate`` (veths)::

    python benchmarks/site_collectives.py --ranks 2 --numel 2900000

Rows: two all-reduces of the whole bucket (the first version of the hierarchy), torch's reduce-scatter and
all-gather of equal chunks, and the all-to-alls the hook uses (``comm.reduce_to_owners_``, ``comm.gather_from_owners``).
Median of ``--repeats`` after 2 warm-up, a repeat's time the max over ranks.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor(times[2:], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist()) * 1e3


def _rank(rank: int, world: int, numel: int, repeats: int, port: int) -> None:
    from lightning_gradcomp.exchange import comm

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bucket = torch.randn(numel)
    chunk = numel // world
    splits = [chunk] * (world - 1) + [numel - chunk * (world - 1)]
    mine, gathered = torch.empty(splits[rank]), torch.empty(numel)
    copies = torch.empty(world * splits[rank])
    equal = bucket[: chunk * world]
    rows = [
        ("all_reduce (whole bucket)", _median_ms(lambda: dist.all_reduce(bucket), repeats)),
        ("reduce_scatter_single (equal chunks)", _median_ms(lambda: dist.reduce_scatter_single(mine[:chunk], equal), repeats)),
        ("all_gather_single (equal chunks)", _median_ms(lambda: dist.all_gather_single(equal.clone(), mine[:chunk]), repeats)),
        ("comm.reduce_to_owners_ (all-to-all + sum)",
         _median_ms(lambda: comm.reduce_to_owners_(mine, bucket, splits, None, copies), repeats)),
        ("comm.gather_from_owners (all-to-all)",
         _median_ms(lambda: comm.gather_from_owners(gathered, mine, splits, None, copies).wait(), repeats)),
    ]
    if rank == 0:
        base = rows[0][1]
        print(f"\n# command: python {' '.join(sys.argv)}")
        print(f"# {world} Gloo ranks, {numel:,} fp32 elements ({4 * numel / 1e6:.1f} MB); median of {repeats}; "
              f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, load {os.getloadavg()}")
        print("| collective | ms | / all_reduce |")
        print("|---|---|---|")
        for name, ms in rows:
            print(f"| {name} | {ms:.2f} | {ms / base:.2f} |")
        print(f"| two all_reduces (the first hierarchy) | {2 * base:.2f} | 2.00 |")
        print(f"| reduce_to_owners_ + gather_from_owners (the hook) | {rows[3][1] + rows[4][1]:.2f} | "
              f"{(rows[3][1] + rows[4][1]) / base:.2f} |")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--numel", type=int, default=2_900_000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--port", type=int, default=29541)
    args = p.parse_args()
    if "RANK" in os.environ:  # launched per rank (torchrun, gradcomp_lab.emulate)
        _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.numel, args.repeats, args.port)
    else:
        mp.spawn(_rank, args=(args.ranks, args.numel, args.repeats, args.port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
