"""The word-piece corpus (gradcomp_lab.data.pieces): a vocabulary of the training split's frequent pieces over the
256 bytes, lossless on any text, the same on every build, and cached."""

from pathlib import Path
from typing import Any

import pytest
import torch

from gradcomp_lab.data import PieceTokenizer, StdlibPieceDataModule, StdlibSourceDataModule, TokenWindows


def test_pieces_are_the_most_frequent_and_every_text_round_trips() -> None:
    text = "def f(self):\n    return self.x\n" * 20 + "def g(): pass\n"
    tokenizer = PieceTokenizer.fit(text, vocab_size=260)
    assert tokenizer.vocab_size == 260
    # the four most frequent pieces of more than one byte ("def": 21 times; then 20 each, in order)
    assert tokenizer.pieces == ["def", "\n    ", " f", " self"]
    for sample in (text, "unknown_name = 'é ∑ 🐍'\n\tx"):
        ids = tokenizer.encode(sample)
        assert ids.dtype == torch.int64 and int(ids.max()) < tokenizer.vocab_size
        assert tokenizer.decode(ids) == sample  # pieces outside the vocabulary travel as their bytes
    assert len(tokenizer.encode("def f(self):\n    return self.x\n")) < len("def f(self):\n    return self.x\n")


def test_a_vocabulary_no_larger_than_the_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size.*256"):
        PieceTokenizer.fit("abc", vocab_size=256)


def test_the_corpus_is_the_byte_corpus_split_tokenized_and_cached(tmp_path: Path) -> None:
    src = tmp_path / "lib"
    src.mkdir()
    for i in range(4):
        (src / f"m{i}.py").write_text(f"def function_{i}(value):\n    return value + {i}\n" * 40)
    kwargs: dict[str, Any] = {"data_dir": str(src), "seq_len": 16, "max_bytes": None, "val_fraction": 0.25, "batch_size": 2}
    dm = StdlibPieceDataModule(vocab_size=300, cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.setup("fit")
    train, val, _ = StdlibSourceDataModule(**kwargs)._split_text()
    assert isinstance(dm.train_set, TokenWindows) and isinstance(dm.val_set, TokenWindows)
    assert dm.tokenizer.decode(dm.train_set.ids) == train and dm.tokenizer.decode(dm.val_set.ids) == val
    assert dm.vocab_size == 300 and int(dm.train_set.ids.max()) < 300
    (cached,) = (tmp_path / "cache").glob("pieces_*.pt")
    again = StdlibPieceDataModule(vocab_size=300, cache_dir=str(tmp_path / "cache"), **kwargs)
    again.setup("fit")  # from the cache: the same vocabulary and ids
    assert isinstance(again.train_set, TokenWindows)
    assert again.tokenizer.pieces == dm.tokenizer.pieces and torch.equal(again.train_set.ids, dm.train_set.ids)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
