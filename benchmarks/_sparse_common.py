"""Shared by the sparse benchmarks: a private Fashion-MNIST IDX reader and the AdaComp paper's MNIST-CNN.

The package's own data module is being written elsewhere; this reader only exists so the benchmarks run now.
"""

import gzip
import struct
from pathlib import Path

import torch
from torch import nn

FASHION = Path("/usr/share/datasets/fashion-mnist")


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (optionally gzipped) as a uint8 tensor of its declared shape."""
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    dims = raw[3]
    shape = struct.unpack(">" + "I" * dims, raw[4 : 4 + 4 * dims])
    return torch.frombuffer(bytearray(raw[4 + 4 * dims :]), dtype=torch.uint8).reshape(shape)


def fashion_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 [N, 1, 28, 28] in [0, 1] (normalised by the train mean and std) and int64 labels."""
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(FASHION / f"{prefix}-images-idx3-ubyte.gz").float().div_(255).unsqueeze(1)
    labels = read_idx(FASHION / f"{prefix}-labels-idx1-ubyte.gz").long()
    return (images - 0.2860) / 0.3530, labels


def mnist_cnn() -> nn.Module:
    """The AdaComp paper's MNIST-CNN (Caffe LeNet: conv20, conv50, fc500, fc10; VALID padding), 431K parameters."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(20, 50, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, 10),
    )
