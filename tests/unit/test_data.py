"""Datamodules read tiny files written in each dataset's real format; no network is used."""

import gzip
import pickle
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, TypeVar

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from gradcomp_lab.data import (
    CIFAR10DataModule,
    DatasetNotFoundError,
    DigitsDataModule,
    FashionMNISTDataModule,
    ImageFolderDataModule,
    MNISTDataModule,
    ParallelTextDataModule,
    TinyShakespeareDataModule,
    Vocab,
    read_idx,
    write_idx,
)
from gradcomp_lab.data.base import ArrayImageDataset
from gradcomp_lab.data.files import download_url, extract_archive, md5sum
from gradcomp_lab.data.imagefolder import ImageFolder
from gradcomp_lab.data.mnist import DEBIAN_FASHION_MNIST
from gradcomp_lab.data.text import TokenWindows
from gradcomp_lab.data.transforms import PerImageStandardize, RandomContrast, RandomResizedCrop

D = TypeVar("D", bound=Dataset)


def _built(dataset: Optional[Dataset], kind: type[D]) -> D:
    """``dataset`` as the class ``setup`` builds it: the datamodules declare their splits ``Optional[Dataset]``."""
    assert isinstance(dataset, kind), f"Expected a {kind.__name__} but got {type(dataset).__name__}"
    return dataset


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # 2 shared cores: OpenMP spinning across threads makes tiny ops ~40x slower under load
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- IDX

IDX_CODES: dict[type, int] = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path: Path, dtype: type, suffix: str) -> None:
    array: np.ndarray = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5)
    path = tmp_path / f"a-idx3-ubyte{suffix}"
    write_idx(path, array)
    raw = gzip.decompress(path.read_bytes()) if suffix else path.read_bytes()
    assert raw[:4] == bytes([0, 0, IDX_CODES[dtype], 3])
    assert raw[4:16] == b"\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x05"  # big-endian dims
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.shape == (2, 3, 5)
    np.testing.assert_array_equal(back, array)


def test_idx_rejects_garbage_and_truncation(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "ok", np.zeros((4, 4), np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "ok").read_bytes()[:-3])
    with pytest.raises(ValueError, match="data bytes"):
        read_idx(tmp_path / "short")
    with pytest.raises(ValueError, match="IDX dtype"):
        write_idx(tmp_path / "x", np.zeros(3, np.uint64))


# ---------------------------------------------------------------- MNIST / Fashion-MNIST


def _write_mnist(root: Path, n_train: int = 12, n_test: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),  # plain, not gzipped
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for name, array in arrays.items():
        write_idx(root / name, array)
    return arrays


def test_mnist_reads_idx_and_normalises(tmp_path: Path) -> None:
    arrays = _write_mnist(tmp_path)
    dm = MNISTDataModule(str(tmp_path), batch_size=5, val_size=2, normalize="symmetric")
    dm.setup("fit")
    train, val, test = (_built(split, ArrayImageDataset) for split in (dm.train_set, dm.val_set, dm.test_set))
    assert (len(train), len(val), len(test)) == (10, 2, 4)
    x, y = test[1]
    expected = (torch.from_numpy(arrays["t10k-images-idx3-ubyte.gz"][1]).float() / 255 - 0.5) * 2
    assert x.shape == (1, 28, 28) and torch.equal(x[0], expected) and int(y) == 1
    # the held-out and training samples partition the training file
    seen = sorted(int(label) for ds in (train, val) for label in ds.labels)
    assert seen == sorted(int(v) for v in arrays["train-labels-idx1-ubyte"])
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (5, 1, 28, 28) and yb.dtype == torch.long and xb.min() >= -1 and xb.max() <= 1
    unit = MNISTDataModule(str(tmp_path), val_size=0, normalize="unit")
    unit.setup("fit")
    assert unit.val_set is unit.test_set and len(_built(unit.train_set, ArrayImageDataset)) == 12
    assert torch.equal(_built(unit.test_set, ArrayImageDataset)[1][0][0], torch.from_numpy(arrays["t10k-images-idx3-ubyte.gz"][1]).float() / 255)


def test_fashion_mnist_defaults_to_debian_path() -> None:
    dm = FashionMNISTDataModule()
    expected = DEBIAN_FASHION_MNIST if DEBIAN_FASHION_MNIST.is_dir() else Path("data/fashion-mnist")
    assert dm.data_dir == expected


