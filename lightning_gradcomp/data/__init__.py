"""LightningDataModules that read the datasets' own file formats (no torchvision)."""

from lightning_gradcomp.data.base import ArrayImageDataset, SplitDataModule
from lightning_gradcomp.data.cifar import CIFAR10DataModule
from lightning_gradcomp.data.digits import DigitsDataModule
from lightning_gradcomp.data.files import DatasetNotFoundError
from lightning_gradcomp.data.idx import read_idx, write_idx
from lightning_gradcomp.data.imagefolder import ImageFolder, ImageFolderDataModule
from lightning_gradcomp.data.mnist import FashionMNISTDataModule, MNISTDataModule
from lightning_gradcomp.data.parallel_text import ParallelTextDataModule, Vocab
from lightning_gradcomp.data.shakespeare import TinyShakespeareDataModule
from lightning_gradcomp.data.text import ByteTokenizer, StdlibSourceDataModule, TokenWindows, WikiTextDataModule

__all__ = [
    "ArrayImageDataset",
    "ByteTokenizer",
    "CIFAR10DataModule",
    "DatasetNotFoundError",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "ImageFolder",
    "ImageFolderDataModule",
    "MNISTDataModule",
    "ParallelTextDataModule",
    "SplitDataModule",
    "StdlibSourceDataModule",
    "TinyShakespeareDataModule",
    "TokenWindows",
    "Vocab",
    "WikiTextDataModule",
    "read_idx",
    "write_idx",
]
