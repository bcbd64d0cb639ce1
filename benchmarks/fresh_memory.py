"""What a fresh large CPU allocation costs against a reused buffer (why the hook keeps its buffers).

Copies a 147 MB float32 tensor (the 3x4096 MLP's gradient) into a freshly allocated tensor and into a reused
one, one thread, and prints the medians of 7 copies. Run it again with ``THP_MEM_ALLOC_ENABLE=1`` to see torch's
transparent-huge-page allocations::

    python benchmarks/fresh_memory.py
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/fresh_memory.py
"""

import os
import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    grad = torch.randn(36_800_000)
    reused = torch.empty_like(grad)
    reused.copy_(grad)  # fault its pages in once
    fresh = median_ms(lambda: torch.empty_like(grad).copy_(grad))
    again = median_ms(lambda: reused.copy_(grad))
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(f"147 MB copy, THP_MEM_ALLOC_ENABLE={thp}, load average {os.getloadavg()[0]:.2f}: "
          f"fresh {fresh:.1f} ms, reused {again:.1f} ms, ratio {fresh / again:.1f}x")


if __name__ == "__main__":
    main()
