"""Ops, host reads and data-dependent ops of one step of the sparse compressors over a group of layers: their
per-layer oracle (``tests/oracles/``: the compressor written one layer at a time, looped over the group) against the
group code, at 8 and 32 layers.

One step: ``observe_gradient_flat``, ``compress_flat``, ``sent_flat`` and ``decompress_flat_mean_into`` of 3 ranks'
packets, counted by :func:`gradcomp_lab.opcount.count_ops` after a first (warm-up) step. Counts, not timings:
deterministic on any machine. Usage: ``PYTHONPATH=. python benchmarks/flat_sparse_op_counts.py``; with ``--time``,
also the best of 5 wall times of one step over 48 layers (1.5M elements, one thread): machine-dependent, not for
tests.
"""

import sys
import time
from collections.abc import Callable

import torch

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp.compressors import DGC, AdaComp, GradientDropping, TopK
from lightning_gradcomp.compressors.base import Compressor, GradientObserver
from lightning_gradcomp.flat import Segments
from tests.oracles.adacomp import LayerAdaComp
from tests.oracles.graddrop import LayerGradientDropping
from tests.oracles.topk import LayerDGC, LayerTopK

RANKS = 3


def step_counts(make: Callable[[], Compressor], layers: int) -> tuple[int, int, int]:
    """(ops, host reads, data-dependent ops) of one step over ``layers`` small layers of mixed shapes."""
    shapes = [(12, 10), (7,), (3, 2, 2, 2)] * (layers // 3) + [(1,)] * (layers % 3)
    seg = Segments([f"l{i}.weight" for i in range(layers)], [torch.Size(s) for s in shapes])
    comp = make()
    comp.setup(0, RANKS, torch.device("cpu"))
    grad = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        if isinstance(comp, GradientObserver):
            comp.observe_gradient_flat(grad, seg)
        packet = comp.compress_flat(grad * 2, seg)
        comp.sent_flat(grad * 2, packet)
        received = [packet.with_payload(packet.payload, packet.layer_nbytes)] * RANKS
        comp.decompress_flat_mean_into(received, torch.empty(seg.total))

    step()
    with count_ops() as counted:
        step()
    return counted.total, counted.host_reads, counted.data_dependent


def step_ms(make: Callable[[], Compressor]) -> float:
    """Best of 5 wall times (ms) of one step over 48 layers of mixed shapes, 1.5M elements."""
    shapes = [(256, 256), (256,), (64, 32, 3, 3), (64,), (1000, 100), (100,)] * 8
    seg = Segments([f"l{i}.weight" for i in range(len(shapes))], [torch.Size(s) for s in shapes])
    comp = make()
    comp.setup(0, RANKS, torch.device("cpu"))
    grad = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))
    out = torch.empty(seg.total)

    def step() -> None:
        if isinstance(comp, GradientObserver):
            comp.observe_gradient_flat(grad, seg)
        packet = comp.compress_flat(grad * 2, seg)
        comp.sent_flat(grad * 2, packet)
        comp.decompress_flat_mean_into([packet.with_payload(packet.payload, packet.layer_nbytes)] * RANKS, out)

    step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


#: (name, the group code, its per-layer oracle)
CASES: list[tuple[str, Callable[[], Compressor], Callable[[], Compressor]]] = [
    ("graddrop torch", lambda: GradientDropping(backend="torch", sample="strided"),
     lambda: LayerGradientDropping(backend="torch", sample="strided")),
    ("graddrop fused", lambda: GradientDropping(backend="fused", sample="strided"),
     lambda: LayerGradientDropping(backend="fused", sample="strided")),
    ("adacomp torch", lambda: AdaComp(backend="torch"), lambda: LayerAdaComp(backend="torch")),
    ("adacomp fused", lambda: AdaComp(backend="fused"), lambda: LayerAdaComp(backend="fused")),
    ("topk (CPU: a selection per layer)", TopK, LayerTopK),
    ("topk (batched selection, as on a GPU)", lambda: _batched(TopK()), LayerTopK),
    ("dgc (CPU: a selection per layer)", DGC, LayerDGC),
    ("dgc (batched selection, as on a GPU)", lambda: _batched(DGC()), LayerDGC),
]


def _batched(compressor: TopK) -> TopK:
    """``compressor`` with the selection a GPU runs without Triton (segmented sorts: a fixed number of ops)."""
    compressor.selection = "batched"
    return compressor


def main() -> None:
    print("| compressor | oracle, 8 layers | oracle, 32 layers | group code, 8 layers | group code, 32 layers |")
    print("|---|---|---|---|---|")
    for name, group, oracle in CASES:
        cells = [step_counts(make, n) for make in (oracle, group) for n in (8, 32)]
        print(f"| {name} | " + " | ".join("%d ops, %d reads, %d data-dep." % c for c in cells) + " |")
    if "--time" in sys.argv:
        torch.set_num_threads(1)
        for name, group, oracle in CASES:
            print(f"{name}: oracle {step_ms(oracle):.1f} ms, group code {step_ms(group):.1f} ms per step")


if __name__ == "__main__":
    main()
