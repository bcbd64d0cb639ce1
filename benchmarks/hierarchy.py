"""Hierarchical exchange against flat compression and plain DDP, on ranks split into sites (issue 18).

Run under the emulated-cluster launcher (each rank runs this script; rank and world from the environment)::

    python -m gradcomp_lab.emulate --nproc 4 --sites 2 --bandwidth inf --wan-bandwidth 1gbit -- \\
        python benchmarks/hierarchy.py --sites 2 --lan inf --wan 1gbit

Per model (``mlp``: the communication-bound MLP of ``benchmarks/step_time.py`` at ``--mlp-width``; ``gpt``: the
byte-level GPT of ``recipes/lm/gpt_stdlib_ddp.yaml``, width 128, depth 2, context 128, batch 8) and strategy, DDP
with the gradcomp hook runs ``--warmup + --steps`` steps; a step's time is the max over ranks, the table gives
the median of the timed steps (with ``--repeats R``, the median over R runs of the whole grid of those
medians), and the performance model's prediction (:func:`gradcomp_lab.perfmodel.hierarchical_comm_seconds`
for ``NAME@hier``, ``comm_seconds`` on the two-level network for the flat ones, as Gloo's one ring over all
ranks; compute measured here without communication, codec measured here and scaled by ranks per core, LAN and
WAN rates probed here as ``benchmarks/step_time.py`` does).

Strategies: ``ddp`` (stock DDP), ``NAME`` (flat gradcomp hook), ``NAME@hier`` (the hierarchical exchange with
sites of ``world / sites`` ranks; ``fp32@hier`` is the dense hierarchical all-reduce).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STRATEGIES = ["ddp", "fp32@hier", "terngrad", "terngrad@hier", "graddrop", "graddrop@hier", "powersgd", "powersgd@hier"]


def build(model: str, width: int) -> tuple[nn.Module, Any]:
    """The model and a loss closure over a fixed batch (different on every rank)."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    if model == "mlp":
        from benchmarks.step_time import build_model

        net = build_model("mlp", width)
        x, y = torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        return net, lambda m: nn.functional.cross_entropy(m(x), y)
    from gradcomp_lab.models import GPT

    torch.manual_seed(1234)
    net = GPT(vocab_size=256, width=128, depth=2, num_heads=4, context=128)
    tokens = torch.randint(0, 256, (8, 129), generator=gen)
    return net, lambda m: nn.functional.cross_entropy(m(tokens[:, :-1]).reshape(-1, 256), tokens[:, 1:].reshape(-1))


