"""PowerSGD's three batched products, as ``torch.bmm`` spells them against the forms the compressor uses.

``M Q``, ``M^T P`` and ``P Q^T`` on a stack of same-shape matrices (``compressors/powersgd.py``: :func:`project`,
:func:`project_back`, :func:`outer`). The forms are the same products (transposes of each other; at rank 1 the outer
product is one multiply per element); which one torch runs fastest depends on the backend. Median of ``--repeats``,
side by side in one run::

    python benchmarks/powersgd_products.py                          # CPU, one thread per rank as in the hook benchmarks
    python benchmarks/powersgd_products.py --device cuda --threads 16
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.scatter_ops import add_timing_args, median_ms, print_header, timing_device

from lightning_gradcomp.compressors.powersgd import outer, project, project_back

#: (stack, rows, columns): the MLP of benchmarks/hierarchy.py (two 1024 x 1024 layers, one 1024 x 784) and a
#: GPT block's classes
SHAPES = [(2, 1024, 1024), (1, 1024, 784), (4, 512, 512), (8, 128, 128)]

Timed = Callable[[], torch.Tensor]


def products(mat: torch.Tensor, q: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> list[tuple[str, Timed, Timed]]:
    """(name, ``bmm`` as written, the form used) for each product on one stack."""
    return [
        ("M Q", lambda: torch.bmm(mat, q), lambda: project(mat, q)),
        ("M^T P", lambda: torch.bmm(mat.mT, p), lambda: project_back(mat, p)),
        ("P Q^T", lambda: torch.bmm(p, q.mT, out=out), lambda: outer(p, q, out=out)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16])
    add_timing_args(p)
    args = p.parse_args()
    device = timing_device(args)
    gen = torch.Generator().manual_seed(0)
    print_header(device, f"median of {args.repeats}")
    print("| product | stack | rank | bmm as written (ms) | form used (ms) | bmm / used | largest difference |")
    print("|---|---|---|---|---|---|---|")
    total_bmm = total_used = 0.0
    for b, n, m in SHAPES:
        for r in args.ranks:
            mat = torch.randn(b, n, m, generator=gen).to(device)
            q = torch.randn(b, m, r, generator=gen).to(device)
            pf = torch.randn(b, n, r, generator=gen).to(device)
            for name, written, used in products(mat, q, pf, torch.empty(b, n, m, device=device)):
                diff = (written().clone() - used()).abs().max().item()
                t_bmm, t_used = median_ms(written, args.repeats, device), median_ms(used, args.repeats, device)
                total_bmm, total_used = total_bmm + t_bmm, total_used + t_used
                print(f"| {name} | {b} x {n} x {m} | {r} | {t_bmm:.3f} | {t_used:.3f} | {t_bmm / t_used:.1f}x | {diff:.1e} |")
    print(f"| all rows | | | {total_bmm:.2f} | {total_used:.2f} | {total_bmm / total_used:.1f}x | |")


if __name__ == "__main__":
    main()