def test_missing_dataset_names_path_and_fix(tmp_path: Path) -> None:
    empty = tmp_path / "nothing-here"
    for dm in (
        MNISTDataModule(str(empty)),
        FashionMNISTDataModule(str(empty)),
        CIFAR10DataModule(str(empty)),
        TinyShakespeareDataModule(str(empty)),
    ):
        with pytest.raises(DatasetNotFoundError) as info:
            dm.setup("fit")
        message = str(info.value)
        assert str(empty) in message and "download=True" in message, message
    with pytest.raises(DatasetNotFoundError, match="train.src"):
        ParallelTextDataModule(str(empty)).setup("fit")
    with pytest.raises(DatasetNotFoundError, match="Fix"):
        ImageFolderDataModule(str(empty)).setup("fit")
    with pytest.raises(ValueError, match="download"):
        ImageFolderDataModule(str(empty), download=True)


def test_download_checks_md5_and_extracts(tmp_path: Path) -> None:
    # file:// URLs exercise the real download path without a network
    source = tmp_path / "src" / "t10k-labels-idx1-ubyte.gz"
    write_idx(source, np.arange(5, dtype=np.uint8))
    url = source.as_uri()
    good = md5sum(source)
    target = download_url(url, tmp_path / "dl" / source.name, good)
    assert target.read_bytes() == source.read_bytes()
    with pytest.raises(RuntimeError, match="MD5"):
        download_url(url, tmp_path / "dl2" / source.name, "0" * 32)
    assert not (tmp_path / "dl2" / source.name).exists() and not list((tmp_path / "dl2").iterdir())
    extract_archive(target, tmp_path / "gunzipped")
    assert read_idx(tmp_path / "gunzipped" / "t10k-labels-idx1-ubyte").tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- CIFAR-10


def _write_cifar(root: Path, per_batch: int = 3) -> np.ndarray:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    test_data = np.zeros(0, np.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        entry = {b"batch_label": name.encode(), b"labels": list(range(per_batch)), b"data": data}
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle, protocol=2)
        test_data = data
    return test_data


def test_cifar10_reads_pickle_batches(tmp_path: Path) -> None:
    test_data = _write_cifar(tmp_path)
    dm = CIFAR10DataModule(str(tmp_path), batch_size=4, val_size=3)
    dm.setup("fit")
    train, val, test = (_built(split, ArrayImageDataset) for split in (dm.train_set, dm.val_set, dm.test_set))
    assert (len(train), len(val), len(test)) == (12, 3, 3)
    x, _ = train[0]
    assert x.shape == (3, 24, 24)
    # per-image standardisation: zero mean, unit (population) std
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std(correction=0)) - 1) < 1e-4
    raw = CIFAR10DataModule(str(tmp_path), val_size=0, crop_size=32, normalize="unit", color_jitter=False)
    raw.setup("fit")
    image, label = _built(raw.test_set, ArrayImageDataset)[2]
    assert torch.equal(image, torch.from_numpy(test_data[2].reshape(3, 32, 32)).float() / 255) and int(label) == 2
    center = CIFAR10DataModule(str(tmp_path), val_size=0, crop_size=24, normalize="unit")
    center.setup("test")
    assert torch.equal(_built(center.test_set, ArrayImageDataset)[2][0], (torch.from_numpy(test_data[2].reshape(3, 32, 32)).float() / 255)[:, 4:28, 4:28])
    xb, _ = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 3, 24, 24)
    # worker processes receive the dataset by pickling (spawn) or fork: both must work
    pickle.loads(pickle.dumps(dm.train_set))
    workers = CIFAR10DataModule(str(tmp_path), batch_size=5, val_size=0, num_workers=1)
    workers.setup("fit")
    assert sum(len(x) for x, _ in workers.train_dataloader()) == 15


