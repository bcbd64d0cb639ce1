"""How far is Gradient Dropping's bucket-friendly "global" threshold from a truly global one?

Trains the AdaComp paper's MNIST-CNN on Fashion-MNIST in one process with every gradient through
``GradientDropping(scope="global")`` and the residual memory, parameters in DDP's bucket order (reverse
registration order). At every step it also computes, on the very same compensated gradients, the truly global
threshold (exact selection over the whole model's |x| at this step, what Marian does on its concatenated
gradient) and compares what each would send. Shadow compressors replay the same tensors to measure the
previous-step threshold with each sample mode, and the per-layer scope.

Usage: python benchmarks/graddrop_global_threshold.py [--steps 200] [--drop-ratio 0.99] [--out FILE]
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import cast

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` as a package
from benchmarks._sparse_common import fashion_mnist, mnist_cnn
from lightning_gradcomp.compressors.graddrop import GradientDropping, select_threshold
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.compressors.per_tensor import per_tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--drop-ratio", type=float, default=0.99)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also store the table here (Markdown, with the "
                        "command and machine: benchmarks/results/micro/graddrop_global_threshold.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images, labels = fashion_mnist("train")
    model = mnist_cnn()
    named = list(model.named_parameters())[::-1]  # DDP's bucket order
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    driver = GradientDropping(drop_ratio=args.drop_ratio, scope="global", sample="random")
    shadows = {s: GradientDropping(drop_ratio=args.drop_ratio, scope="global", sample=s) for s in ("random", "strided", "exact")}
    for comp in (driver, *shadows.values()):
        comp.setup(0, 1, torch.device("cpu"))
    memory = ResidualMemory()
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, dict[str, list[float]]] = {k: {"thr": [], "kept": [], "recall": [], "rel_err": []} for k in (*shadows, "layer")}
    start = time.perf_counter()
    for step in range(args.steps):
        batch = torch.randint(0, len(images), (args.batch,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
        xs = {n: memory.compensate(cast(torch.Tensor, p.grad), n) for n, p in named}  # all set by backward
        flat = torch.cat([xs[n].reshape(-1) for n, _ in named])
        true_thr = select_threshold(flat.abs(), args.drop_ratio)
        true_keep = flat.abs() > true_thr
        true_sent = torch.where(true_keep, flat, 0.0)
        # thresholds each approximation would use on these tensors, in bucket order
        used: dict[str, list[torch.Tensor]] = {k: [] for k in rows}
        for n, _ in named:
            mags = xs[n].reshape(-1).abs()
            for s, comp in shadows.items():
                used[s].append(comp.threshold(mags, n).expand(mags.numel()))
            used["layer"].append(select_threshold(mags, args.drop_ratio).expand(mags.numel()))
        if step > 0:  # step 0 has no previous-step pool: the global scope falls back to per-layer thresholds
            for k, parts in used.items():
                thr = torch.cat(parts)
                keep = flat.abs() > thr
                sent = torch.where(keep, flat, 0.0)
                rows[k]["thr"].append(float(thr.max() / true_thr) if k != "layer" else float("nan"))
                rows[k]["kept"].append(float(keep.float().mean()))
                rows[k]["recall"].append(float((keep & true_keep).sum() / true_keep.sum()))
                rows[k]["rel_err"].append(float((sent - true_sent).norm() / true_sent.norm()))
        # the driver really trains with its (random-sample, previous-step) global threshold
        for n, p in named:
            assert p.grad is not None
            per_tensor(driver).observe_gradient(p.grad, n)
            packet = per_tensor(driver).compress(xs[n], n)
            sent = per_tensor(driver).sent(xs[n], packet)
            memory.update(n, xs[n], sent)
            p.grad.copy_(sent)
        opt.step()
    elapsed = time.perf_counter() - start
    lines = [f"# command: `python benchmarks/graddrop_global_threshold.py --steps {args.steps} "
             f"--drop-ratio {args.drop_ratio} --batch {args.batch}`",
             f"# machine: {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             "1 thread",
             f"# {elapsed:.0f} s; medians over steps 1..{args.steps - 1}; target kept = {1 - args.drop_ratio:.4f}",
             "| threshold | thr / true global | kept fraction | recall of true global set | rel. L2 error of sent |",
             "|---|---|---|---|---|"]
    names = {"random": "global, previous step, 0.1% random", "strided": "global, previous step, strided 100k",
             "exact": "global, previous step, exact", "layer": "per layer, this step, exact"}
    for k, label in names.items():
        r = rows[k]
        med = {m: statistics.median(v) for m, v in r.items()}
        thr_cell = "-" if k == "layer" else f"{med['thr']:.3f}"
        lines.append(f"| {label} | {thr_cell} | {med['kept']:.4f} | {med['recall']:.3f} | {med['rel_err']:.3f} |")
    print("\n".join(lines))
    if args.out:  # the stored table docs/compressors.md shows (tools/results_tables.py)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
