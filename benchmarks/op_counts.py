"""Ops and host reads the gradcomp hook dispatches per training step beyond plain DDP (issue 17's counts).

For every registered compressor (and Gradient Dropping's and AdaComp's torch backends, the path CUDA runs: the
fused kernels are CPU-only), one step at world size 1 of a residual MLP with 40 and with 160 parameter
tensors is counted with :func:`gradcomp_lab.opcount.hook_op_overhead` (ops with the hook minus ops of the
same step of plain DDP). Counts are deterministic: a hook whose count grows with the number of tensors runs a
per-parameter loop, which on a GPU costs a kernel launch per op and a stream drain per host read.

    python benchmarks/op_counts.py [--out benchmarks/results/op_counts/before.json]
"""

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_gradcomp import registry
from lightning_gradcomp.compressors.adacomp import AdaComp
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.topk import TopK
from gradcomp_lab.opcount import hook_op_overhead

SIZES = (40, 160)


def _gpu_path(factory: Callable[[], Compressor]) -> Callable[[], Compressor]:
    """``factory`` with the compressor taking, on CPU too, the group path a GPU runs (top-k's and DGC's batched
    selection instead of a CPU's partial selection per layer)."""

    def make() -> Compressor:
        compressor = factory()
        if isinstance(compressor, TopK):
            compressor.selection = "batched"
        return compressor

    return make


def compressors() -> dict[str, Callable[[], Compressor]]:
    """Registry names, plus the torch backends of the compressors whose default on CPU is a fused kernel; each
    counted on the path a GPU runs."""
    found: dict[str, Callable[[], Compressor]] = {
        n: _gpu_path(registry.COMPRESSORS[n][0]) for n in registry.compressor_names()
    }
    found["graddrop[torch]"] = _gpu_path(lambda: GradientDropping(backend="torch"))
    found["adacomp[torch]"] = _gpu_path(lambda: AdaComp(backend="torch"))
    return found


def measure(names: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """name -> tensors -> {extra_ops, host_reads, data_dependent}."""
    table: dict[str, dict[str, dict[str, int]]] = {}
    factories = compressors()
    for name in names:
        table[name] = {}
        for tensors in SIZES:
            counted = hook_op_overhead(factories[name], tensors)
            table[name][str(tensors)] = {
                "extra_ops": counted.total, "host_reads": counted.host_reads, "data_dependent": counted.data_dependent
            }
    return table


def markdown(table: dict[str, dict[str, dict[str, int]]]) -> str:
    lo, hi = (str(s) for s in SIZES)
    lines = [
        f"| compressor | extra ops/step @{lo} | @{hi} | ops per tensor (slope) | host reads/step @{lo} | @{hi} "
        f"| data-dependent ops @{lo} | @{hi} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        slope = (row[hi]["extra_ops"] - row[lo]["extra_ops"]) / (SIZES[1] - SIZES[0])
        lines.append(
            f"| {name} | {row[lo]['extra_ops']} | {row[hi]['extra_ops']} | {slope:.1f} | {row[lo]['host_reads']} "
            f"| {row[hi]['host_reads']} | {row[lo]['data_dependent']} | {row[hi]['data_dependent']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the counts as JSON here")
    parser.add_argument("--compressors", nargs="*", default=None, help="default: all (see compressors())")
    args = parser.parse_args()
    names = args.compressors or list(compressors())
    command = "python " + " ".join(sys.argv)
    machine = f"{platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}"
    table = measure(names)
    print(f"command: `{command}`\n\nmachine: {machine}; world size 1, one step after 3 warm-up steps, "
          "residual MLP of Linear(32, 32) layers with bias\n")
    print(markdown(table))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "machine": machine, "sizes": list(SIZES), "counts": table},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
