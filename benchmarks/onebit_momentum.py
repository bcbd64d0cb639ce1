"""OneBit (1-bit SGD with error feedback) against fp32 under SGD momentum, N workers emulated in one process.

The model of the audit that found OneBit diverging (issue 21): parameter tensors of 1, 7 and 1,000,003 elements,
3 workers, 200 steps. Each worker's loss is the noisy quadratic 0.5 * sum((p - target - noise)^2) (fresh noise per
worker and step; curvature 1 in every element, so lr / (1 - momentum) is every element's effective step), so fp32
converges for every learning rate used here and any gap is the compressor's. Reported: the loss per element. Workers run through :class:`~lightning_gradcomp.strategies.towers.TowerStrategy`: the real compressors,
residuals and decoding, exactly as the hook combines them.

    PYTHONPATH=. python benchmarks/onebit_momentum.py                      # the audit's sizes
    PYTHONPATH=. python benchmarks/onebit_momentum.py --sizes 1 7 1000     # the unit test's sizes
"""

import argparse
import logging
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_gradcomp.strategies.towers import TowerStrategy

NOISE = 0.5


class NoisyQuadratic(LightningModule):
    """Tensors of the given sizes pulled towards fixed targets through per-sample noise (a sample is a seed)."""

    def __init__(self, sizes: list[int], lr: float, momentum: float) -> None:
        super().__init__()
        targets = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])
        for i, n in enumerate(sizes):
            self.register_buffer(f"target{i}", torch.randn(n, generator=targets))
        self.lr, self.momentum = lr, momentum
        self.losses: list[float] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = torch.zeros(())
        for seed in batch.tolist():  # one sample: one fresh noise draw per tensor
            noise = torch.Generator().manual_seed(int(seed))
            for i, p in enumerate(self.weights):
                target = getattr(self, f"target{i}") + NOISE * torch.randn(p.shape, generator=noise)
                loss = loss + 0.5 * ((p - target) ** 2).sum()
        loss = loss / len(batch)
        self.losses.append(float(loss) / sum(p.numel() for p in self.weights))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def final_loss(compressor: str, sizes: list[int], lr: float, momentum: float, steps: int = 200, workers: int = 3) -> float:
    """The mean training loss of the last 10 steps with ``workers`` emulated workers (one sample each)."""
    torch.manual_seed(0)
    model = NoisyQuadratic(sizes, lr, momentum)
    seeds: DataLoader[torch.Tensor] = DataLoader(torch.arange(steps * workers), batch_size=workers)  # type: ignore[arg-type]  # a tensor is a map-style dataset
    trainer = Trainer(
        strategy=TowerStrategy(workers, compressor), max_steps=steps, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OneBit's heavy-momentum warning is what this measures
        trainer.fit(model, seeds)
    return sum(model.losses[-10:]) / 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 7, 1_000_003])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(f"sizes {args.sizes}, 3 workers, {args.steps} steps; final loss (mean of the last 10 steps)")
    print("| momentum | lr | lr / (1 - momentum) | fp32 | onebit |")
    print("|---|---|---|---|---|")
    for momentum, lr in ((0.0, 0.5), (0.5, 0.25), (0.7, 0.15), (0.8, 0.1), (0.9, 0.05), (0.9, 0.025), (0.9, 0.01)):
        row = [final_loss(c, args.sizes, lr, momentum, args.steps) for c in ("fp32", "onebit")]
        print(f"| {momentum} | {lr} | {lr / (1 - momentum):.2f} | {row[0]:.3f} | {row[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
