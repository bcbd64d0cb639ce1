"""A word-level parallel corpus (one sentence per line, source and target files) for seq2seq training."""

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset
from typing_extensions import override

from gradcomp_lab.data.base import SplitDataModule
from gradcomp_lab.data.files import require_files
from lightning_gradcomp.validation import check_int

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIALS = (PAD, UNK, BOS, EOS)


class Vocab:
    """Token <-> id table; ids 0..3 are ``<pad>``, ``<unk>``, ``<bos>``, ``<eos>``.

    Args:
        tokens: the non-special tokens, most frequent first.
    """

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def __init__(self, tokens: Iterable[str]) -> None:
        self.itos = list(SPECIALS) + [t for t in tokens if t not in SPECIALS]
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(cls, sentences: Iterable[Sequence[str]], max_size: Optional[int] = None, min_freq: int = 1) -> "Vocab":
        """The ``max_size`` most frequent tokens seen at least ``min_freq`` times (ties broken by spelling)."""
        counts = Counter(token for sentence in sentences for token in sentence)
        ranked = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
        return cls(ranked[:max_size] if max_size is not None else ranked)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """Token ids, unknown tokens as ``<unk>``."""
        return [self.stoi.get(t, self.unk_id) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens up to (not including) the first ``<eos>``, without padding or ``<bos>``."""
        out: list[str] = []
        for i in ids:
            if i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id):
                out.append(self.itos[i])
        return out


class ParallelText(Dataset):
    """Aligned source/target sentences as id tensors; target framed as ``<bos> ... `` / ``... <eos>``."""

    def __init__(self, pairs: Sequence[tuple[list[int], list[int]]]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        src, tgt = self.pairs[index]
        return (
            torch.tensor(src, dtype=torch.long),
            torch.tensor([Vocab.bos_id, *tgt], dtype=torch.long),
            torch.tensor([*tgt, Vocab.eos_id], dtype=torch.long),
        )


def collate_parallel(batch: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pad to ``(src (B, S), src_lengths (B,), tgt_in (B, T), tgt_out (B, T))`` with ``<pad>`` = 0."""
    src, tgt_in, tgt_out = zip(*batch)
    lengths = torch.tensor([len(s) for s in src], dtype=torch.long)
    pad = Vocab.pad_id
    return (
        pad_sequence(list(src), batch_first=True, padding_value=pad),
        lengths,
        pad_sequence(list(tgt_in), batch_first=True, padding_value=pad),
        pad_sequence(list(tgt_out), batch_first=True, padding_value=pad),
    )


class ParallelTextDataModule(SplitDataModule):
    """Files ``{split}.{src_lang}`` and ``{split}.{tgt_lang}``, line ``i`` of one translating line ``i`` of the other.

    Tokens are whitespace-separated (tokenise/BPE the corpus beforehand, as WMT systems do). Vocabularies are
    built from the training split; sentences are truncated to ``max_len`` tokens, and pairs with an empty side
    are skipped. There is no single official download for such corpora, so ``download=True`` is rejected.

    Args:
        data_dir: directory holding the split files.
        batch_size: sentence pairs per batch per process.
        num_workers: DataLoader workers.
        download: must be False.
        src_lang: source file suffix (e.g. ``"ro"``).
        tgt_lang: target file suffix (e.g. ``"en"``).
        train_split: training files' prefix.
        val_split: validation files' prefix.
        test_split: test files' prefix; if its files are absent the validation split is used.
        max_len: tokens kept per sentence.
        max_vocab_size: most frequent tokens kept per language (``None``: all).
        min_freq: rarer tokens map to ``<unk>``.
        lowercase: lowercase before tokenising.
        seed: unused (splits are files); kept for a uniform signature.
    """

    def __init__(
        self,
        data_dir: str = "data/parallel",
        batch_size: int = 80,
        num_workers: int = 0,
        download: bool = False,
        src_lang: str = "src",
        tgt_lang: str = "tgt",
        train_split: str = "train",
        val_split: str = "valid",
        test_split: str = "test",
        max_len: int = 50,
        max_vocab_size: Optional[int] = 30000,
        min_freq: int = 1,
        lowercase: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seed)
        if download:
            raise ValueError(
                "Expected `download` to be False for ParallelTextDataModule, but got True. Fix: put "
                f"{train_split}.{src_lang}/{train_split}.{tgt_lang} (and {val_split}.*) in {data_dir}."
            )
        check_int("max_len", max_len, minimum=1)
        check_int("min_freq", min_freq, minimum=1)
        if max_vocab_size is not None:
            check_int("max_vocab_size", max_vocab_size, minimum=1)
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.train_split, self.val_split, self.test_split = train_split, val_split, test_split
        self.max_len, self.max_vocab_size, self.min_freq, self.lowercase = max_len, max_vocab_size, min_freq, lowercase
        self.collate_fn = collate_parallel
        self._vocabs: Optional[tuple[Vocab, Vocab]] = None

    def _read(self, path: Path) -> list[list[str]]:
        text = path.read_text(encoding="utf-8")
        if self.lowercase:
            text = text.lower()
        return [line.split()[: self.max_len] for line in text.splitlines()]

    def _read_split(self, split: str) -> tuple[list[list[str]], list[list[str]]]:
        names = [f"{split}.{self.src_lang}", f"{split}.{self.tgt_lang}"]
        fix = f"put sentence-aligned files {names[0]} and {names[1]} (one sentence per line) there"
        src_path, tgt_path = require_files("Parallel corpus", self.data_dir, names, fix)
        src, tgt = self._read(src_path), self._read(tgt_path)
        if len(src) != len(tgt):
            raise ValueError(f"Expected {names[0]} and {names[1]} to have as many lines, but got {len(src)} and {len(tgt)}.")
        return src, tgt

    @property
    def vocabs(self) -> tuple[Vocab, Vocab]:
        """``(source, target)`` vocabularies from the training split (reads it on first use)."""
        if self._vocabs is None:
            src, tgt = self._read_split(self.train_split)
            self._vocabs = (
                Vocab.build(src, self.max_vocab_size, self.min_freq),
                Vocab.build(tgt, self.max_vocab_size, self.min_freq),
            )
        return self._vocabs

    @property
    def src_vocab_size(self) -> int:
        """Source vocabulary size including the four specials."""
        return len(self.vocabs[0])

    @property
    def tgt_vocab_size(self) -> int:
        """Target vocabulary size including the four specials."""
        return len(self.vocabs[1])

    def _dataset(self, split: str) -> ParallelText:
        src_vocab, tgt_vocab = self.vocabs
        src, tgt = self._read_split(split)
        return ParallelText([(src_vocab.encode(s), tgt_vocab.encode(t)) for s, t in zip(src, tgt) if s and t])

    @override
    def _build(self) -> None:
        self.train_set = self._dataset(self.train_split)
        self.val_set = self._dataset(self.val_split)
        has_test = all((self.data_dir / f"{self.test_split}.{lang}").is_file() for lang in (self.src_lang, self.tgt_lang))
        self.test_set = self._dataset(self.test_split) if has_test else self.val_set
