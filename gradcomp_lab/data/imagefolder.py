"""ImageNet-style folders (``root/train/<class>/*.JPEG``, ``root/val/<class>/*``), decoded with Pillow."""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from gradcomp_lab.data.base import SplitDataModule
from gradcomp_lab.data.files import DatasetNotFoundError
from gradcomp_lab.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ResizeShorter,
    Standardize,
    ToUnit,
)
from lightning_gradcomp.validation import check_int, check_number

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".ppm", ".webp")


def load_rgb(path: Path) -> Tensor:
    """Decode an image file to a ``(3, H, W)`` uint8 tensor."""
    from PIL import Image  # the `data` extra; imported here so the package imports without Pillow

    with Image.open(path) as image:
        rgb = image.convert("RGB")
        data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return data.view(rgb.height, rgb.width, 3).permute(2, 0, 1).contiguous()


class ImageFolder(Dataset):
    """``root/<class>/<image>`` files; class indices follow the sorted class-folder names.

    Args:
        root: the split's directory.
        transform: applied to each decoded ``(3, H, W)`` uint8 image.
        classes: class names in index order (default: the sorted sub-folders of ``root``); pass the training
            split's list to the evaluation split so that indices agree even if a class folder is missing.
    """

    def __init__(
        self, root: Path, transform: Optional[Callable[[Tensor], Tensor]] = None, classes: Optional[Sequence[str]] = None
    ) -> None:
        self.root, self.transform = Path(root), transform
        self.classes = list(classes) if classes is not None else sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples: list[tuple[Path, int]] = []
        for index, name in enumerate(self.classes):
            folder = self.root / name
            if folder.is_dir():
                files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
                self.samples += [(path, index) for path in files]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        path, label = self.samples[index]
        image = load_rgb(path)
        return (self.transform(image) if self.transform else image), label


class ImageFolderDataModule(SplitDataModule):
    """ImageNet-layout folders with the standard ResNet/GoogLeNet transforms (torch ops).

    Training: Inception-style random-resized crop to ``image_size`` (area in [``min_area``, 1], aspect in
    [3/4, 4/3]), random flip, ImageNet mean/std. Evaluation: resize the shorter side to ``resize_size``,
    central ``image_size`` crop, same normalisation. ImageNet cannot be downloaded without registering, so
    ``download=True`` is rejected.

    Args:
        data_dir: root holding ``train_dir`` and ``val_dir``.
        batch_size: samples per batch per process.
        num_workers: DataLoader workers (JPEG decoding is CPU-heavy: use several).
        download: must be False.
        train_dir: training split's sub-folder.
        val_dir: validation split's sub-folder (also the test split: ImageNet's test labels are not public).
        image_size: side of the network's input crop (224; 227 for Caffe's AlexNet).
        resize_size: shorter side before the evaluation crop (256).
        min_area: smallest crop area fraction in training (0.08 standard).
        seed: unused by this layout (the splits are folders); kept for a uniform signature.
    """

    def __init__(
        self,
        data_dir: str = "data/imagenet",
        batch_size: int = 128,
        num_workers: int = 8,
        download: bool = False,
        train_dir: str = "train",
        val_dir: str = "val",
        image_size: int = 224,
        resize_size: int = 256,
        min_area: float = 0.08,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seed)
        if download:
            raise ValueError(
                "Expected `download` to be False for ImageFolderDataModule, but got True. Fix: ImageNet needs "
                f"registration at https://image-net.org; extract it as {data_dir}/{train_dir}/<class>/*.JPEG."
            )
        check_int("image_size", image_size, minimum=1)
        check_int("resize_size", resize_size, minimum=image_size)
        check_number("min_area", min_area, minimum=0.0, maximum=1.0, min_open=True)
        self.train_dir, self.val_dir = train_dir, val_dir
        self.image_size, self.resize_size, self.min_area = image_size, resize_size, min_area

    def train_transform(self) -> Compose:
        """Random-resized crop, flip, normalise."""
        return Compose(
            [
                ToUnit(),
                RandomResizedCrop(self.image_size, scale=(self.min_area, 1.0)),
                RandomHorizontalFlip(),
                Standardize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )

    def eval_transform(self) -> Compose:
        """Resize shorter side, central crop, normalise."""
        return Compose(
            [ToUnit(), ResizeShorter(self.resize_size), CenterCrop(self.image_size), Standardize(IMAGENET_MEAN, IMAGENET_STD)]
        )

    @property
    def num_classes(self) -> int:
        """Number of class folders in the training split (reads the directory)."""
        return len([p for p in (self.data_dir / self.train_dir).iterdir() if p.is_dir()])

    @override
    def _build(self) -> None:
        train_root, val_root = self.data_dir / self.train_dir, self.data_dir / self.val_dir
        missing = [str(p) for p in (train_root, val_root) if not p.is_dir()]
        if missing:
            raise DatasetNotFoundError(
                f"Image folders not found: {', '.join(missing)}. Fix: lay the dataset out as "
                f"{self.data_dir}/{self.train_dir}/<class>/<image> and {self.data_dir}/{self.val_dir}/<class>/<image>."
            )
        self.train_set = ImageFolder(train_root, self.train_transform())
        self.val_set = ImageFolder(val_root, self.eval_transform(), classes=self.train_set.classes)
        self.test_set = self.val_set
