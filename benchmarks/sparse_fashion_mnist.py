"""Gradient Dropping and AdaComp on Fashion-MNIST with 2 real Gloo ranks: accuracy vs plain DDP, and the
measured compression rate per layer type (convolution vs fully connected).

Each rank trains the AdaComp paper's MNIST-CNN (conv20-conv50-fc500-fc10) with plain ``DistributedDataParallel``
and our ``gradcomp_hook``, on its half of a fixed training subset; rank 0 evaluates the full 10k test set.
The compression rate of a layer is fp32 bytes over the payload bytes this rank sent for it, summed over all
steps (the paper's "effective compression rate"; the hook's per-bucket size exchange, 8 bytes per tensor, is
not included).

Usage: python benchmarks/sparse_fashion_mnist.py [--train-size 20000] [--epochs 2] [--batch 50] [--out FILE]
"""

import argparse
import os
import pickle
import platform
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` as a package
from benchmarks._sparse_common import fashion_mnist, mnist_cnn
from lightning_gradcomp import GradCompState, gradcomp_hook
from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.adacomp import layer_kind

CONFIGS = {
    "ddp": lambda: None,
    "graddrop": lambda: GradientDropping(),
    "graddrop-global": lambda: GradientDropping(scope="global"),
    "graddrop-delta16-bf16": lambda: GradientDropping(index_encoding="delta16", values="bf16"),
    "adacomp": lambda: AdaComp(),
    "adacomp-LS": lambda: AdaComp(selection="local"),
}


def _run(rank: int, world: int, config: str, args: argparse.Namespace) -> dict[str, Any]:
    images, labels = fashion_mnist("train")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[: args.train_size]
    mine = order[rank::world]  # each rank its half
    model = mnist_cnn()
    ddp = DistributedDataParallel(model)
    compressor = CONFIGS[config]()
    state = None
    if compressor is not None:
        compressor.setup(rank, world, torch.device("cpu"))
        state = GradCompState(compressor=compressor, names={id(p): n for n, p in model.named_parameters()}, world_size=world)
        ddp.register_comm_hook(state, gradcomp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    sent: dict[str, int] = defaultdict(int)
    dense: dict[str, int] = defaultdict(int)
    per_bin: dict[str, list[float]] = defaultdict(list)
    gen = torch.Generator().manual_seed(1 + rank)
    start = time.perf_counter()
    for _ in range(args.epochs):
        perm = mine[torch.randperm(len(mine), generator=gen)]
        for i in range(0, len(perm) - args.batch + 1, args.batch):
            batch = perm[i : i + args.batch]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(images[batch]), labels[batch]).backward()
            opt.step()
            if state is not None:
                for name, record in state.ledger.records.items():
                    sent[name] += record.nbytes
                    dense[name] += 4 * record.numel
                    if "sent_per_bin" in record.stats:
                        per_bin[name].append(float(record.stats["sent_per_bin"]))
    elapsed = time.perf_counter() - start
    accuracy = float("nan")
    if rank == 0:
        test_x, test_y = fashion_mnist("test")
        with torch.no_grad():
            accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    shapes = {n: p.shape for n, p in model.named_parameters()}
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    del ddp, opt
    dist.barrier()
    return {"accuracy": accuracy, "seconds": elapsed, "sent": dict(sent), "dense": dict(dense), "shapes": shapes,
            "per_bin": {n: sum(v) / len(v) for n, v in per_bin.items()}, "params": params}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # plain pickle: torch's queue pickler passes shared-memory handles that vanish when this process exits
        queue.put((rank, pickle.dumps({c: _run(rank, world, c, args) for c in args.configs})))
    finally:
        dist.destroy_process_group()


def _kind(name: str, shape: torch.Size) -> str:
    return "bias" if len(shape) < 2 else layer_kind(name, shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=50, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=None, help="also store the tables here (Markdown, with the "
                        "command and machine: benchmarks/results/micro/sparse_fashion_mnist.md)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: pickle.loads(blob) for rank, blob in (queue.get() for _ in procs)}
    for p in procs:
        p.join()
    r0, r1 = results[0], results[1]
    lines = [f"# command: `python benchmarks/sparse_fashion_mnist.py --train-size {args.train_size} "
             f"--epochs {args.epochs} --batch {args.batch} --lr {args.lr}`",
             f"# machine: {platform.node()} {platform.machine()}, torch {torch.__version__}, 2 Gloo ranks x 1 thread",
             f"# Fashion-MNIST, {args.train_size} training images, full 10k test set",
             "| run | test accuracy | replicas identical | seconds | conv rate | fc rate | bias rate | all layers |",
             "|---|---|---|---|---|---|---|---|"]
    for config in args.configs:
        res = r0[config]
        same = torch.equal(res["params"], r1[config]["params"])
        if not res["sent"]:
            lines.append(f"| {config} | {res['accuracy']:.4f} | {same} | {res['seconds']:.0f} | 1 | 1 | 1 | 1 |")
            continue
        by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for name, nbytes in res["sent"].items():
            kind = _kind(name, res["shapes"][name])
            by_kind[kind][0] += res["dense"][name]
            by_kind[kind][1] += nbytes
        rate = {k: d / max(s, 1) for k, (d, s) in by_kind.items()}
        total = sum(res["dense"].values()) / max(sum(res["sent"].values()), 1)
        lines.append(f"| {config} | {res['accuracy']:.4f} | {same} | {res['seconds']:.0f} | {rate['conv']:.1f}x | "
                     f"{rate['fc']:.1f}x | {rate['bias']:.1f}x | {total:.1f}x |")
    lines += ["", "# Per layer (rank 0): fp32 bytes / payload bytes; AdaComp: mean entries sent per bin"]
    layer_configs = [c for c in args.configs if r0[c]["sent"]]
    lines += ["| layer | kind | elements | " + " | ".join(layer_configs) + " |",
              "|---|---|---|" + "---|" * len(layer_configs)]
    shapes = r0[args.configs[0]]["shapes"]
    for name, shape in shapes.items():
        cells = []
        for c in layer_configs:
            res = r0[c]
            cell = f"{res['dense'][name] / max(res['sent'][name], 1):.1f}x"
            if name in res["per_bin"]:
                cell += f" ({res['per_bin'][name]:.2f}/bin)"
            cells.append(cell)
        lines.append(f"| {name} | {_kind(name, shape)} | {shape.numel()} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:  # the stored tables docs/compressors.md shows (tools/results_tables.py)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
