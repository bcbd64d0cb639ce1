"""Where a step's time goes, per rank: forward, backward (with the hook), update, CPU seconds, hook phases.

Runs inside an emulated cluster (one process per rank, launched by ``gradcomp_lab.emulate``), trains the
3x4096 MLP of ``step_time.py`` with stock DDP and with the gradcomp hook for each strategy, with a barrier before
every step so the ranks start together, and prints per rank the medians over the timed steps: wall time of
forward, backward and optimizer step, the process's CPU seconds per step (all its threads; ``sys`` is the part spent
in the kernel: system calls, page faults, TCP), and the hook's time split (``lightning_gradcomp.exchange.stats.HookStats``: compress, collective_wait, decompress; summed over buckets).

    python -m gradcomp_lab.emulate --nproc 4 --bandwidth 1gbit -- \\
        python benchmarks/hook_breakdown.py --batch 8 --strategies ddp terngrad terngrad:ignore

``NAME:ignore`` runs the hook with ``nonfinite="ignore"`` (no non-finite guard), to show what the guard costs.

``--alone`` runs no cluster: one process, one thread, and prints the same model's compute pieces (zero_grad,
forward, backward, update) and TernGrad's per-step codec pieces over every parameter (the guard's sum,
TernGrad's statistics, compress, decoding and averaging N payloads into the bucket)::

    python benchmarks/hook_breakdown.py --alone --batch 8 --world 4
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's library
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.step_time import build_model

from lightning_gradcomp import GradCompState, gradcomp_hook, registry
from lightning_gradcomp.exchange.stats import HookStats
from lightning_gradcomp.compressors.per_tensor import per_tensor


def run(strategy: str, batch: int, steps: int, warmup: int) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("mlp")
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    state = None
    name, _, nonfinite = strategy.partition(":")
    if name != "ddp":
        compressor = registry.make_compressor(name)
        compressor.setup(rank, world, torch.device("cpu"))
        state = GradCompState(
            compressor=compressor, names={id(p): n for n, p in model.named_parameters()}, world_size=world,
            stats=HookStats(histogram_layers=()), nonfinite=nonfinite or "skip", pipeline_bytes=8 * 2**20,  # type: ignore[arg-type]
        )
        ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(batch, 1, 28, 28, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    times: dict[str, list[float]] = {"forward": [], "backward": [], "update": [], "step": [], "cpu": [], "sys": []}
    for i in range(warmup + steps):
        dist.barrier()
        c0, s0, t0 = time.process_time(), os.times().system, time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i == warmup - 1 and state is not None and state.stats is not None:
            state.stats.take_times()  # forget the warm-up steps
        if i >= warmup:
            cpu, system = time.process_time() - c0, os.times().system - s0
            for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, cpu, system)):
                times[key].append(value)
    out: dict[str, object] = {k: round(statistics.median(v) * 1e3) for k, v in times.items()}
    if state is not None and state.stats is not None:
        out.update({k: round(v * 1e3 / steps) for k, v in state.stats.take_times().items()})
    del ddp, opt
    dist.barrier()
    return out


def alone(batch: int, world: int, repeats: int = 7) -> None:
    """Medians (ms) of one rank's compute and TernGrad codec pieces, in one process without communication."""
    torch.set_num_threads(1)
    model = build_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

    def timed(fn: object, setup: object = None) -> float:
        times = []
        for _ in range(repeats):
            if setup is not None:
                setup()  # type: ignore[operator]
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    loss_box: list[torch.Tensor] = []
    pieces = {
        "zero_grad": lambda: opt.zero_grad(set_to_none=False),
        "forward": lambda: loss_box.append(nn.functional.cross_entropy(model(x), y)),
        "backward": lambda: loss_box.pop().backward(),
        "update": opt.step,
    }
    compute = {k: 0.0 for k in pieces}
    system = {k: 0.0 for k in pieces}  # kernel-mode CPU (page faults of fresh tensors), mean per step
    for _ in range(repeats):
        for key, fn in pieces.items():
            start, sys_start = time.perf_counter(), os.times().system
            fn()
            compute[key] += (time.perf_counter() - start) * 1e3 / repeats
            system[key] += (os.times().system - sys_start) * 1e3 / repeats
    compressor = registry.make_compressor("terngrad")
    compressor.setup(0, world, torch.device("cpu"))
    grads = [p.grad.reshape(-1) for p in model.parameters()]
    buckets = [torch.empty_like(g) for g in grads]
    stats = [per_tensor(compressor).local_statistic(g, str(i)) for i, g in enumerate(grads)]
    packets = [per_tensor(compressor).compress(g, str(i), s) for i, (g, s) in enumerate(zip(grads, stats))]
    codec = {
        "guard sum": timed(lambda: [g.sum() for g in grads]),
        "statistics": timed(lambda: [per_tensor(compressor).local_statistic(g, str(i)) for i, g in enumerate(grads)]),
        # after this step's statistics, as in the hook (the fused path reuses them instead of another pass)
        "compress": timed(
            lambda: [per_tensor(compressor).compress(g, str(i), s) for i, (g, s) in enumerate(zip(grads, stats))],
            setup=lambda: [per_tensor(compressor).local_statistic(g, str(i)) for i, g in enumerate(grads)],
        ),
        # what the hook runs: decode the ranks' payloads and average them into the bucket (one pass where fused)
        f"decode and average {world} payloads into the bucket": timed(
            lambda: [per_tensor(compressor).decompress_mean_into([p] * world, b) for p, b in zip(packets, buckets)]
        ),
    }
    numel = sum(g.numel() for g in grads)
    print(f"one process, one thread, MLP ({numel} parameters), batch {batch}, load average {os.getloadavg()[0]:.2f}")
    print("| piece | ms | of which system (page faults etc.; 10 ms clock ticks, mean) |")
    print("|---|---|---|")
    for key, value in {**compute, **codec}.items():
        print(f"| {key} | {value:.1f} | {f'{system[key]:.0f}' if key in system else '-'} |")
    print(f"| compute total | {sum(compute.values()):.1f} | {sum(system.values()):.0f} |")
    print(f"| TernGrad codec total | {sum(codec.values()):.1f} | - |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "terngrad"])
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--alone", action="store_true", help="one process, no cluster: compute and codec pieces")
    parser.add_argument("--world", type=int, default=4, help="with --alone: payloads decoded per parameter")
    args = parser.parse_args()
    if args.alone:
        alone(args.batch, args.world)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for strategy in args.strategies:
            result = run(strategy, args.batch, args.steps, args.warmup)
            print(f"{strategy} rank {dist.get_rank()}: ms per step {result}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
