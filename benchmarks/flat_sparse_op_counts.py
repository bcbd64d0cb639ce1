"""Ops, host reads and data-dependent ops of one step of Gradient Dropping and AdaComp over a group of layers:
the per-layer loop (``Compressor``'s ``*_flat`` defaults) against the batched overrides, at 8 and 32 layers.

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
from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.segments import Segments

RANKS = 3


def step_counts(make: Callable[[], Compressor], layers: int, loop: bool) -> tuple[int, int, int]:
    """(ops, host reads, data-dependent ops) of one step over ``layers`` small layers of mixed shapes."""
    shapes = [(12, 10), (7,), (3, 2, 2, 2)] * (layers // 3) + [(1,)] * (layers % 3)
    seg = Segments([f"l{i}.weight" for i in range(layers)], [torch.Size(s) for s in shapes])
    comp = make()
    comp.setup(0, RANKS, torch.device("cpu"))
    grad = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))
    impl = Compressor if loop else type(comp)

    def step() -> None:
        impl.observe_gradient_flat(comp, grad, seg)
        packet = impl.compress_flat(comp, grad * 2, seg)
        impl.sent_flat(comp, grad * 2, packet)
        received = [packet.with_payload(packet.payload, packet.layer_nbytes)] * RANKS
        impl.decompress_flat_mean_into(comp, received, torch.empty(seg.total))

    step()
    with count_ops() as counted:
        step()
    return counted.total, counted.host_reads, counted.data_dependent


def step_ms(make: Callable[[], Compressor], loop: bool) -> float:
    """Best of 5 wall times (ms) of one step over 48 layers of mixed shapes, 1.5M elements."""
    shapes = [(256, 256), (256,), (64, 32, 3, 3), (64,), (1000, 100), (100,)] * 8
    seg = Segments([f"l{i}.weight" for i in range(len(shapes))], [torch.Size(s) for s in shapes])
    comp = make()
    comp.setup(0, RANKS, torch.device("cpu"))
    grad = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))
    out = torch.empty(seg.total)
    impl = Compressor if loop else type(comp)

    def step() -> None:
        impl.observe_gradient_flat(comp, grad, seg)
        packet = impl.compress_flat(comp, grad * 2, seg)
        impl.sent_flat(comp, grad * 2, packet)
        impl.decompress_flat_mean_into(comp, [packet.with_payload(packet.payload, packet.layer_nbytes)] * RANKS, out)

    step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main() -> None:
    cases: list[tuple[str, Callable[[], Compressor]]] = [
        ("graddrop torch", lambda: GradientDropping(backend="torch", sample="strided")),
        ("graddrop fused", lambda: GradientDropping(backend="fused", sample="strided")),
        ("adacomp torch", lambda: AdaComp(backend="torch")),
        ("adacomp fused", lambda: AdaComp(backend="fused")),
    ]
    print("| compressor | loop, 8 layers | loop, 32 layers | batched, 8 layers | batched, 32 layers |")
    print("|---|---|---|---|---|")
    for name, make in cases:
        cells = [step_counts(make, n, loop) for loop in (True, False) for n in (8, 32)]
        print(f"| {name} | " + " | ".join("%d ops, %d reads, %d data-dep." % c for c in cells) + " |")
    if "--time" in sys.argv:
        torch.set_num_threads(1)
        for name, make in cases:
            print(f"{name}: loop {step_ms(make, True):.1f} ms, batched {step_ms(make, False):.1f} ms per step")


if __name__ == "__main__":
    main()
