"""Step time of data-parallel training over an emulated cluster (issue 8, part 4).

For every world size N and link bandwidth, builds an emulated cluster (one network namespace per rank, veth
pairs into a bridge, ``tc tbf`` on every link; see :mod:`gradcomp_lab.emulate`), and runs, inside one
process group per cluster, every (model, strategy) pair for ``warmup + steps`` training steps. A step's time is
the max over ranks; the table gives the median over the timed steps and the ratio to fp32 DDP measured in the
same run on the same cluster.

Strategies (by name):

* ``ddp``: stock torch DDP (fp32 all-reduce, DDP's default hook): the reference.
* ``ddp_bf16``: stock torch DDP with torch's ``bf16_compress_hook``.
* any registered compressor name (``fp32``, ``terngrad``, and ``bf16``, ``powersgd``, ``graddrop``, ``adacomp`` once
  registered): DDP with the gradcomp hook; unregistered names are skipped with a note.
* ``NAME+plan``: the same with the cost-model planner given this cluster's link (compression per bucket only
  where it pays; ``inf`` links use the link speed measured by the probe).

Models: ``mlp`` (communication-bound: the 3x4096 MLP of Aji & Heafield on 784 inputs, 36.8M parameters) and
``lenet`` (compute-bound: TernGrad's Caffe LeNet with SAME padding, 1.2M parameters).

Options that apply to every strategy alike: ``--batch`` (per-rank batch), ``--gradient-as-bucket-view`` (DDP's
option), ``--thp`` (``THP_MEM_ALLOC_ENABLE=1`` in every rank), ``--malloc-reuse`` (glibc keeps freed memory for
reuse instead of returning every allocation over 32 MB to the kernel, see ``MALLOC_REUSE_ENV``); ``--pipeline-mb`` sets the gradcomp hook's
pipelined group size (``GradCompStrategy``'s default, 8 MiB).

Run as root (namespaces)::

    python benchmarks/step_time.py --nproc 2 4 --bandwidth 100mbit 1gbit 10gbit inf --json out.json
"""

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

# this checkout's library, not whichever copy is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# -- models (kept here so the benchmark needs nothing beyond the library) -----------------------------------
MODELS = ("mlp", "lenet")
BATCH = {"mlp": 32, "lenet": 64}


def build_model(name: str, mlp_width: int = 4096) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(1234)  # the same initial replica on every rank
    if name == "mlp":
        w = mlp_width
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)
        )
    if name == "lenet":
        return nn.Sequential(
            nn.Conv2d(1, 20, 5, padding=2), nn.MaxPool2d(2), nn.Conv2d(20, 50, 5, padding=2), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(7 * 7 * 50, 500), nn.ReLU(), nn.Linear(500, 10),
        )
    raise ValueError(f"Expected a model in {MODELS}, but got {name!r}.")


def input_shape(name: str) -> tuple[int, ...]:
    return (1, 28, 28)


