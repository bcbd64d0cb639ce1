"""LightningDataModules that read the datasets' own file formats (no torchvision)."""

from gradcomp_lab.data.base import ArrayImageDataset, SplitDataModule
from gradcomp_lab.data.cifar import CIFAR10DataModule
from gradcomp_lab.data.digits import DigitsDataModule
from gradcomp_lab.data.files import DatasetNotFoundError
from gradcomp_lab.data.idx import read_idx, write_idx
from gradcomp_lab.data.imagefolder import ImageFolder, ImageFolderDataModule
from gradcomp_lab.data.mnist import FashionMNISTDataModule, MNISTDataModule
from gradcomp_lab.data.parallel_text import ParallelTextDataModule, Vocab
from gradcomp_lab.data.pieces import PieceTokenizer, StdlibPieceDataModule
from gradcomp_lab.data.shakespeare import TinyShakespeareDataModule
from gradcomp_lab.data.text import ByteTokenizer, StdlibSourceDataModule, TokenWindows, WikiTextDataModule

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
    "PieceTokenizer",
    "SplitDataModule",
    "StdlibPieceDataModule",
    "StdlibSourceDataModule",
    "TinyShakespeareDataModule",
    "TokenWindows",
    "Vocab",
    "WikiTextDataModule",
    "read_idx",
    "write_idx",
]
