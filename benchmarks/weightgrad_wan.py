"""Time to a target accuracy: plain DDP vs TernGrad vs WeightGrad, ranks split into sites.

Every strategy runs in the same world of ranks, one after another, so the ratios are measured side by side.
Rank 0 prints the table.

Two ways to run:

* locally, it launches its own ranks over loopback (no rate limits)::

      python benchmarks/weightgrad_wan.py --nproc 4 --sites 2

* under the emulated-cluster launcher (each rank runs the script; rank and world come from the environment)::

      python -m gradcomp_lab.emulate --nproc 4 --bandwidth 1gbit --sites 2 --wan-bandwidth 100mbit -- \
          python benchmarks/weightgrad_wan.py --worker --sites 2

Task: an MLP on scikit-learn's digits (default; 1437 train / 360 validation images, 8x8) or Fashion-MNIST
(``--dataset fashion``, read from ``/usr/share/datasets/fashion-mnist``). The clock counts training time only:
it stops while the validation accuracy is measured at the end of each epoch (on rank 0's replica, which for
WeightGrad is site 0's current model).
"""

import argparse
import ast
import gzip
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# run from a checkout: the package next to this folder, not an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STRATEGIES = ("ddp", "terngrad", "weightgrad")
FASHION = Path("/usr/share/datasets/fashion-mnist")


def _load(dataset: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if dataset == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        order = np.random.default_rng(0).permutation(len(x))
        x, y = x[order], y[order]
        cut = int(0.8 * len(x))
        return x[:cut], y[:cut], x[cut:], y[cut:]

    def idx(name: str) -> np.ndarray:
        with gzip.open(FASHION / name, "rb") as f:
            data = f.read()
        dims = data[3]
        shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)

    xtr = idx("train-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255.0
    xte = idx("t10k-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255.0
    return xtr, idx("train-labels-idx1-ubyte.gz").astype(np.int64), xte, idx("t10k-labels-idx1-ubyte.gz").astype(np.int64)


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gradcomp  # noqa: F401  (registers the strategy names)
    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.weightgrad import WeightGradStrategy

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    xtr, ytr, xva, yva = _load(args.dataset)
    train = TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr).long())
    xva_t, yva_t = torch.from_numpy(xva), torch.from_numpy(yva).long()

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            d = xtr.shape[1]
            h = args.hidden
            self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

    class TimeToAccuracy(Callback):
        def __init__(self) -> None:
            self.train_time = 0.0
            self.steps = 0
            self.curve: list[tuple[float, float]] = []
            self.reached: float | None = None
            self.wan_bytes = 0
            self.lan_bytes = 0

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            self.steps += 1
            stats = getattr(trainer.strategy, "stats", None)
            if stats:
                self.wan_bytes += int(stats["wan_bytes"])
                self.lan_bytes += int(stats["lan_bytes"])
            else:
                state = getattr(trainer.strategy, "comm_state", None)
                self.wan_bytes += state.last_step_bytes() if state else 4 * sum(p.numel() for p in trainer.lightning_module.parameters())

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.train_time += time.perf_counter() - self._start
            with torch.no_grad():
                acc = (pl_module(xva_t).argmax(1) == yva_t).float().mean()
            acc = float(trainer.strategy.broadcast(acc, src=0))
            self.curve.append((round(self.train_time, 3), round(acc, 4)))
            if acc >= args.target and self.reached is None:
                self.reached = self.train_time
                trainer.should_stop = True

    site_size = world // args.sites
    options = {kv.split("=", 1)[0]: ast.literal_eval(kv.split("=", 1)[1]) for kv in args.wg}
    rows = []
    for name in args.strategies:
        if name == "ddp":
            strategy: Any = "ddp"
        elif name == "terngrad":
            strategy = GradCompStrategy(compressor="terngrad")
        else:
            strategy = WeightGradStrategy(site_size=site_size, allow_single_rank_sites=site_size == 1, **options)
        clock = TimeToAccuracy()
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_epochs=args.max_epochs, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
        )
        trainer.fit(MLP(), DataLoader(train, batch_size=args.batch_size, shuffle=True))
        if name == "weightgrad":
            assert isinstance(trainer.strategy, WeightGradStrategy)
            rounds = int(trainer.strategy.stats["wan_rounds"])
        else:
            rounds = clock.steps
        rows.append({
            "strategy": name, "time_to_target_s": clock.reached, "train_time_s": round(clock.train_time, 3),
            "epochs": len(clock.curve), "steps": clock.steps, "final_acc": clock.curve[-1][1],
            "wan_rounds": rounds, "rank0_wan_bytes_per_step": clock.wan_bytes // max(clock.steps, 1),
            "rank0_lan_bytes_per_step": clock.lan_bytes // max(clock.steps, 1), "curve": clock.curve,
        })
    if rank == 0:
        _print_table(rows, args, world)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "world": world, "rows": rows}, indent=1))


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    print(f"\n# weightgrad_wan: {args.dataset}, MLP hidden {args.hidden}, {world} ranks in {args.sites} sites, "
          f"target {args.target:.2%}, batch {args.batch_size}/rank, lr {args.lr}, weightgrad options {args.wg or 'defaults'}")
    print(f"# machine: {platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"# command: {os.environ.get('WEIGHTGRAD_WAN_COMMAND') or ' '.join(['python', *sys.argv])}")
    base = next((r["time_to_target_s"] for r in rows if r["strategy"] == "ddp"), None)
    print("| strategy | time to target (s) | vs ddp | epochs | steps | WAN rounds | final acc | rank-0 WAN bytes/step (ddp, terngrad: all it sends) | rank-0 LAN bytes/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["time_to_target_s"]
        ratio = f"{base / t:.2f}x" if base and t else "-"
        shown = f"{t:.2f}" if t is not None else f"not reached ({r['train_time_s']:.1f})"
        print(f"| {r['strategy']} | {shown} | {ratio} | {r['epochs']} | {r['steps']} | {r['wan_rounds']} | "
              f"{r['final_acc']:.4f} | {r['rank0_wan_bytes_per_step']} | {r['rank0_lan_bytes_per_step']} |")


def _launch(args: argparse.Namespace, argv: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc), NODE_RANK="0", OMP_NUM_THREADS="1",
                   WEIGHTGRAD_WAN_COMMAND=" ".join(["python", *sys.argv]))
        out = None if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *argv], env=env, stdout=out, stderr=out))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="run as one rank (RANK/WORLD_SIZE from the environment)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks to launch locally (without --worker)")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--dataset", choices=("digits", "fashion"), default="digits")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--wg", nargs="*", default=[], metavar="KEY=VALUE",
                        help="WeightGradStrategy options, e.g. staleness_bound=8 wan_quantization='none'")
    parser.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
    else:
        argv = [a for a in sys.argv[1:] if a != "--worker"]
        _launch(args, argv)


if __name__ == "__main__":
    main()
