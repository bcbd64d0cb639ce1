"""Make the pictures of docs/monitoring.md: two short runs on scikit-learn's digits (TensorBoard logs), then
``gradcomp report``.

* ``terngrad``: TernGrad with the paper's settings (healthy);
* ``topk``: a deliberately too aggressive top-0.1% sparsifier with error feedback, whose residuals keep
  growing (unhealthy). The compressor lives here, not in the library: it exists only to
  show what an unhealthy run looks like.

Run from the repository root (about a minute on 2 cores)::

    python docs/monitoring_demo.py --out docs/img
"""

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.multiprocessing as mp
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.flat import Packet


class TopKWithFeedback(Compressor):
    """The ``density`` share of largest-magnitude elements (values and int32 indices), with error feedback."""

    aggregation = Aggregation.GATHER
    uses_memory = True

    def __init__(self, density: float) -> None:
        super().__init__()
        self.density = density

    def _k(self, numel: int) -> int:
        return max(1, int(numel * self.density))

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        flat = tensor.detach().reshape(-1).float()
        index = flat.abs().topk(self._k(flat.numel())).indices
        payload = torch.cat((flat[index].view(torch.uint8), index.int().view(torch.uint8)))
        density = torch.tensor(index.numel() / flat.numel())
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats={"sparsity": 1 - density})

    def decompress(self, packet: Packet) -> Tensor:
        k = self._k(packet.numel)
        raw = packet.payload
        values = raw[: 4 * k].clone().view(torch.float32)
        index = raw[4 * k :].clone().view(torch.int32).long()
        out = torch.zeros(packet.numel, dtype=torch.float32, device=raw.device)
        out[index] = values
        return out.to(packet.dtype).view(packet.shape)

    def describe(self) -> dict[str, Any]:
        return {"compressor": "TopKWithFeedback", "density": self.density}


def _rank(rank: int, world_size: int, port: int, run: str, log_dir: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.callbacks import CompressionMonitor
    from lightning_gradcomp.compressors import TernGrad

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)

    class Mlp(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    compressor = TernGrad() if run == "terngrad" else TopKWithFeedback(density=0.001)
    trainer = pl.Trainer(strategy=GradCompStrategy(compressor), accelerator="cpu", devices=world_size,
                         max_steps=steps, logger=TensorBoardLogger(log_dir, name=run, version=0), log_every_n_steps=5,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CompressionMonitor()])
    trainer.fit(Mlp(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="+", default=["terngrad", "topk"], choices=["terngrad", "topk"])
    args = parser.parse_args()
    from gradcomp_lab import report

    log_dir = tempfile.mkdtemp(prefix="gradcomp_demo_")
    ctx = mp.get_context("spawn")
    for run in args.runs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_rank, args=(r, 2, port, run, log_dir, args.steps)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"{run}: rank exited with {p.exitcode}")
        for path in report.render(Path(log_dir) / run / "version_0", args.out / run):
            print(path)


if __name__ == "__main__":
    main()
