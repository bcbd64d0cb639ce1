"""Writing values to 1-D positions: ``index_copy_`` / ``index_add_`` against ``scatter_`` / ``scatter_add_``.

The batched pipeline writes a group's results back to their places in the bucket (PowerSGD's approximations, DeMo's
chunks, the sparse decoders' values, padding). Both spellings give the same values for distinct positions; this
prints what each costs here, median of ``--repeats``, side by side in one run::

    python benchmarks/scatter_ops.py                          # CPU, one thread per rank as in the hook benchmarks
    python benchmarks/scatter_ops.py --device cuda --threads 16
"""

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch


def positions(numel: int, layers: int, generator: torch.Generator) -> torch.Tensor:
    """Every position of a bucket of ``numel`` once, as a batched compressor visits them: ``layers`` contiguous
    runs in a shuffled order (classes of layers gathered out of bucket order)."""
    cuts = torch.linspace(0, numel, layers + 1).long().tolist()
    order = torch.randperm(layers, generator=generator).tolist()
    return torch.cat([torch.arange(cuts[i], cuts[i + 1]) for i in order])


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    """The options every side-by-side op benchmark takes: repeats, CPU threads, device."""
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")


def timing_device(args: argparse.Namespace) -> torch.device:
    """Apply ``--threads`` and return ``--device``."""
    torch.set_num_threads(args.threads)
    return torch.device(args.device)


def print_header(device: torch.device, detail: str) -> None:
    """The command and machine lines above a benchmark's table."""
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# machine: {platform.node()}, {torch.get_num_threads()} thread(s), device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, torch {torch.__version__}; "
          f"{detail}")


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=3_000_000, help="bucket elements (the MLP of benchmarks/hierarchy.py: 2.9 M)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sparse", type=float, default=0.1, help="share of positions written by the sparse rows")
    add_timing_args(p)
    args = p.parse_args()
    device = timing_device(args)
    gen = torch.Generator().manual_seed(0)
    index = positions(args.numel, args.layers, gen).to(device)
    sparse = torch.randperm(args.numel, generator=gen)[: int(args.sparse * args.numel)].to(device)
    values = torch.randn(args.numel, generator=gen).to(device)
    few = values[: sparse.numel()]
    out = torch.zeros(args.numel, device=device)
    rows = [
        ("all positions, copy", lambda: out.index_copy_(0, index, values), lambda: out.scatter_(0, index, values)),
        ("sparse positions, copy", lambda: out.index_copy_(0, sparse, few), lambda: out.scatter_(0, sparse, few)),
        ("sparse positions, add", lambda: out.index_add_(0, sparse, few), lambda: out.scatter_add_(0, sparse, few)),
    ]
    for _, a, b in rows:  # the claim the library relies on: the same values
        a_out = out.clone()
        out.zero_()
        a()
        a_out.copy_(out)
        out.zero_()
        b()
        assert torch.equal(a_out, out)
    print_header(device, f"{args.numel:,} fp32 elements, median of {args.repeats}")
    print("| write | index_copy_ / index_add_ (ms) | scatter_ / scatter_add_ (ms) | index_ / scatter_ |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        ta, tb = median_ms(a, args.repeats, device), median_ms(b, args.repeats, device)
        print(f"| {name} | {ta:.2f} | {tb:.2f} | {ta / tb:.1f}x |")


if __name__ == "__main__":
    main()
