"""Per-step time of the gradcomp hook against plain DDP on a small GPT-style transformer.

Every variant is timed side by side in one run: each rank builds one DDP replica per variant (plain DDP with no
comm hook, DDP with torch's ``fp16_compress_hook``, and the gradcomp hook with each compressor) and, step by
step, runs one training step of every variant in a rotating order, so machine noise falls on all of them alike.
Reported: the median step time over the timed steps (after warm-up) and its ratio to plain DDP's median.

The model has many small parameter tensors (``--layers`` blocks of 12 tensors, plus embeddings and a final norm:
292 at the default 24 layers) so that the hook's per-parameter cost shows.

    python benchmarks/hook_overhead.py [--world-sizes 1 2] [--steps 10] [--device cpu|cuda]

``--device cuda`` runs world size 1 on one GPU (NCCL group of one) and synchronizes the device around each step.
``--engine fsdp2`` times the sharded engine instead: each replica is sharded by FSDP2's ``fully_shard`` (every block,
then the root) over a one-dimensional "shard" mesh of the ranks, and the compressed variants install
:class:`~lightning_gradcomp.strategies.shards.ShardExchange` (the all-reduce hook of every unit) over a replicate group of one
rank, as :class:`~lightning_gradcomp.strategies.sharded.ShardedGradCompStrategy` does; the baseline is stock FSDP2.
On a shared CPU machine timings are noisy; the ratios within one run are the comparable numbers.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

# this checkout's library and test harness, not whichever copy is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("ddp", "ddp_fp16_hook", "fp32", "bf16", "terngrad", "topk", "graddrop")
BASELINE = {"ddp": "ddp", "fsdp2": "fsdp2"}  # each engine's uncompressed reference variant
ENGINE_ONLY = {"ddp": ("ddp", "ddp_fp16_hook"), "fsdp2": ("fsdp2",)}


class Block(nn.Module):
    """Pre-norm transformer block: 12 parameter tensors (2 norms, qkv, attention output, 2 MLP layers)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.ln(self.blocks(x)) @ self.tok.weight.t()  # tied output layer