def bf16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: bf16 all-reduce of the bucket (torch's own ``bf16_compress_hook`` refuses to run on CPU/Gloo)."""
    buffer = bucket.buffer()
    half = buffer.to(torch.bfloat16)
    fut = dist.all_reduce(half, async_op=True).get_future()

    def decode(_: Any) -> torch.Tensor:
        buffer.copy_(half.float().div_(dist.get_world_size()))
        return buffer

    return fut.then(decode)


#: glibc malloc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and unmaps it on
#: free, so each step's new 64 MB weight gradients of the MLP are page-faulted and zeroed by the kernel again (about
#: 45 ms of system time per step and rank, measured); these raise both thresholds so freed memory is reused
#: (glibc's documented tunables; PyTorch's CPU tuning guide suggests a caching allocator such as jemalloc for the
#: same reason)
MALLOC_REUSE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


# -- the rank body ------------------------------------------------------------------------------------------
def _probe_link(dist: Any, torch: Any, world: int, group: Any = None) -> dict[str, float]:
    """Effective bandwidth (bit/s) and per-step latency of the all-reduce on this cluster, measured (among the
    ``world`` ranks of ``group``; ``None``: all of them)."""
    small = torch.zeros(1)
    for _ in range(3):
        dist.all_reduce(small, group=group)
    t = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(small, group=group)
    latency = (time.perf_counter() - t) / 20 / (2 * (world - 1))
    big = torch.zeros(2 * 1024 * 1024)  # 8 MiB
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dist.all_reduce(big, group=group)
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times) - 2 * (world - 1) * latency
    bandwidth = 2 * (world - 1) / world * 8 * big.numel() * 4 / max(seconds, 1e-9)
    # one link for every rank (the slowest bandwidth, the largest latency seen): the planner must be given the
    # same link everywhere, and the table one number
    agreed = torch.tensor([latency, -bandwidth], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return {"latency_s": agreed[0].item(), "bandwidth_bit_s": -agreed[1].item()}


def _run_one(model_name: str, strategy: str, args: argparse.Namespace, link: dict[str, float]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp import GradCompState, gradcomp_hook, registry
    from lightning_gradcomp.exchange.costmodel import Link, parse_rate
    from lightning_gradcomp.exchange.planner import CollectivePlanner

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(model_name, args.mlp_width)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view
    )
    state: Optional[GradCompState] = None
    base, _, plan = strategy.partition("+")
    if base == "ddp_bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif base != "ddp":
        compressor = registry.make_compressor(base)
        compressor.setup(rank, world, torch.device("cpu"))
        planner = None
        if plan == "plan":
            nominal = parse_rate(args.link)
            bandwidth = min(nominal, link["bandwidth_bit_s"])  # an unlimited veth still has a finite speed
            planner = CollectivePlanner(Link(bandwidth, max(link["latency_s"], 1e-6)))
        state = GradCompState(
            compressor=compressor,
            names={id(p): n for n, p in model.named_parameters()},
            world_size=world,
            planner=planner,
            pipeline_bytes=int(args.pipeline_mb * 2**20) if args.pipeline_mb > 0 else None,
        )
        ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    batch = args.batch or BATCH[model_name]
    x = torch.randn(batch, *input_shape(model_name), generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    times = []
    for _ in range(args.warmup + args.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    # a step is as slow as its slowest rank
    step = torch.tensor(times[args.warmup :], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    numel = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {
        "model": model_name,
        "strategy": strategy,
        "params": numel,
        "batch": batch,
        "step_s": step.tolist(),
        "median_s": statistics.median(step.tolist()),
        "bytes_per_step": 4 * numel if state is None else state.bytes_per_step(),
    }
    if base == "ddp_bf16":
        out["bytes_per_step"] = 2 * numel
    if state is not None:
        out["collectives"] = {k: v for k, v in state.ledger.collectives.items()}
        if state.router.planner is not None:
            assert isinstance(state.router.planner, CollectivePlanner)  # the planner this function built
            out["plans"] = sorted({p.choice for p in state.router.planner.plans.values()})
    if args.profile_compute and base == "ddp":
        # the same steps without communication, on this rank's share of the machine: the perf model's compute
        ctimes = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            with ddp.no_sync():
                opt.zero_grad(set_to_none=False)
                nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            ctimes.append(time.perf_counter() - t)
        c = torch.tensor(ctimes[args.warmup :], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        out["compute_s"] = statistics.median(c.tolist())
    if args.profile_compute and base == "terngrad":
        from lightning_gradcomp.exchange.codec import measure_codec

        codec = measure_codec(registry.make_compressor("terngrad"), [(n, tuple(p.shape)) for n, p in model.named_parameters()], world)
        c = torch.tensor([codec.encode_s + codec.decode_s], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        out["codec_s"] = c.item()
    del ddp, opt
    dist.barrier()
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_gradcomp import registry

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        link = _probe_link(dist, torch, world)
        results = []
        for model_name in args.models:
            for strategy in args.strategies:
                base = strategy.split("+")[0]
                if base not in ("ddp", "ddp_bf16") and base not in registry.COMPRESSORS:
                    continue  # noted by the orchestrator
                results.append(_run_one(model_name, strategy, args, link))
                if dist.get_rank() == 0:
                    r = results[-1]
                    print(f"{model_name:6s} {strategy:16s} median {r['median_s'] * 1e3:9.1f} ms", flush=True)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps({"link_probe": link, "results": results}))
    finally:
        dist.destroy_process_group()


# -- the orchestrator ---------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "torch": torch.__version__,
        "loadavg_at_start": os.getloadavg(),
    }


def orchestrate(args: argparse.Namespace, argv: list[str]) -> None:
    from gradcomp_lab.emulate import Cluster, EmulationUnavailable, check_available, run_on_cluster
    from lightning_gradcomp import registry
    from lightning_gradcomp.exchange.costmodel import parse_rate

    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    known = {"ddp", "ddp_bf16", *registry.COMPRESSORS}
    skipped = [s for s in args.strategies if s.split("+")[0] not in known]
    for s in skipped:
        print(f"note: strategy {s!r} is not registered here (known: {sorted(known)}); skipped")
    strategies = [s for s in args.strategies if s not in skipped]
    command = "python benchmarks/step_time.py " + " ".join(shlex.quote(a) for a in argv)
    info = machine()
    report: dict[str, Any] = {"command": command, "machine": info, "skipped": skipped, "runs": []}
    started = time.time()
    for nproc in args.nproc:
        for link in args.bandwidth:
            cluster = Cluster(nproc, parse_rate(link))
            with tempfile.TemporaryDirectory() as tmp, cluster:
                out = os.path.join(tmp, "result.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--link", link]
                cmd += ["--models", *args.models, "--strategies", *strategies]
                cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                cmd += ["--mlp-width", str(args.mlp_width), "--bucket-cap-mb", str(args.bucket_cap_mb)]
                cmd += ["--batch", str(args.batch), "--pipeline-mb", str(args.pipeline_mb)]
                cmd += ["--gradient-as-bucket-view"] if args.gradient_as_bucket_view else []
                cmd += ["--profile-compute"] if args.profile_compute else []
                print(f"== {cluster.describe()}", flush=True)
                env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
                if args.thp:
                    env["THP_MEM_ALLOC_ENABLE"] = "1"
                if args.malloc_reuse:
                    env.update(MALLOC_REUSE_ENV)
                run_on_cluster(cluster, cmd, timeout=args.timeout, env=env, out=sys.stdout if args.verbose else open(os.devnull, "w"))
                data = json.loads(Path(out).read_text())
            report["runs"].append({"nproc": nproc, "link": link, **data})
            print_table(report["runs"][-1:], header=False)
            if args.json:  # after every cluster: a later failure keeps what was measured
                Path(args.json).write_text(json.dumps(report, indent=1))
    report["wall_s"] = time.time() - started
    report["loadavg_at_end"] = os.getloadavg()
    print()
    print(f"command: {command}")
    print(f"machine: {info['cores']} cores, {info['cpu']}, Linux {info['kernel']}, torch {info['torch']}")
    print(f"wall: {report['wall_s']:.0f} s; load average at start {info['loadavg_at_start']}, at end {report['loadavg_at_end']}")
    print_table(report["runs"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


def print_table(runs: list[dict[str, Any]], header: bool = True) -> None:
    """Markdown table: one row per (N, link, model, strategy), ratios to ``ddp`` on the same cluster."""
    if header:
        print("| N | link | model | strategy | median step (ms) | x fp32 DDP | MB/step/rank | collective plan |")
        print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        reference = {r["model"]: r["median_s"] for r in run["results"] if r["strategy"] == "ddp"}
        for r in run["results"]:
            ref = reference.get(r["model"])
            ratio = f"{r['median_s'] / ref:.2f}" if ref else "-"
            plans = ", ".join(r.get("plans", [])) or "-"
            print(
                f"| {run['nproc']} | {run['link']} | {r['model']} | {r['strategy']} | {r['median_s'] * 1e3:.1f} | "
                f"{ratio} | {r['bytes_per_step'] / 1e6:.2f} | {plans} |"
            )


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--bandwidth", nargs="+", default=["100mbit", "1gbit", "10gbit", "inf"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument(
        "--strategies",
        nargs="+",
        default=["ddp", "ddp_bf16", "fp32", "bf16", "terngrad", "terngrad+plan", "powersgd", "graddrop", "adacomp"],
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mlp-width", type=int, default=4096)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument(
        "--pipeline-mb", type=float, default=8.0,
        help="the gradcomp hook's pipelined group size in MiB (GradCompStrategy's default; 0: one group per bucket)",
    )
    p.add_argument(
        "--thp",
        action="store_true",
        help="THP_MEM_ALLOC_ENABLE=1 in every rank (torch backs large CPU tensors with transparent huge pages)",
    )
    p.add_argument(
        "--malloc-reuse",
        action="store_true",
        help="every rank reuses freed memory instead of a fresh mmap per large tensor (glibc thresholds, see MALLOC_REUSE_ENV)",
    )
    p.add_argument("--batch", type=int, default=0, help="per-rank batch size (0: mlp 32, lenet 64)")
    p.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) for every strategy: gradients live in the buckets, one copy less",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cluster before every rank is killed")
    p.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up")
    p.add_argument("--json", default=None, help="write all numbers here")
    p.add_argument(
        "--profile-compute",
        action="store_true",
        help="also time compute alone (ddp without sync) and TernGrad's codec on each cluster, for perf_validate.py",
    )
    p.add_argument("--verbose", action="store_true", help="stream the ranks' output")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--link", default="inf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
    if args.worker:
        worker(args)
    else:
        orchestrate(args, argv)


if __name__ == "__main__":
    main()
