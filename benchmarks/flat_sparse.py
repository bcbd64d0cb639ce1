"""TopK and DGC on one group of layers: the group code's two selections, a partial selection per layer (``"loop"``,
a CPU's default) against the batched ops (``"batched"``, a GPU's without Triton), for compress + sent + the mean of
3 ranks' gathered payloads.

Per compressor and number of layers (pairs of a 256x256 weight and a 256 bias): aten ops, host reads and
data-dependent ops (deterministic), and the median wall time of a few repetitions on this machine's CPU (one torch
thread; times depend on the machine and its load, counts do not).

    python benchmarks/flat_sparse.py [--layers 8 32 128] [--repeat 3]
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp.compressors import DGC, TopK
from lightning_gradcomp.flat import Segments

RANKS = 3
COMPRESSORS: dict[str, Callable[[], TopK]] = {"topk(0.01)": lambda: TopK(0.01), "dgc(0.001)": lambda: DGC(0.001)}


def _step(c: TopK, seg: Segments, xs: list[torch.Tensor]) -> None:
    packets = [c.compress_flat(x, seg) for x in xs]
    c.sent_flat(xs[0], packets[0])
    out = torch.empty(seg.total)
    c.decompress_flat_mean_into([packets[0].with_payload(p.payload, p.layer_nbytes) for p in packets], out)


def measure(make: Callable[[], TopK], layers: int, selection: str, repeat: int) -> tuple[int, int, int, float]:
    """(ops, host reads, data-dependent ops, median ms) of one step after a warm-up one."""
    seg = Segments([f"l{i}" for i in range(layers)], [torch.Size(s) for s in [(256, 256), (256,)] * (layers // 2)])
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(seg.total, generator=gen) for _ in range(RANKS)]
    c = make()
    c.setup(0, RANKS, torch.device("cpu"))
    c.selection = selection  # type: ignore[assignment]
    _step(c, seg, xs)
    with count_ops() as counted:
        _step(c, seg, xs)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _step(c, seg, xs)
        times.append(1000 * (time.perf_counter() - start))
    return counted.total, counted.host_reads, counted.data_dependent, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| compressor | layers | loop ops | loop host reads | loop data-dep. | loop ms | batched ops "
          "| batched host reads | batched data-dep. | batched ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, make in COMPRESSORS.items():
        for layers in args.layers:
            loop, batched = (measure(make, layers, selection, args.repeat) for selection in ("loop", "batched"))
            cells = [*loop[:3], f"{loop[3]:.1f}", *batched[:3], f"{batched[3]:.1f}"]
            print(f"| {name} | {layers} | " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
