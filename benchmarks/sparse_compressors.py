"""Gradient Dropping and AdaComp end to end, torch backend vs fused backend, against memory-copy bandwidth.

Run from the repository root:

    python benchmarks/sparse_compressors.py                 # the 36.8M-parameter MLP of step_time.py
    python benchmarks/sparse_compressors.py --repeats 3 --configs graddrop,adacomp

What one rank's hook does per parameter with a gathering compressor, minus the collectives: ``compress``
its compensated gradient, then ``decompress_sum`` of the N ranks' payloads (``--world``, default 4; the
payloads are those N ranks' compressors made of N different gradients: G ~ N(0, 9), and for AdaComp
dW ~ N(0, 1), or dW = G in ``adacomp-step0``, a first step without residue, where AdaComp sends ~10%). Rows
are the weight shapes of ``benchmarks/step_time.py``'s MLP (784x4096, 4096x4096, 4096x10) and the whole model
(all 8 tensors, biases included, 36.8M elements). GB/s are of fp32 input (numel * 4 bytes / time); "clone" is ``torch.clone`` of an
fp32 tensor of that size (fresh pages, as the decoded sum pays). Each repeat times clone, the torch backend
and the fused backend back to back; speed-ups and ratios are medians of per-repeat ratios, so load from other
processes shifts both sides together. Threads default to 1, as in step_time.py's ranks.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.per_tensor import per_tensor

CONFIGS: dict[str, Callable[[Backend], Compressor]] = {
    "graddrop": lambda b: GradientDropping(backend=b),  # the paper: 0.1% random sample, R = 0.99, coo32 fp32
    "graddrop-strided": lambda b: GradientDropping(sample="strided", backend=b),  # Marian's 100k stride sample
    "graddrop-2bit": lambda b: GradientDropping(quantize="2bit", index_encoding="delta16", backend=b),
    "adacomp": lambda b: AdaComp(backend=b),  # L_T 500 (fully connected), binary, the paper's wire
    "adacomp-ternary": lambda b: AdaComp(quantizer="ternary", backend=b),
    "adacomp-step0": lambda b: AdaComp(backend=b),  # a first step: no residue yet, dW = G (sends ~10%)
}
#: configurations whose fresh gradient dW is G itself (residue 0); the others get dW ~ N(0, 1), G ~ N(0, 9)
FIRST_STEP = {"adacomp-step0"}
#: the MLP of benchmarks/step_time.py (width 4096): (name, shape)
MLP = [
    ("1.weight", (4096, 784)), ("1.bias", (4096,)),
    ("3.weight", (4096, 4096)), ("3.bias", (4096,)),
    ("5.weight", (4096, 4096)), ("5.bias", (4096,)),
    ("7.weight", (10, 4096)), ("7.bias", (10,)),
]
ROWS = {"784x4096": ["1.weight"], "4096x4096": ["3.weight"], "4096x10": ["7.weight"], "MLP 36.8M": [n for n, _ in MLP]}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Case:
    """One backend's compressor and its inputs: this rank's gradient per tensor and the N ranks' packets."""

    def __init__(self, make: Callable[[Backend], Compressor], backend: Backend, grads: list[dict[str, torch.Tensor]],
                 fresh: list[dict[str, torch.Tensor]]) -> None:
        self.ranks = []
        for r in range(len(grads)):
            comp = make(backend)
            comp.setup(r, len(grads), torch.device("cpu"))
            self.ranks.append(comp)
        self.grads, self.fresh = grads, fresh
        self.packets: dict[str, list[Packet]] = {name: [self._compress(r, name) for r in range(len(grads))]
                                                 for name in grads[0]}

    def _compress(self, rank: int, name: str) -> Packet:
        comp = self.ranks[rank]
        per_tensor(comp).observe_gradient(self.fresh[rank][name], name)  # AdaComp's dW; ignored by Gradient Dropping
        return per_tensor(comp).compress(self.grads[rank][name], name)

    def step(self, names: list[str]) -> None:
        for name in names:
            self._compress(0, name)
            per_tensor(self.ranks[0]).decompress_sum(self.packets[name])


def measure(ref: Case, fused: Case, names: list[str], repeats: int) -> dict[str, float]:
    numel = sum(ref.grads[0][n].numel() for n in names)
    src = torch.randn(numel)
    ref.step(names)  # warm-up
    fused.step(names)
    t_clone, t_ref, t_fused = [], [], []
    for _ in range(repeats):
        t_clone.append(_time(lambda: src.clone()))
        t_ref.append(_time(lambda: ref.step(names)))
        t_fused.append(_time(lambda: fused.step(names)))
    gb = numel * 4 / 1e9
    return {
        "numel": numel,
        "clone_gbps": gb / statistics.median(t_clone),
        "torch_gbps": gb / statistics.median(t_ref),
        "fused_gbps": gb / statistics.median(t_fused),
        "torch_ms": 1e3 * statistics.median(t_ref),
        "fused_ms": 1e3 * statistics.median(t_fused),
        "speedup": statistics.median(r / f for r, f in zip(t_ref, t_fused)),
        "torch_per_clone": statistics.median(c / r for c, r in zip(t_clone, t_ref)),
        "fused_per_clone": statistics.median(c / f for c, f in zip(t_clone, t_fused)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per row (medians)")
    parser.add_argument("--world", type=int, default=4, help="ranks whose payloads decompress_sum adds")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (step_time.py's ranks: 1)")
    parser.add_argument(
        "--json", default="benchmarks/results/sparse_compressors.json", help="where to write the results"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.fused_available():
        print("WARNING: the compiled kernels are unavailable: the fused column runs their torch-ops path")
    command = "python " + " ".join(sys.argv)
    machine = f"{_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(f"command: {command}")
    print(f"machine: {machine}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average before: {load} (1/5/15 min; other processes share these cores)")
    gen = torch.Generator().manual_seed(0)
    # rank r's compensated gradient (gradient plus residual) and its fresh gradient dW
    grads = [{n: torch.randn(s, generator=gen) * 3 for n, s in MLP} for _ in range(args.world)]
    fresh = [{n: torch.randn(s, generator=gen) for n, s in MLP} for _ in range(args.world)]
    header = (f"{'config':<17}{'tensor':>11}{'clone GB/s':>11}{'torch GB/s':>11}{'fused GB/s':>11}{'torch ms':>10}"
              f"{'fused ms':>10}{'speedup':>9}{'torch/clone':>12}{'fused/clone':>12}")
    print(f"compress + decompress_sum of {args.world} payloads, medians of {args.repeats} repeats")
    print(header)
    print("-" * len(header))
    rows = []
    for config in args.configs.split(","):
        make = CONFIGS[config]
        dw = grads if config in FIRST_STEP else fresh
        ref, fused = Case(make, "torch", grads, dw), Case(make, "fused", grads, dw)
        for row, names in ROWS.items():
            m = measure(ref, fused, names, args.repeats)
            print(f"{config:<17}{row:>11}{m['clone_gbps']:>11.2f}{m['torch_gbps']:>11.3f}{m['fused_gbps']:>11.3f}"
                  f"{m['torch_ms']:>10.1f}{m['fused_ms']:>10.1f}{m['speedup']:>8.1f}x{m['torch_per_clone']:>12.3f}"
                  f"{m['fused_per_clone']:>12.3f}", flush=True)
            rows.append({"config": config, "tensor": row, **m})
    load_after = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in load_after)}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "machine": machine, "world": args.world, "repeats": args.repeats,
                               "load_after": load_after, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
