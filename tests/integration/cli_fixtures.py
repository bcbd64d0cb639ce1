"""Small importable classes for CLI tests (class_path targets)."""

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from tests.distributed.lightning_ranks import TinyClassifier, random_loader

__all__ = ["RandomDataModule", "TinyClassifier"]


class RandomDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return random_loader(batch_size=self.batch_size)
