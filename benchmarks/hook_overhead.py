"""Per-step time of the gradcomp hook against plain DDP on a small GPT-style transformer.

Every variant is timed side by side in one run: each rank builds one DDP replica per variant (plain DDP with no
comm hook, DDP with torch's ``fp16_compress_hook``, and the gradcomp hook with each compressor) and, step by
step, runs one training step of every variant in a rotating order, so machine noise falls on all of them alike.
Reported: the median step time over the timed steps (after warm-up) and its ratio to plain DDP's median.

The model has many small parameter tensors (``--layers`` blocks of 12 tensors, plus embeddings and a final norm:
292 at the default 24 layers) so that the hook's per-parameter cost shows. ``--model gpt2`` trains a
GPT-2-small-shaped model instead: ``transformers.GPT2LMHeadModel`` of ``transformers.GPT2Config()``'s defaults (12
layers, width 768, 50257 tokens: 124M parameters, its embedding one 38.6M-element tensor), random weights, nothing
downloaded; ``--width``, ``--layers``, ``--heads`` and ``--vocab`` override its defaults where given.

    python benchmarks/hook_overhead.py [--world-sizes 1 2] [--steps 10] [--device cpu|cuda] [--model tinygpt|gpt2]

``--trace DIR`` then runs 2 more steps of every variant under ``torch.profiler`` and reports, per variant and
step: the aten ops dispatched (nested ones included: each is a dispatch on every device), the host reads
(``aten::_local_scalar_dense``: ``.item()`` and the like), and on a GPU the kernel launches (``cudaLaunchKernel``,
``cuLaunchKernel``: Triton's too), the host synchronizations (``cuda*Synchronize``) and the device time of all
kernels; each variant's trace is stored as ``DIR/trace_<variant>.json.gz`` (open it in Perfetto). The bytes each
kernel moves are not in a trace: ``benchmarks/kernels.py`` measures the kernels' throughput.

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

# this checkout's library and test harness, not whichever copy is installed; and not this script's folder, whose
# kernels.py would stand in for the `kernels` package transformers imports (for --model gpt2)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("ddp", "ddp_fp16_hook", "fp32", "bf16", "int8", "terngrad", "qsgd", "topk", "graddrop")
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


#: TinyGPT's defaults of the options that ``--model gpt2`` takes from ``GPT2Config()`` unless given
TINYGPT_DEFAULTS = {"layers": 24, "width": 64, "heads": 4, "vocab": 256}


class GPT2(nn.Module):
    """``transformers.GPT2LMHeadModel`` of ``GPT2Config()``'s defaults (random weights, nothing downloaded), the
    logits of token ids as :class:`TinyGPT` gives them; ``overrides`` replace config fields (``n_layer``, ...)."""

    def __init__(self, **overrides: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        # no dropout: the same work every step and every variant
        config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
        self.model = GPT2LMHeadModel(config)
        self.blocks = self.model.transformer.h  # FSDP2's units, as TinyGPT's

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx).logits


def gpt2_config(args: argparse.Namespace) -> dict[str, int]:
    """The ``GPT2Config`` fields ``args`` gives (the others stay GPT-2 small's defaults)."""
    fields = {"layers": "n_layer", "width": "n_embd", "heads": "n_head", "vocab": "vocab_size"}
    return {fields[k]: getattr(args, k) for k in fields if getattr(args, k) is not None}


def build_model(args: argparse.Namespace) -> nn.Module:
    """The benchmark's model: TinyGPT, or GPT-2 small's shape (``--model gpt2``)."""
    if args.model == "gpt2":
        return GPT2(**gpt2_config(args), n_positions=max(1024, args.context))
    return TinyGPT(args.layers, args.width, args.heads, args.vocab, args.context)


def _replica(variant: str, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> tuple[Any, Any]:
    from lightning_gradcomp import GradCompState, gradcomp_hook, registry

    torch.manual_seed(0)  # the same initial replica on every rank and for every variant
    model = build_model(args).to(device)
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
    traces = {}
    if args.trace:
        for variant in args.variants:  # every rank steps (the collectives), rank 0 records
            traces[variant] = _trace(variant, lambda v=variant: train_step(v, x), device, Path(args.trace), rank == 0)
    replicas.clear()  # free the replicas before the group goes
    dist.barrier()
    if world == 1:
        dist.destroy_process_group()
    return {"tensors": tensors, "times": times, "traces": traces,
            "gradient_bytes": sum(4 * p.numel() for p in getattr(first, "module", first).parameters())}


#: CUDA runtime and driver calls that launch a kernel (torch's own, cuBLAS's, Triton's)
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
#: calls that block the host until the device catches up
_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
TRACE_STEPS = 2


def _trace(variant: str, step: Any, device: torch.device, out: Path, record: bool) -> dict[str, float]:
    """``TRACE_STEPS`` steps of ``variant`` under torch's profiler (``record``: this rank records; the others only
    step): per step, the aten ops dispatched, the host reads, and on a GPU the kernel launches, the host
    synchronizations and the kernels' device milliseconds. The trace goes to ``out/trace_<variant>.json.gz``."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    def steps() -> None:
        for _ in range(TRACE_STEPS):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    if not record:
        steps()
        return {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        steps()
    counts = {"aten ops": 0.0, "host reads": 0.0, "launches": 0.0, "syncs": 0.0, "device ms": 0.0}
    for event in prof.events():
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts["device ms"] += event.device_time_total / 1e3  # kernels and copies on the device
        elif name.startswith("aten::"):
            counts["aten ops"] += 1
            counts["host reads"] += name == "aten::_local_scalar_dense"
        elif name in _LAUNCHES:
            counts["launches"] += 1
        elif name in _SYNCS:
            counts["syncs"] += 1
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"trace_{variant}.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {k: v / TRACE_STEPS for k, v in counts.items()}


def print_traces(traces: dict[str, dict[str, float]], baseline: str, gradient_bytes: int, device: str) -> None:
    """The per-step counts of :func:`_trace`, each variant beside the uncompressed engine's."""
    columns = ["aten ops", "host reads"] + (["launches", "syncs", "device ms"] if device == "cuda" else [])
    print(f"\nper step, from torch.profiler ({TRACE_STEPS} steps of each variant after the timed ones; aten ops: "
          f"every dispatch, nested ones included; gradient {gradient_bytes / 2**20:.1f} MiB of fp32):\n")
    print("| variant | " + " | ".join(columns) + " | aten ops beyond " + baseline + " |")
    print("|---|" + "---|" * (len(columns) + 1))
    base = traces.get(baseline, {})
    for variant, counts in traces.items():
        cells = " | ".join(f"{counts[c]:.2f}" if c == "device ms" else f"{counts[c]:.0f}" for c in columns)
        extra = f"{counts['aten ops'] - base['aten ops']:+.0f}" if base else "-"
        print(f"| {variant} | {cells} | {extra} |")


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
    parser.add_argument("--model", choices=("tinygpt", "gpt2"), default="tinygpt",
                        help="gpt2: transformers' GPT2LMHeadModel of GPT2Config()'s defaults, random weights")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: TinyGPT 24, GPT-2 12)")
    parser.add_argument("--width", type=int, default=None, help="default: TinyGPT 64, GPT-2 768")
    parser.add_argument("--heads", type=int, default=None, help="default: TinyGPT 4, GPT-2 12")
    parser.add_argument("--vocab", type=int, default=None, help="default: TinyGPT 256, GPT-2 50257")
    parser.add_argument("--context", type=int, default=33, help="tokens per sequence (inputs are context - 1)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--engine", choices=("ddp", "fsdp2"), default="ddp",
                        help="ddp: DDP's comm hook; fsdp2: FSDP2 units with the sharded exchange's all-reduce hook")
    parser.add_argument("--json", default="", help="also write the medians (seconds per step) to this JSON file")
    parser.add_argument("--profile", default="", help="after timing, profile 3 steps of this variant (rank 0)")
    parser.add_argument("--trace", default="", help="after timing, count each variant's ops, launches and syncs "
                        "per step with torch.profiler, and store its trace in this directory")
    args = parser.parse_args()
    if args.model == "gpt2":
        try:
            import transformers  # noqa: F401
        except ImportError:
            parser.error("Expected the `transformers` package for `--model gpt2`, but it is not installed. "
                         "Fix: `pip install transformers`, or use `--model tinygpt`.")
        from transformers import GPT2Config

        args.vocab = args.vocab or GPT2Config().vocab_size  # the loss reads it
    else:
        for key, value in TINYGPT_DEFAULTS.items():
            setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
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
        traces, gradient_bytes = result["traces"], result["gradient_bytes"]
    if args.model == "gpt2":
        given = ", ".join(f"{k}={v}" for k, v in gpt2_config(args).items() if k != "vocab_size" or v != 50257)
        model = f"GPT-2 small's shape (GPT2Config() defaults{', ' + given if given else ''}), random weights"
    else:
        model = f"TinyGPT, {args.layers} layers, width {args.width}"
    print(f"model: {model}, {tensors} parameter tensors, "
          f"batch {args.batch} x {args.context - 1} tokens, device {args.device}, engine {args.engine}\n")
    header = " | ".join(f"ms/step (N={w}) | ratio (N={w})" for w in args.world_sizes)
    print(f"| variant | {header} |\n|---|" + "---|---|" * len(args.world_sizes))
    for variant, by_world in rows.items():
        base = BASELINE[args.engine]
        cells = " | ".join(f"{1e3 * by_world[w]:.1f} | {by_world[w] / rows[base][w]:.2f}" if base in rows
                           else f"{1e3 * by_world[w]:.1f} | -" for w in args.world_sizes)
        print(f"| {variant} | {cells} |")
    if args.trace:  # the last world size's rank 0
        print_traces(traces, BASELINE[args.engine], gradient_bytes, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine, "tensors": tensors,
                                               "seconds": {v: {str(w): t for w, t in r.items()} for v, r in rows.items()},
                                               **({"per_step": traces} if args.trace else {})}))


if __name__ == "__main__":
    main()
