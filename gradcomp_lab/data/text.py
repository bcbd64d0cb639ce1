"""Byte-level text corpora for causal language models: the Python standard library's own sources, WikiText.

Every corpus is read as UTF-8 bytes and tokenized by :class:`ByteTokenizer` (vocabulary 256, no download, no
unknown token), then cut into windows of ``seq_len + 1`` tokens every ``stride`` tokens: input ``w[:-1]``,
target ``w[1:]``.

:class:`StdlibSourceDataModule` needs nothing beyond the running interpreter: it reads the standard library's
``.py`` files (``sysconfig.get_paths()["stdlib"]``) in sorted path order, so the corpus is fixed for a given
Python version (the benchmarks record it). :class:`WikiTextDataModule` reads WikiText-2/103's ``wiki.*.raw`` (or
``.tokens``) files.
"""

import sys
import sysconfig
from pathlib import Path
from typing import Literal, Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from gradcomp_lab.data.base import SplitDataModule
from gradcomp_lab.data.files import download_url, extract_archive, require_files
from lightning_gradcomp.validation import check_choice, check_int, check_number


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: needs no vocabulary file and never meets an unknown symbol."""

    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        """Token ids (int64) of ``text``'s UTF-8 bytes."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: Tensor) -> str:
        """Text of token ids (invalid UTF-8 sequences, e.g. a cut multi-byte character, become U+FFFD)."""
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens starting every ``stride`` tokens: ``x = w[:-1]``, ``y = w[1:]``.

    Args:
        ids: the token stream (1-D).
        seq_len: tokens per input sequence.
        stride: tokens between window starts (``None``: ``seq_len``, non-overlapping windows).
    """

    def __init__(self, ids: Tensor, seq_len: int, stride: Optional[int] = None) -> None:
        check_int("seq_len", seq_len, minimum=1)
        stride = seq_len if stride is None else stride
        check_int("stride", stride, minimum=1, fix="use a stride of at least 1 token (seq_len: no overlap)")
        self.ids, self.seq_len, self.stride = ids, seq_len, stride

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1 - self.seq_len) // self.stride + 1)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.stride
        window = self.ids[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class ByteCorpusDataModule(SplitDataModule):
    """Base of the byte-level corpora: subclasses return each split's text from :meth:`_split_text`.

    Args:
        data_dir: where the corpus files are.
        batch_size: sequences per batch per process.
        num_workers: DataLoader workers.
        download: fetch the corpus (subclasses that have a URL).
        seq_len: tokens per sequence (the model's context).
        stride: tokens between training window starts (``None``: ``seq_len``); validation windows never overlap.
        seed: unused (the splits are fixed); kept for a uniform signature.
    """

    tokenizer = ByteTokenizer()

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 16,
        num_workers: int = 0,
        download: bool = False,
        seq_len: int = 128,
        stride: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seed)
        check_int("seq_len", seq_len, minimum=1)
        if stride is not None:
            check_int("stride", stride, minimum=1, fix="use a stride of at least 1 token, or null for seq_len")
        self.seq_len, self.stride = seq_len, stride

    @property
    def vocab_size(self) -> int:
        """256 (bytes); link it to the model's ``vocab_size``."""
        return self.tokenizer.vocab_size

    def _split_text(self) -> tuple[str, str, Optional[str]]:
        """Train, validation and (or ``None``) test text."""
        raise NotImplementedError

    @override
    def _build(self) -> None:
        train, val, test = self._split_text()
        self.train_set = TokenWindows(self.tokenizer.encode(train), self.seq_len, self.stride)
        self.val_set = TokenWindows(self.tokenizer.encode(val), self.seq_len)
        self.test_set = self.val_set if test is None else TokenWindows(self.tokenizer.encode(test), self.seq_len)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"Expected at least one {self.seq_len + 1}-token window per split, but got {len(self.train_set)} "
                f"training and {len(self.val_set)} validation windows. Fix: lower `seq_len` or use more text."
            )


