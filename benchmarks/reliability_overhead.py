"""What the reliability mechanisms cost per step: the non-finite guard and the replica checksum.

Two Gloo ranks on this machine train an MLP through ``gradcomp_hook`` (raw DDP, several buckets); per round the
guard is off (``nonfinite='ignore'``) or on (``'skip'``), interleaved so both see the same machine load. The
replica check (``check_replicas``) is timed on its own, as is the size of the compression state a checkpoint
gains. Prints a table of medians.

    python benchmarks/reliability_overhead.py [--steps 30] [--width 1024] [--compressor terngrad]
"""

import argparse
import io
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompState, gradcomp_hook, registry
from lightning_gradcomp.strategies.checkpoint import rank_state
from lightning_gradcomp.strategies.replicas import check_replicas


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(w, w), nn.ReLU())], nn.Linear(w, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=2)
    compressor = registry.make_compressor(args.compressor)
    compressor.setup(rank, world, torch.device("cpu"))
    state = GradCompState(compressor=compressor, names={id(p): n for n, p in model.named_parameters()}, world_size=world)
    ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, w), torch.randint(0, 10, (32,))
    times: dict[str, list[float]] = {"ignore": [], "skip": [], "replica_check": []}
    for step in range(args.steps + 2):
        for mode in ("ignore", "skip") if step % 2 else ("skip", "ignore"):
            state.guard.set_mode(mode)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if step >= 2:  # the first steps build and rebuild DDP's buckets
                times[mode].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        named = list(model.named_parameters())
        check_replicas([n for n, _ in named], [p for _, p in named], world, step)
        times["replica_check"].append(time.perf_counter() - t0)
    buf = io.BytesIO()
    torch.save(rank_state(state), buf)
    if rank == 0:
        queue.put((times, buf.tell(), sum(p.numel() for p in model.parameters()), len(state.ledger.shared_stat_bytes)))
    del ddp
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--compressor", default="terngrad", choices=registry.compressor_names())
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times, state_bytes, numel, buckets = queue.get(timeout=900)
    for p in procs:
        p.join()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"machine: {platform.node()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}), 2 Gloo ranks")
    print(f"model: {numel:,} parameters in {buckets} buckets, compressor {args.compressor}, {args.steps} steps each")
    print(f"| {'what':<40} | {'median ms':>10} | {'ratio':>6} |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 8}|")
    print(f"| {'step, nonfinite=ignore (no guard)':<40} | {med['ignore']:>10.2f} | {1.0:>6.3f} |")
    print(f"| {'step, nonfinite=skip (guard on)':<40} | {med['skip']:>10.2f} | {med['skip'] / med['ignore']:>6.3f} |")
    print(f"| {'check_replicas (one call)':<40} | {med['replica_check']:>10.2f} | {med['replica_check'] / med['ignore']:>6.3f} |")
    print(f"compression state per rank in a checkpoint: {state_bytes:,} bytes")


if __name__ == "__main__":
    main()
