"""CIFAR-10 from the python pickle batches of ``cifar-10-python.tar.gz``."""

import pickle
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from typing_extensions import override

from gradcomp_lab.data.base import ArrayImageDataset, SplitDataModule, split_indices
from gradcomp_lab.data.files import download_url, extract_archive, require_files
from gradcomp_lab.data.transforms import (
    CenterCrop,
    Compose,
    PerImageStandardize,
    RandomBrightness,
    RandomContrast,
    RandomCrop,
    RandomHorizontalFlip,
    Standardize,
    ToUnit,
)
from lightning_gradcomp.validation import check_choice, check_int

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
BATCHES_DIR = "cifar-10-batches-py"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One pickled batch as ``(images (N, 3, 32, 32) uint8, labels (N,) int64)``.

    The batches were pickled by Python 2, so keys come back as bytes.
    """
    with open(path, "rb") as handle:
        entry = pickle.load(handle, encoding="bytes")
    data = np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = entry.get(b"labels", entry.get(b"fine_labels"))
    return torch.from_numpy(data.copy()), torch.as_tensor(labels, dtype=torch.long)


class CIFAR10DataModule(SplitDataModule):
    """CIFAR-10 (50k train, 10k test, 32x32 RGB) with the TF CIFAR-10 tutorial's pipeline by default.

    Training: random ``crop_size`` crop (after ``padding`` zeros), random flip, brightness +-63/255 and
    contrast in [0.2, 1.8] (``color_jitter``), then ``normalize``. Evaluation: central ``crop_size`` crop,
    then ``normalize``. The defaults reproduce CifarNet's input (24x24, per-image standardisation);
    ``crop_size=32, padding=4, color_jitter=False, normalize="mean_std"`` is the common ResNet/VGG pipeline.

    Args:
        data_dir: directory holding ``cifar-10-batches-py/`` (or the batch files themselves).
        batch_size: samples per batch per process.
        num_workers: DataLoader workers.
        download: fetch and extract ``cifar-10-python.tar.gz`` (MD5-checked) if missing.
        val_size: training images held out for validation; 0 validates on the test split.
        crop_size: side of the training and evaluation crops (at most 32 + 2 * padding for training).
        padding: zero padding before the random training crop.
        random_flip: random horizontal flips in training.
        color_jitter: TF tutorial's random brightness and contrast in training.
        normalize: ``"per_image"`` (``tf.image.per_image_standardization``), ``"mean_std"`` (CIFAR-10
            channel statistics) or ``"unit"`` ([0, 1]).
        seed: seeds the train/val split.
    """

    url = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    archive_md5 = "c58f30108f718f92721af3b95e74349a"
    num_classes = 10

    def __init__(
        self,
        data_dir: str = "data/cifar10",
        batch_size: int = 128,
        num_workers: int = 0,
        download: bool = False,
        val_size: int = 5000,
        crop_size: int = 24,
        padding: int = 0,
        random_flip: bool = True,
        color_jitter: bool = True,
        normalize: Literal["per_image", "mean_std", "unit"] = "per_image",
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seed)
        check_int("val_size", val_size, minimum=0)
        check_int("crop_size", crop_size, minimum=1)
        check_int("padding", padding, minimum=0)
        if crop_size > 32:
            raise ValueError(f"Expected `crop_size` to be at most 32, but got {crop_size}. Fix: use 32 or less.")
        check_choice("normalize", normalize, ("per_image", "mean_std", "unit"))
        self.val_size, self.crop_size, self.padding = val_size, crop_size, padding
        self.random_flip, self.color_jitter, self.normalize = random_flip, color_jitter, normalize

    def _batches_dir(self) -> Path:
        nested = self.data_dir / BATCHES_DIR
        return nested if nested.is_dir() else self.data_dir

    @override
    def _download(self) -> None:
        if not (self._batches_dir() / TEST_BATCH).is_file():
            archive = download_url(self.url, self.data_dir / "cifar-10-python.tar.gz", self.archive_md5)
            extract_archive(archive, self.data_dir)

    def _normalization(self) -> list[object]:
        if self.normalize == "per_image":
            return [PerImageStandardize()]
        if self.normalize == "mean_std":
            return [Standardize(CIFAR10_MEAN, CIFAR10_STD)]
        return []

    def train_transform(self) -> Compose:
        """The training pipeline described in the class docstring."""
        steps: list[object] = [ToUnit(), RandomCrop(self.crop_size, self.padding)]
        if self.random_flip:
            steps.append(RandomHorizontalFlip())
        if self.color_jitter:
            # TF applies these to 0..255 floats with max_delta 63; on [0, 1] that is 63/255
            steps += [RandomBrightness(63.0 / 255.0), RandomContrast(0.2, 1.8)]
        return Compose(steps + self._normalization())

    def eval_transform(self) -> Compose:
        """Central crop and normalisation."""
        return Compose([ToUnit(), CenterCrop(self.crop_size), *self._normalization()])

    @override
    def _build(self) -> None:
        fix = f"pass `download=True` (needs internet) or extract cifar-10-python.tar.gz into {str(self.data_dir)!r}"
        paths = require_files("CIFAR-10", self._batches_dir(), [*TRAIN_BATCHES, TEST_BATCH], fix)
        parts = [read_cifar_batch(path) for path in paths[:-1]]
        images, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        test_images, test_labels = read_cifar_batch(paths[-1])
        train_tf, eval_tf = self.train_transform(), self.eval_transform()
        self.test_set = ArrayImageDataset(test_images, test_labels, eval_tf)
        if self.val_size == 0:
            self.train_set, self.val_set = ArrayImageDataset(images, labels, train_tf), self.test_set
        else:
            train, val = split_indices(len(images), self.val_size, self.seed)
            self.train_set = ArrayImageDataset(images[train], labels[train], train_tf)
            self.val_set = ArrayImageDataset(images[val], labels[val], eval_tf)