def run(model_name: str, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_gradcomp import GradCompState, gradcomp_hook, registry
    from lightning_gradcomp.sites.hierarchy import hierarchical_hook, new_site_exchange
    from lightning_gradcomp.sites.layout import site_layout

    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss = build(model_name, args.mlp_width)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    base, _, hier = strategy.partition("@")
    state = None
    if base != "ddp":
        names = {id(p): n for n, p in model.named_parameters()}
        compressor = registry.make_compressor(base)
        if hier:
            sizes = [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]
            site = new_site_exchange(site_layout(world, site_size=world // args.sites), rank, sizes)
            compressor.setup(rank, args.sites, torch.device("cpu"))
            state = GradCompState(compressor=compressor, names=names, process_group=site.cross_group,
                                  world_size=args.sites, hierarchy=site)
            ddp.register_comm_hook(state, hierarchical_hook)
        else:
            compressor.setup(rank, world, torch.device("cpu"))
            state = GradCompState(compressor=compressor, names=names, world_size=world)
            ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    times = []
    for _ in range(args.warmup + args.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss(ddp).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    step = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    numel = sum(p.numel() for p in model.parameters())
    out = {"model": model_name, "strategy": strategy, "params": numel, "median_s": statistics.median(step.tolist()),
           "wan_bytes": 4 * numel if state is None else state.bytes_per_step(),
           "lan_bytes": state.peers.hierarchy.lan_bytes_per_step() if state is not None and state.peers.hierarchy is not None else 0}
    if base == "ddp":  # the model's compute: the same steps without communication
        ctimes = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            with ddp.no_sync():
                opt.zero_grad(set_to_none=False)
                loss(ddp).backward()
            opt.step()
            ctimes.append(time.perf_counter() - t)
        c = torch.tensor(ctimes[args.warmup:], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        out["compute_s"] = statistics.median(c.tolist())
    del ddp, opt
    dist.barrier()
    return out


def probe_links(args: argparse.Namespace) -> tuple[Any, Any]:
    """The LAN (inside site 0) and WAN (one rank of each site, alone on the WAN link) as measured here: the veths
    and the ``tc`` limits deliver less than their nominal rate (docs/benchmarks.md section 1)."""
    from benchmarks.step_time import _probe_link

    from lightning_gradcomp.exchange.costmodel import Link

    rank, world = dist.get_rank(), dist.get_world_size()
    k = world // args.sites
    sites = [dist.new_group(list(range(s * k, (s + 1) * k))) for s in range(args.sites)]
    leaders = dist.new_group([s * k for s in range(args.sites)])
    lan = _probe_link(dist, torch, k, sites[rank // k])
    wan = _probe_link(dist, torch, args.sites, leaders) if rank % k == 0 else None
    dist.barrier()
    if wan is None:
        return None, None
    return (Link(lan["bandwidth_bit_s"], lan["latency_s"]), Link(wan["bandwidth_bit_s"], wan["latency_s"]))


def predict(r: dict[str, Any], compute_s: float, shapes: list, args: argparse.Namespace, world: int,
            links: tuple[Any, Any]) -> float:
    from gradcomp_lab.perfmodel import (
        comm_seconds,
        ddp_bucket_fractions,
        fp32_codec,
        hierarchical_comm_seconds,
    )
    from lightning_gradcomp import registry
    from lightning_gradcomp.exchange.codec import measure_codec
    from lightning_gradcomp.exchange.costmodel import Network

    net = Network(links[0], sites=args.sites, wan=links[1])
    base, _, hier = r["strategy"].partition("@")
    numel = r["params"]
    buckets = ddp_bucket_fractions(shapes, args.bucket_cap_mb)
    if base == "ddp":
        return compute_s + comm_seconds(fp32_codec(numel), world, net, buckets, two_level_allreduce=False)
    codec = measure_codec(registry.make_compressor(base), shapes, args.sites if hier else world)
    # measured alone on rank 0; in the run, 4 ranks share the host's cores
    codec_s = (codec.encode_s + codec.decode_s) * max(1.0, world / (os.cpu_count() or 1))
    if hier:
        return compute_s + codec_s + hierarchical_comm_seconds(codec, 4.0 * numel, world, net, buckets)
    # the flat rows' collectives are Gloo's one ring over all ranks: every step of it crosses the WAN
    return compute_s + codec_s + comm_seconds(codec, world, net, buckets, two_level_allreduce=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--lan", default="inf", help="the link inside a site, as given to the launcher (for the model)")
    p.add_argument("--wan", default="1gbit", help="the link between sites, as given to the launcher")
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    p.add_argument("--strategies", nargs="+", default=STRATEGIES)
    p.add_argument("--mlp-width", type=int, default=1024)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs of the whole grid; each row gives their median")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"Expected --repeats >= 1, but got {args.repeats}. Fix: --repeats 3 (the median of 3 runs of the grid).")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    links = probe_links(args)
    rows = []
    for model_name in args.models:
        # the whole grid once per repeat, so that the machine's slow spells fall on every row alike
        repeats = [[run(model_name, s, args) for s in args.strategies] for _ in range(args.repeats)]
        if rank == 0:
            model, _ = build(model_name, args.mlp_width)
            shapes = [(n, tuple(q.shape)) for n, q in model.named_parameters()]
            compute = statistics.median(r["compute_s"] for results in repeats for r in results if "compute_s" in r)
            for row in zip(*repeats):
                r = dict(row[0], median_s=statistics.median(x["median_s"] for x in row))
                rows.append((r, predict(r, compute, shapes, args, world, links)))
    if rank == 0:
        print(f"\n# command: {os.environ.get('HIERARCHY_COMMAND') or ' '.join(['python', *sys.argv])}")
        print(f"# {world} ranks in {args.sites} sites, LAN {args.lan}, WAN {args.wan}; median of {args.steps} steps "
              f"after {args.warmup} warm-up, median of {args.repeats} repeats of the grid; probed LAN {links[0]}, "
              f"WAN {links[1]}; load average {os.getloadavg()}")
        print("| model | strategy | median step (ms) | predicted (ms) | predicted / measured | WAN bytes/step/rank "
              "| LAN bytes/step/rank |")
        print("|---|---|---|---|---|---|---|")
        for r, pred in rows:
            print(f"| {r['model']} | {r['strategy']} | {r['median_s'] * 1e3:.1f} | {pred * 1e3:.1f} | "
                  f"{pred / r['median_s']:.2f} | {r['wan_bytes']:,} | {r['lan_bytes']:,} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
