"""Closing-note table: every registered compressor on one small real task, 2 Gloo ranks.

Trains the same MLP on scikit-learn's digits (8x8 images, 10 classes; 1437 train / 360 test) for a few epochs
with each compressor name registered in :mod:`lightning_gradcomp.registry` *at run time* (so compressors added
later appear without editing this file), plus Lightning's stock ``"ddp"`` for reference, and prints test
accuracy, bytes per step per rank (``trainer.strategy.comm_state.last_step_bytes()``: payloads plus shared
statistics of the last step), and the compression ratio against fp32.

Each compressor runs with its registered defaults and the same optimizer (SGD, lr 0.1, momentum 0.9), except
the ``dgc+mc+warmup`` row, which is DGC as the paper uses it: momentum correction (optimizer momentum 0),
the paper's sparsity warm-up over the first epochs, and local gradient clipping.

    python benchmarks/baselines.py                 # all registered names
    python benchmarks/baselines.py --epochs 3 --names fp32 dgc
"""

import argparse
import hashlib
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# measure this checkout, not whatever lightning_gradcomp is installed (spawned ranks inherit sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXTRA_ROWS = ("dgc+mc+warmup",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    as_float = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_float(x_train), torch.tensor(y_train), as_float(x_test), torch.tensor(y_test)


def _rank(rank: int, world_size: int, port: int, name: str, epochs: int, seed: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", _train(world_size, name, epochs, seed)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _train(world_size: int, name: str, epochs: int, seed: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gradcomp  # noqa: F401  (registers the strategy names)
    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.callbacks import CompressionSchedule, LocalGradientClipping, MomentumCorrection

    pl.seed_everything(seed, verbose=False)
    x_train, y_train, x_test, y_test = _digits(seed)
    momentum = 0.9
    callbacks: list[Any] = []
    strategy: Any = name
    if name == "dgc+mc+warmup":
        strategy = GradCompStrategy("dgc")
        callbacks = [LocalGradientClipping(max_norm=5.0), MomentumCorrection(momentum=0.9),
                     CompressionSchedule.dgc_warmup()]
        momentum = 0.0

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=momentum)

    model = MLP()
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=32, shuffle=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        accuracy = (model.net(x_test).argmax(1) == y_test).float().mean().item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = getattr(trainer.strategy, "comm_state", None)
    return {
        "accuracy": accuracy,
        "bytes": state.last_step_bytes() if state is not None else None,
        "dense_bytes": state.dense_bytes_per_step() if state is not None else 4 * params.numel(),
        "steps": trainer.global_step,
        "seconds": seconds,
        "replica": hashlib.sha256(params.numpy().tobytes()).hexdigest()[:12],
    }


def run(name: str, epochs: int, seed: int, world_size: int = 2, timeout: float = 600.0) -> dict[str, Any]:
    """Train one configuration on ``world_size`` spawned Gloo ranks; rank 0's result plus a replica check."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, name, epochs, seed, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    error = None
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                error = value
                break
            results[rank] = value
    except Exception as exc:
        error = f"no result within {timeout}s ({exc!r})"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        return {"error": error.strip().splitlines()[-1]}
    out = dict(results[0])
    out["identical"] = len({r["replica"] for r in results.values()}) == 1
    return out


def main() -> None:
    from lightning_gradcomp import registry

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--names", nargs="*", default=None, help="default: ddp, every registered name, extra rows")
    args = parser.parse_args()
    names = args.names or ["ddp", *registry.compressor_names(), *EXTRA_ROWS]

    print(f"# digits MLP 64-128-128-10, 2 Gloo ranks, batch 32/rank, {args.epochs} epochs, seed {args.seed}")
    print(f"# command: python benchmarks/baselines.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    rows = []
    for name in names:
        result = run(name, args.epochs, args.seed)
        rows.append((name, result))
        print(f"  done {name}: {result}", file=sys.stderr, flush=True)
    fp32 = next((r["bytes"] for n, r in rows if n == "fp32" and "error" not in r), None)
    print()
    print("| strategy | test accuracy | bytes/step/rank | ratio vs fp32 | replicas identical |")
    print("|---|---:|---:|---:|:---:|")
    for name, r in rows:
        if "error" in r:
            print(f"| {name} | failed: {r['error'][:80]} | | | |")
            continue
        sent = r["bytes"] if r["bytes"] is not None else r["dense_bytes"]
        note = "" if r["bytes"] is not None else " (stock, dense)"
        reference = fp32 if fp32 is not None else r["dense_bytes"]
        print(f"| {name} | {100 * r['accuracy']:.2f}% | {sent:,}{note} | {reference / sent:.1f}x | "
              f"{'yes' if r['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()