def _replica(variant: str, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> tuple[Any, Any]:
    from lightning_gradcomp import GradCompState, gradcomp_hook, registry

    torch.manual_seed(0)  # the same initial replica on every rank and for every variant
    model = TinyGPT(args.layers, args.width, args.heads, args.vocab, args.context).to(device)
    if args.engine == "fsdp2":
        return _sharded_replica(variant, model, rank, device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if variant == "ddp_fp16_hook":
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif variant != "ddp":
        compressor = registry.make_compressor(variant)
        compressor.setup(rank, world, device)
        names = {id(p): n for n, p in model.named_parameters()}
        ddp.register_comm_hook(GradCompState(compressor=compressor, names=names, world_size=world), gradcomp_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3)


def _sharded_replica(variant: str, model: nn.Module, rank: int, device: torch.device) -> tuple[Any, Any]:
    """``model`` sharded over all ranks (one replica): stock FSDP2, or with the compressed exchange's hook installed
    on every unit over a replicate group of this rank alone (the shard's compress/decode and bookkeeping all run;
    the collective is a group of one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_gradcomp import GradCompState, registry
    from lightning_gradcomp.strategies.shards import ShardExchange
    from lightning_gradcomp.sites.layout import new_group

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant != "fsdp2":
        compressor = registry.make_compressor(variant)
        compressor.setup(rank, 1, device)
        names = {id(p): n for n, p in model.named_parameters()}
        replicate = dist.group.WORLD
        if dist.get_world_size() > 1:
            for r in range(dist.get_world_size()):  # every rank makes every group, in the same order
                group = new_group([r], None)
                replicate = group if r == rank else replicate
        state = GradCompState(compressor=compressor, names=names, world_size=1, process_group=replicate)
        model._gradcomp_exchange = ShardExchange(state, model)  # type: ignore[assignment]  # keep it alive
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def rank_body(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world == 1:
            dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
        else:
            dist.init_process_group(backend)
    replicas = {v: _replica(v, args, rank, world, device) for v in args.variants}
    first = next(iter(replicas.values()))[0]
    tensors = sum(1 for _ in getattr(first, "module", first).parameters())
    gen = torch.Generator().manual_seed(100 + rank)
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    order = list(args.variants)

    def train_step(variant: str, x: Tensor) -> None:
        model, opt = replicas[variant]
        opt.zero_grad()
        logits = model(x[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1)).backward()
        opt.step()

    for step in range(args.warmup + args.steps):
        x = torch.randint(args.vocab, (args.batch, args.context), generator=gen).to(device)
        order = order[1:] + order[:1]  # rotate: no variant always runs first after the data is drawn
        for variant in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            train_step(variant, x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:  # the first steps build and rebuild DDP's buckets, compile kernels
                times[variant].append(time.perf_counter() - t0)
    if args.profile and rank == 0:
        _profile(args, lambda: train_step(args.profile, x), device)
    replicas.clear()  # free the replicas before the group goes
    dist.barrier()
    if world == 1:
        dist.destroy_process_group()
    return {"tensors": tensors, "times": times}


def _profile(args: argparse.Namespace, step: Any, device: torch.device) -> None:
    """Three steps of one variant under torch's profiler: the ops by self CPU time (host-bound code and
    synchronizations show there) and, on a GPU, by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"\nprofile of 3 steps of {args.profile}, by self CPU time:\n"
          + table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if device.type == "cuda":
        print("by device time:\n" + table.table(sort_by="self_device_time_total", row_limit=15,
                                                   max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--context", type=int, default=33, help="tokens per sequence (inputs are context - 1)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--engine", choices=("ddp", "fsdp2"), default="ddp",
                        help="ddp: DDP's comm hook; fsdp2: FSDP2 units with the sharded exchange's all-reduce hook")
    parser.add_argument("--json", default="", help="also write the medians (seconds per step) to this JSON file")
    parser.add_argument("--profile", default="", help="after timing, profile 3 steps of this variant (rank 0)")
    args = parser.parse_args()
    other = "fsdp2" if args.engine == "ddp" else "ddp"
    if args.engine == "fsdp2" and args.variants == list(VARIANTS):
        args.variants = ["fsdp2", *(v for v in VARIANTS if v not in ENGINE_ONLY["ddp"])]
    wrong = [v for v in args.variants if v in ENGINE_ONLY[other]]
    if wrong:
        raise ValueError(
            f"Expected variants of the {args.engine} engine, but got {wrong} (variants of `--engine {other}`). "
            f"Fix: pass `--engine {other}`, or leave them out of `--variants`."
        )
    if args.device == "cuda" and args.world_sizes != [1]:
        raise ValueError(
            f"Expected `--world-sizes 1` with `--device cuda` (one GPU), but got {args.world_sizes}. "
            "Fix: pass `--world-sizes 1`."
        )
    command = "python " + " ".join(sys.argv)
    machine = f"{platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name(0)}"
    print(f"command: `{command}`\n\nmachine: {machine}\n\nEach variant's median step time over {args.steps} timed steps "
          f"after {args.warmup} warm-up steps, all variants interleaved in one run; ratio = median / the uncompressed "
          f"engine's median ({BASELINE[args.engine]}) "
          "(ranks single-threaded). On a shared VM timings are noisy: compare ratios within a run.\n")
    rows: dict[str, dict[int, float]] = {v: {} for v in args.variants}
    tensors = 0
    for world in args.world_sizes:
        if world == 1 and args.device == "cpu":
            torch.set_num_threads(1)  # as the spawned ranks
        if world == 1:
            result = rank_body(0, 1, args)
        else:
            from tests.harness import run_ranks

            result = run_ranks(rank_body, world, args, timeout=900.0)[0]
        tensors = result["tensors"]
        for variant, samples in result["times"].items():
            rows[variant][world] = statistics.median(samples)
    print(f"model: TinyGPT, {args.layers} layers, width {args.width}, {tensors} parameter tensors, "
          f"batch {args.batch} x {args.context - 1} tokens, device {args.device}, engine {args.engine}\n")
    header = " | ".join(f"ms/step (N={w}) | ratio (N={w})" for w in args.world_sizes)
    print(f"| variant | {header} |\n|---|" + "---|---|" * len(args.world_sizes))
    for variant, by_world in rows.items():
        base = BASELINE[args.engine]
        cells = " | ".join(f"{1e3 * by_world[w]:.1f} | {by_world[w] / rows[base][w]:.2f}" if base in rows
                           else f"{1e3 * by_world[w]:.1f} | -" for w in args.world_sizes)
        print(f"| {variant} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine, "tensors": tensors,
                                               "seconds": {v: {str(w): t for w, t in r.items()} for v, r in rows.items()}}))


if __name__ == "__main__":
    main()
