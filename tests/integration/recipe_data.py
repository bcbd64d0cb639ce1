"""Tiny datasets in each recipe dataset's real on-disk format, and the CLI overrides that point a recipe at them.

Used by ``tests/integration/test_recipes.py`` (and its fit subprocess, ``recipe_fit.py``): MNIST IDX files,
CIFAR-10 python pickle batches, an ImageNet-style image folder of JPEGs, char-rnn's ``input.txt`` and a
parallel text corpus. Every file is generated; nothing is downloaded.
"""

import pickle
from pathlib import Path

import numpy as np
import yaml

from gradcomp_lab.data.idx import write_idx

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

#: datamodule class -> sub-folder of the generated data root
DATA_DIRS = {
    "gradcomp_lab.data.MNISTDataModule": "mnist",
    "gradcomp_lab.data.FashionMNISTDataModule": "mnist",
    "gradcomp_lab.data.CIFAR10DataModule": "cifar10",
    "gradcomp_lab.data.ImageFolderDataModule": "imagenet",
    "gradcomp_lab.data.TinyShakespeareDataModule": "tinyshakespeare",
    "gradcomp_lab.data.ParallelTextDataModule": "parallel",
    "gradcomp_lab.data.StdlibSourceDataModule": "stdlib",
    "gradcomp_lab.data.StdlibPieceDataModule": "stdlib",
}


def write_datasets(root: Path) -> Path:
    """Write every format under ``root`` (a few samples each) and return ``root``."""
    rng = np.random.default_rng(0)
    mnist = root / "mnist"
    mnist.mkdir(parents=True)
    for prefix, n in (("train", 32), ("t10k", 16)):
        write_idx(mnist / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(mnist / f"{prefix}-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8))
    cifar = root / "cifar10" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:  # 80 training images: 4 ranks x 5 x 4
        entry = {b"batch_label": name.encode(), b"labels": [i % 10 for i in range(16)],
                 b"data": rng.integers(0, 256, (16, 3072), dtype=np.uint8)}
        with open(cifar / name, "wb") as handle:
            pickle.dump(entry, handle, protocol=2)
    from PIL import Image

    for split, n in (("train", 16), ("val", 4)):  # 32 training images: 4 ranks x 4 steps x batch 2 (AlexNet WeightGrad)
        for wnid in ("n01440764", "n01443537"):
            folder = root / "imagenet" / split / wnid
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{wnid}_{i}.JPEG", quality=90)
    shakespeare = root / "tinyshakespeare"
    shakespeare.mkdir()
    lines = ["First Citizen:", "Before we proceed any further, hear me speak.", "All:", "Speak, speak."]
    shakespeare.joinpath("input.txt").write_text("\n".join(lines * 40) + "\n")
    parallel = root / "parallel"
    parallel.mkdir()
    words_ro, words_en = "casa este mare si frumoasa".split(), "the house is big and beautiful".split()
    for split, n in (("train", 24), ("valid", 8), ("test", 8)):
        src = [" ".join(rng.choice(words_ro, rng.integers(2, 6))) for _ in range(n)]
        tgt = [" ".join(rng.choice(words_en, rng.integers(2, 6))) for _ in range(n)]
        for lang, sentences in (("ro", src), ("en", tgt)):
            (parallel / f"{split}.{lang}").write_text("\n".join(sentences) + "\n")
    stdlib = root / "stdlib" / "json"  # a standard-library-like folder of sources, read in sorted path order
    stdlib.mkdir(parents=True)
    for i in range(3):
        (stdlib / f"mod{i}.py").write_text(f'"""Module {i}."""\n\n' + "def f(x):\n    return x * 2\n\n" * 60)
    return root


#: recipe folders that are not paper reproductions: benchmark workloads, fitted once in test_recipes.py
NON_PAPER = ("lm", "diloco")


def recipe_paths(folder: str = "*") -> list[Path]:
    """Every paper recipe (``recipes/<paper>/*.yaml``), sorted; or those of one ``folder`` (e.g. ``"lm"``)."""
    if folder == "*":
        return sorted(p for p in RECIPES.glob("*/*.yaml") if p.parent.name not in NON_PAPER)
    return sorted(RECIPES.glob(f"{folder}/*.yaml"))


def data_overrides(recipe: Path, data_root: Path) -> list[str]:
    """Point the recipe's datamodule at the generated data, in the main process (no loader workers)."""
    config = yaml.safe_load(recipe.read_text())
    data_cls = config["data"]["class_path"]
    return [f"--data.init_args.data_dir={data_root / DATA_DIRS[data_cls]}", "--data.init_args.num_workers=0"]
