"""scikit-learn's bundled 8x8 digits (1797 images, no download): the quickstart's dataset."""

from typing import Literal

import torch
from torch.utils.data import TensorDataset
from typing_extensions import override

from gradcomp_lab.data.base import SplitDataModule
from lightning_gradcomp.validation import check_choice, check_int


class DigitsDataModule(SplitDataModule):
    """8x8 grey digits, 10 classes, shipped inside scikit-learn; normalised once and kept as float tensors.

    Args:
        data_dir: unused (the data ships with scikit-learn); kept for a uniform signature.
        batch_size: samples per batch per process.
        num_workers: DataLoader workers (0 is fastest for this size).
        download: unused.
        val_size: images held out for validation.
        test_size: images held out for testing.
        normalize: ``"symmetric"`` ([-1, 1]) or ``"unit"`` ([0, 1]); pixels are 0..16 in the source.
        seed: seeds the split.
    """

    num_classes = 10

    def __init__(
        self,
        data_dir: str = "",
        batch_size: int = 32,
        num_workers: int = 0,
        download: bool = False,
        val_size: int = 180,
        test_size: int = 360,
        normalize: Literal["symmetric", "unit"] = "symmetric",
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seed)
        check_int("val_size", val_size, minimum=1)
        check_int("test_size", test_size, minimum=1)
        if val_size + test_size >= 1797:
            raise ValueError(f"Expected `val_size + test_size` below 1797, but got {val_size + test_size}.")
        check_choice("normalize", normalize, ("symmetric", "unit"))
        self.val_size, self.test_size, self.normalize = val_size, test_size, normalize

    @override
    def prepare_data(self) -> None:
        pass

    @override
    def _build(self) -> None:
        from sklearn.datasets import load_digits  # the `data` extra

        bunch = load_digits()
        images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
        if self.normalize == "symmetric":
            images = (images - 0.5) * 2.0
        labels = torch.as_tensor(bunch.target, dtype=torch.long)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.seed))
        test, val, train = order.split([self.test_size, self.val_size, len(images) - self.test_size - self.val_size])
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
        self.test_set = TensorDataset(images[test], labels[test])
