"""Shared datamodule plumbing: argument checks, the train/val split and the DataLoaders."""

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_gradcomp.validation import check_int


class ArrayImageDataset(Dataset):
    """Images held in memory as one tensor, transformed per sample on access.

    Args:
        images: ``(N, C, H, W)`` tensor, usually uint8 so that memory stays at one byte per pixel.
        labels: ``(N,)`` int64 class indices.
        transform: applied to each ``(C, H, W)`` image when it is read.
    """

    def __init__(self, images: Tensor, labels: Tensor, transform: Optional[Callable[[Tensor], Tensor]] = None) -> None:
        if len(images) != len(labels):
            raise ValueError(f"Expected as many labels as images, but got {len(labels)} and {len(images)}.")
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = self.images[index]
        return (self.transform(image) if self.transform else image), self.labels[index]


def split_indices(n: int, val_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded random split of ``range(n)`` into ``(train, val)`` with ``len(val) == val_size``.

    The permutation depends only on ``seed``, so every rank of a DDP run holds out the same samples.
    """
    if not 0 <= val_size < n:
        raise ValueError(f"Expected `val_size` to be in [0, {n}), but got {val_size}. Fix: hold out fewer samples.")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[val_size:], order[:val_size]


class SplitDataModule(LightningDataModule):
    """Base for the datamodules: subclasses fill ``train_set``, ``val_set`` and ``test_set`` in :meth:`_build`.

    Args:
        data_dir: where the dataset's files are (or are downloaded to).
        batch_size: samples per batch *per process* (DDP gives every rank its own batches).
        num_workers: DataLoader worker processes (0 loads in the training process).
        download: fetch missing files from the official URL in :meth:`prepare_data` (needs internet).
        seed: seeds the train/val split, identical on every rank.
    """

    def __init__(self, data_dir: str, batch_size: int, num_workers: int, download: bool, seed: int) -> None:
        super().__init__()
        check_int("batch_size", batch_size, minimum=1)
        check_int("num_workers", num_workers, minimum=0)
        check_int("seed", seed)
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size, self.num_workers, self.download, self.seed = batch_size, num_workers, download, seed
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self.test_set: Optional[Dataset] = None
        self.collate_fn: Optional[Callable[[list[Any]], Any]] = None

    def _download(self) -> None:
        raise ValueError(f"`download=True` is not supported by {type(self).__name__}; put the files in {self.data_dir}.")

    def _build(self) -> None:
        raise NotImplementedError

    @override
    def prepare_data(self) -> None:
        # runs on one process per node only: the right place for network and disk writes
        if self.download:
            self._download()

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self._build()

    def _loader(self, dataset: Optional[Dataset], shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before asking for a DataLoader.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
