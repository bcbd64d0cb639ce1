"""TernGrad on a group of layers: the default loop over layers against the batched flat path, on the CPU.

Run from the repository root (uses the cached compiled kernels; compiles them first if needed):

    python benchmarks/terngrad_flat.py

One "step" is what the hook does per group: ``flat_statistic``, ``compress_flat``, ``sent_flat`` and the decode of 2
ranks' packets (``decompress_flat_mean_into`` when gathered, ``decompress_flat`` of a summed payload when
all-reduced), with ``TernGrad(backend="fused")`` on one thread. Three ways: ``loop`` (the base class's loop over the
layers: the per-layer compiled kernels), ``batched`` (one call of each compiled kernel per group) and ``torch-ops``
(the batched path in torch ops, what CUDA runs; on a CPU slow per element: int64 hashing). Times are the best of 5
repeats of 5 steps; the op counts (aten ops dispatched per step, counted by ``gradcomp_lab.opcount``) do not depend
on the machine.
"""

import argparse
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from gradcomp_lab.opcount import count_ops

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.flat import Segments

GROUPS: dict[str, list[tuple[int, ...]]] = {
    "160 tensors, 0.17M elements (mlp width 32)": [(32, 32), (32,)] * 80,
    "8 tensors, 4.2M elements": [(1024, 1024), (1024,)] * 4,
}
WAYS: dict[str, tuple[bool, Callable[[], AbstractContextManager[None]]]] = {
    "loop": (True, nullcontext),
    "batched": (False, nullcontext),
    "torch-ops": (False, kernels.torch_ops),
}


def _step(comp: TernGrad, x: torch.Tensor, seg: Segments, looping: bool) -> None:
    owner = Compressor if looping else type(comp)
    shared = owner.flat_statistic(comp, x, seg)
    packet = owner.compress_flat(comp, x, seg, shared)
    owner.sent_flat(comp, x, packet)
    if comp.aggregation is Aggregation.SUM:
        owner.decompress_flat(comp, packet.with_payload(packet.payload * 2))
    else:
        peer = packet.with_payload(packet.payload.clone())
        owner.decompress_flat_mean_into(comp, [packet, peer], torch.empty(seg.total))


def measure(shapes: Sequence[tuple[int, ...]], variant: str, looping: bool,
            context: Callable[[], AbstractContextManager[None]], repeats: int = 5) -> tuple[float, int]:
    """(best ms per step, aten ops per step) of one way on one group."""
    seg = Segments([f"layer{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes])
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(0))
    comp = TernGrad(backend="fused")
    comp.setup(0, 8, torch.device("cpu"))
    view = next(v.compressor for v in comp.collectives(comp.world_size) if v.name == variant)
    assert isinstance(view, TernGrad)
    with context():
        _step(view, x, seg, looping)
        with count_ops() as counted:
            _step(view, x, seg, looping)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(5):
                _step(view, x, seg, looping)
            best = min(best, (time.perf_counter() - start) / 5)
    return best * 1e3, counted.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-torch-ops", action="store_true", help="skip the (slow on a CPU) torch-ops column")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not kernels.fused_available():
        raise SystemExit(f"the compiled kernels are unavailable here: {kernels._build.unavailable_reason}")
    ways = {k: v for k, v in WAYS.items() if not (args.no_torch_ops and k == "torch-ops")}
    print(f"torch {torch.__version__}, 1 thread; ms per step (best of 5x5), aten ops per step")
    print(f"{'group':44} {'variant':15} " + " ".join(f"{w + ' ms':>12} {w + ' ops':>14}" for w in ways))
    for label, shapes in GROUPS.items():
        for variant in ("allgather", "allreduce_int8"):
            cells = [measure(shapes, variant, looping, context) for looping, context in ways.values()]
            print(f"{label:44} {variant:15} " + " ".join(f"{ms:12.2f} {ops:14d}" for ms, ops in cells))


if __name__ == "__main__":
    main()
