"""MNIST and Fashion-MNIST from their IDX files (``train-images-idx3-ubyte[.gz]`` and friends)."""

from pathlib import Path
from typing import Literal, Optional

import torch
from typing_extensions import override

from gradcomp_lab.data.base import ArrayImageDataset, SplitDataModule, split_indices
from gradcomp_lab.data.files import download_url, find_file, require_files
from gradcomp_lab.data.idx import read_idx
from gradcomp_lab.data.transforms import Compose, Standardize, Symmetric, ToUnit
from lightning_gradcomp.validation import check_choice, check_int

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
Normalization = Literal["symmetric", "unit", "mean_std"]


def mnist_transform(normalize: str, mean: float, std: float) -> Compose:
    """uint8 pixels to float: ``"unit"`` [0, 1] (Caffe's 1/256-style scale), ``"symmetric"`` [-1, 1]
    (TernGrad's ``(x - 0.5) * 2``) or ``"mean_std"`` (dataset mean and std)."""
    steps: list[object] = [ToUnit()]
    if normalize == "symmetric":
        steps.append(Symmetric())
    elif normalize == "mean_std":
        steps.append(Standardize([mean], [std]))
    return Compose(steps)


class MNISTDataModule(SplitDataModule):
    """MNIST (60k train, 10k test, 28x28 grey) read from the four IDX files, plain or gzipped.

    Args:
        data_dir: directory holding ``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
            ``t10k-images-idx3-ubyte[.gz]`` and ``t10k-labels-idx1-ubyte[.gz]``.
        batch_size: samples per batch per process.
        num_workers: DataLoader workers.
        download: fetch the four ``.gz`` files (MD5-checked) if missing.
        val_size: training images held out for validation; 0 validates on the test split instead (the
            papers report test accuracy).
        normalize: ``"symmetric"`` (TernGrad LeNet: [0, 1] then ``(x - 0.5) * 2``), ``"unit"`` ([0, 1]),
            or ``"mean_std"``.
        seed: seeds the train/val split.
    """

    base_url = "https://ossci-datasets.s3.amazonaws.com/mnist/"
    md5 = {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    }
    mean, std = 0.1307, 0.3081
    name = "MNIST"
    num_classes = 10

    def __init__(
        self,
        data_dir: Optional[str] = "data/mnist",
        batch_size: int = 64,
        num_workers: int = 0,
        download: bool = False,
        val_size: int = 5000,
        normalize: Normalization = "symmetric",
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir or self._default_dir(), batch_size, num_workers, download, seed)
        check_int("val_size", val_size, minimum=0)
        check_choice("normalize", normalize, ("symmetric", "unit", "mean_std"))
        self.val_size, self.normalize = val_size, normalize

    def _default_dir(self) -> str:
        return "data/mnist"

    @override
    def _download(self) -> None:
        for file_name, md5 in self.md5.items():
            if find_file(self.data_dir, file_name.removesuffix(".gz")) is None:
                download_url(self.base_url + file_name, self.data_dir / file_name, md5)

    def load_arrays(self) -> dict[str, torch.Tensor]:
        """The four IDX files as tensors: images ``(N, 1, 28, 28)`` uint8, labels ``(N,)`` int64.

        Raises:
            DatasetNotFoundError: files are missing; the message names ``data_dir`` and the fix.
        """
        paths = require_files(
            self.name,
            self.data_dir,
            list(IDX_FILES.values()),
            fix=f"pass `download=True` (needs internet) or copy the IDX files into {str(self.data_dir)!r}",
            allow_gz=True,
        )
        arrays = {key: torch.from_numpy(read_idx(path)) for key, path in zip(IDX_FILES, paths)}
        for split in ("train", "test"):
            arrays[f"{split}_images"] = arrays[f"{split}_images"].unsqueeze(1)
            arrays[f"{split}_labels"] = arrays[f"{split}_labels"].long()
        return arrays

    @override
    def _build(self) -> None:
        arrays = self.load_arrays()
        transform = mnist_transform(self.normalize, self.mean, self.std)
        images, labels = arrays["train_images"], arrays["train_labels"]
        self.test_set = ArrayImageDataset(arrays["test_images"], arrays["test_labels"], transform)
        if self.val_size == 0:
            self.train_set = ArrayImageDataset(images, labels, transform)
            self.val_set = self.test_set
        else:
            train, val = split_indices(len(images), self.val_size, self.seed)
            self.train_set = ArrayImageDataset(images[train], labels[train], transform)
            self.val_set = ArrayImageDataset(images[val], labels[val], transform)


DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


class FashionMNISTDataModule(MNISTDataModule):
    """Fashion-MNIST (Zalando; same IDX layout and sizes as MNIST).

    ``data_dir=None`` (the default) uses the Debian package's copy in ``/usr/share/datasets/fashion-mnist/``
    (``apt-get install dataset-fashion-mnist``) when it is there, else ``data/fashion-mnist``.
    Other arguments as :class:`MNISTDataModule`.
    """

    base_url = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
    md5 = {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    }
    mean, std = 0.2860, 0.3530
    name = "Fashion-MNIST"

    def __init__(
        self,
        data_dir: Optional[str] = None,
        batch_size: int = 64,
        num_workers: int = 0,
        download: bool = False,
        val_size: int = 5000,
        normalize: Normalization = "symmetric",
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, val_size, normalize, seed)

    @override
    def _default_dir(self) -> str:
        return str(DEBIAN_FASHION_MNIST) if DEBIAN_FASHION_MNIST.is_dir() else "data/fashion-mnist"