def test_cifar10_download_from_archive(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    _write_cifar(staging)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as handle:
        handle.add(staging / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    dm = CIFAR10DataModule(str(tmp_path / "data"), download=True, val_size=0)
    dm.url, dm.archive_md5 = archive.as_uri(), md5sum(archive)
    dm.prepare_data()
    dm.setup("fit")
    assert len(_built(dm.train_set, ArrayImageDataset)) == 15 and (tmp_path / "data" / "cifar-10-python.tar.gz").is_file()


# ---------------------------------------------------------------- ImageNet-style folders


def test_image_folder_decodes_jpeg_and_transforms(tmp_path: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for k, cls in enumerate(("n01", "n02")):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                colour = (200 * k, 50 + 100 * i, 30)
                Image.new("RGB", (40, 30), colour).save(tmp_path / split / cls / f"img{i}.JPEG", quality=95)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=2, num_workers=0, image_size=16, resize_size=20)
    dm.setup("fit")
    train = _built(dm.train_set, ImageFolder)
    assert train.classes == ["n01", "n02"] and dm.num_classes == 2 and len(train) == 4
    x, y = _built(dm.val_set, ImageFolder)[3]
    assert x.shape == (3, 16, 16) and y == 1
    # a flat image survives decoding and resizing: every pixel is the (normalised) source colour
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    pixel = x[:, 8, 8] * std + mean
    assert torch.allclose(pixel, torch.tensor([200, 150, 30]) / 255, atol=0.03)
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (2, 3, 16, 16)
    pickle.loads(pickle.dumps(dm.train_set))


def test_random_resized_crop_output_size() -> None:
    crop = RandomResizedCrop(12, scale=(0.1, 0.5))
    for _ in range(5):
        assert crop(torch.rand(3, 30, 50)).shape == (3, 12, 12)


# ---------------------------------------------------------------- text


def test_tiny_shakespeare_chunks(tmp_path: Path) -> None:
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 5
    (tmp_path / "input.txt").write_text(text)
    dm = TinyShakespeareDataModule(str(tmp_path), batch_size=3, seq_len=8, val_fraction=0.2)
    assert dm.vocab_size == len(set(text))
    dm.setup("fit")
    x, y = _built(dm.train_set, TokenWindows)[2]
    assert x.shape == y.shape == (8,) and torch.equal(x[1:], y[:-1])
    assert dm.decode(x) == text[16:24] and dm.decode(y) == text[17:25]
    assert dm.test_set is dm.val_set and len(_built(dm.val_set, TokenWindows)) == (int(len(text) * 0.2) - 1) // 8
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (3, 8)


def test_parallel_text_vocab_and_padding(tmp_path: Path) -> None:
    (tmp_path / "train.ro").write_text("a b c\nb c\nc\n")
    (tmp_path / "train.en").write_text("x y\ny\nx y z\n")
    (tmp_path / "valid.ro").write_text("a q\n")
    (tmp_path / "valid.en").write_text("x w\n")
    dm = ParallelTextDataModule(str(tmp_path), batch_size=3, src_lang="ro", tgt_lang="en")
    src_vocab, tgt_vocab = dm.vocabs
    assert src_vocab.itos[:4] == ["<pad>", "<unk>", "<bos>", "<eos>"]
    assert src_vocab.itos[4:] == ["c", "b", "a"]  # by frequency
    assert dm.src_vocab_size == 7 and dm.tgt_vocab_size == 7
    dm.setup("fit")
    assert dm.test_set is dm.val_set
    src, lengths, tgt_in, tgt_out = next(iter(dm.val_dataloader()))
    assert src.tolist() == [[src_vocab.stoi["a"], Vocab.unk_id]] and lengths.tolist() == [2]
    assert tgt_in.tolist() == [[Vocab.bos_id, tgt_vocab.stoi["x"], Vocab.unk_id]]
    assert tgt_out.tolist() == [[tgt_vocab.stoi["x"], Vocab.unk_id, Vocab.eos_id]]
    dm2 = ParallelTextDataModule(str(tmp_path), batch_size=3, src_lang="ro", tgt_lang="en")
    dm2.setup("fit")
    src, lengths, tgt_in, tgt_out = next(iter(dm2._loader(dm2.train_set, shuffle=False)))
    assert src.shape == (3, 3) and lengths.tolist() == [3, 2, 1] and src[2, 1:].tolist() == [0, 0]
    assert tgt_out.shape == (3, 4) and tgt_out[1].tolist() == [tgt_vocab.stoi["y"], Vocab.eos_id, 0, 0]
    assert tgt_vocab.decode(tgt_out[0].tolist()) == ["x", "y"]


# ---------------------------------------------------------------- digits and transforms


def test_digits_split_is_disjoint_and_scaled() -> None:
    dm = DigitsDataModule(batch_size=16, val_size=100, test_size=200)
    dm.setup("fit")
    train, val, test = (_built(split, TensorDataset) for split in (dm.train_set, dm.val_set, dm.test_set))
    sizes = [len(train), len(val), len(test)]
    assert sizes == [1497, 100, 200]
    x, y = train[:]
    assert x.shape == (1497, 1, 8, 8) and float(x.min()) == -1.0 and float(x.max()) == 1.0
    assert set(y.tolist()) == set(range(10))
    all_images = torch.cat([train.tensors[0], val.tensors[0], test.tensors[0]]).flatten(1)
    assert all_images.shape[0] == 1797


def test_tf_style_image_ops() -> None:
    x = torch.rand(3, 6, 6) * 255
    y = PerImageStandardize()(x)
    torch.testing.assert_close(y, (x - x.mean()) / x.std(correction=0))
    flat = PerImageStandardize()(torch.full((3, 4, 4), 7.0))
    assert torch.equal(flat, torch.zeros(3, 4, 4))  # std floored at 1/sqrt(N), no division by zero
    contrasted = RandomContrast(0.2, 1.8)(x)
    torch.testing.assert_close(contrasted.mean(dim=(1, 2)), x.mean(dim=(1, 2)))