def stdlib_source_files(root: Optional[str] = None) -> list[Path]:
    """The ``.py`` files under the standard library directory, sorted by relative path (site-packages and
    tests excluded: installed packages differ between machines, and ``test/`` is mostly data, not code)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in base.rglob("*.py") if not skip.intersection(p.relative_to(base).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


class StdlibSourceDataModule(ByteCorpusDataModule):
    """The running interpreter's standard-library sources as a byte-level corpus (offline on every machine).

    Files are concatenated in sorted relative-path order, each preceded by a ``# file: <path>`` line, up to
    ``max_bytes``; the last ``val_fraction`` of that stream is the validation (and test) split. The corpus
    is identical for the same Python version (``sys.version`` is in the benchmarks' JSON).

    Args:
        data_dir: the standard library directory (``None``: ``sysconfig.get_paths()["stdlib"]``); tests pass
            a folder of generated ``.py`` files.
        max_bytes: bytes of source kept from the start of the ordered stream (``None``: all, about 20 MB).
        val_fraction: share of the kept stream, at its end, held out for validation.
        batch_size, num_workers, seq_len, stride, seed: see :class:`ByteCorpusDataModule`.
    """

    def __init__(
        self,
        data_dir: Optional[str] = None,
        batch_size: int = 16,
        num_workers: int = 0,
        seq_len: int = 128,
        stride: Optional[int] = None,
        max_bytes: Optional[int] = 4_000_000,
        val_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir or sysconfig.get_paths()["stdlib"], batch_size, num_workers, False, seq_len, stride, seed)
        if max_bytes is not None:
            check_int("max_bytes", max_bytes, minimum=2, fix="keep at least a few thousand bytes, or null for all")
        check_number("val_fraction", val_fraction, minimum=0.0, maximum=0.5, min_open=True)
        self.max_bytes, self.val_fraction = max_bytes, val_fraction

    def corpus(self) -> str:
        """The ordered, truncated source stream."""
        files = stdlib_source_files(str(self.data_dir))
        if not files:
            raise ValueError(
                f"Expected `data_dir` to hold .py files, but got {str(self.data_dir)!r} with none. "
                "Fix: pass the standard library directory or leave `data_dir` unset."
            )
        parts: list[str] = []
        size = 0
        for path in files:
            text = f"# file: {path.relative_to(self.data_dir).as_posix()}\n" + path.read_text("utf-8", errors="replace")
            parts.append(text)
            size += len(text)
            if self.max_bytes is not None and size >= self.max_bytes:
                break
        stream = "".join(parts)
        if self.max_bytes is not None:
            stream = stream.encode("utf-8")[: self.max_bytes].decode("utf-8", errors="ignore")
        return stream

    @override
    def _split_text(self) -> tuple[str, str, Optional[str]]:
        stream = self.corpus()
        n_val = int(len(stream) * self.val_fraction)
        return stream[: len(stream) - n_val], stream[len(stream) - n_val :], None

    @staticmethod
    def python_version() -> str:
        """The interpreter version the corpus came from."""
        return sys.version.split()[0]


class WikiTextDataModule(ByteCorpusDataModule):
    """WikiText-2 or WikiText-103 (Merity et al.) as a byte-level corpus, in its published splits.

    Reads ``wiki.train.raw``, ``wiki.valid.raw`` and ``wiki.test.raw`` (the ``-raw-v1`` archives; the
    tokenized ``-v1`` archives' ``wiki.*.tokens`` with ``raw=False``) from ``data_dir`` or from the archive's
    own sub-folder (``wikitext-2-raw/``) inside it.

    Args:
        data_dir: folder holding the files (or the extracted archive).
        variant: ``"2"`` or ``"103"``.
        raw: the raw (untokenized) files rather than the ``<unk>``-tokenized ones.
        download: fetch and extract the archive from :attr:`urls` (needs internet).
        batch_size, num_workers, seq_len, stride, seed: see :class:`ByteCorpusDataModule`.
    """

    urls = {
        ("2", True): "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-raw-v1.zip",
        ("2", False): "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip",
        ("103", True): "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip",
        ("103", False): "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
    }

    def __init__(
        self,
        data_dir: str = "data/wikitext",
        variant: Literal["2", "103"] = "2",
        raw: bool = True,
        download: bool = False,
        batch_size: int = 16,
        num_workers: int = 0,
        seq_len: int = 128,
        stride: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seq_len, stride, seed)
        check_choice("variant", str(variant), ("2", "103"))
        self.variant, self.raw = str(variant), bool(raw)

    @property
    def _folder(self) -> Path:
        nested = self.data_dir / f"wikitext-{self.variant}{'-raw' if self.raw else ''}"
        return nested if nested.is_dir() else self.data_dir

    @override
    def _download(self) -> None:
        names = self._names()
        if all((self._folder / n).is_file() for n in names):
            return
        url = self.urls[(self.variant, self.raw)]
        archive = download_url(url, self.data_dir / url.rsplit("/", 1)[1])
        extract_archive(archive, self.data_dir)

    def _names(self) -> list[str]:
        suffix = "raw" if self.raw else "tokens"
        return [f"wiki.{split}.{suffix}" for split in ("train", "valid", "test")]

    @override
    def _split_text(self) -> tuple[str, str, Optional[str]]:
        fix = f"pass `download=True` (needs internet) or extract WikiText-{self.variant} into {str(self.data_dir)!r}"
        train, val, test = require_files(f"WikiText-{self.variant}", self._folder, self._names(), fix)
        return tuple(p.read_text(encoding="utf-8") for p in (train, val, test))  # type: ignore[return-value]
