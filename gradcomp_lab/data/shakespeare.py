"""Tiny Shakespeare (Karpathy's char-rnn ``input.txt``) as character sequences for a char-LSTM."""

from typing import Optional

import torch
from torch import Tensor
from typing_extensions import override

from gradcomp_lab.data.base import SplitDataModule
from gradcomp_lab.data.files import download_url, require_files
from gradcomp_lab.data.text import TokenWindows
from lightning_gradcomp.validation import check_int, check_number

#: non-overlapping character windows (one implementation of windowing: :class:`TokenWindows`)
CharChunks = TokenWindows


class TinyShakespeareDataModule(SplitDataModule):
    """Character-level Tiny Shakespeare (about 1.1M characters, 65 symbols).

    The vocabulary is the sorted set of characters of the whole file (char-rnn's rule). The text is split
    in order into train / val / test by ``val_fraction`` and ``test_fraction`` (char-rnn: 0.95 / 0.05 / 0);
    each split is cut into independent ``seq_len`` windows. Unlike char-rnn, the LSTM state is not carried
    across windows, so windows can be shuffled and sharded by DDP.

    Args:
        data_dir: directory holding ``input.txt``.
        batch_size: sequences per batch per process (AdaComp's LSTM: 10).
        num_workers: DataLoader workers.
        download: fetch ``input.txt`` from the char-rnn repository (no checksum is published for it).
        seq_len: characters per training sequence (char-rnn default 50).
        val_fraction: share of the text, after the training part, used for validation.
        test_fraction: share of the text at the end used for testing; 0 tests on the validation part.
        seed: unused (the split is positional); kept for a uniform signature.
        stride: characters between training window starts (``None``: ``seq_len``, char-rnn's non-overlapping
            windows); validation and test windows never overlap.
    """

    url = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
    file_name = "input.txt"

    def __init__(
        self,
        data_dir: str = "data/tinyshakespeare",
        batch_size: int = 10,
        num_workers: int = 0,
        download: bool = False,
        seq_len: int = 50,
        val_fraction: float = 0.05,
        test_fraction: float = 0.0,
        seed: int = 0,
        stride: Optional[int] = None,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, download, seed)
        if stride is not None:
            check_int("stride", stride, minimum=1, fix="use a stride of at least 1 character, or null for seq_len")
        self.stride = stride
        check_int("seq_len", seq_len, minimum=1)
        check_number("val_fraction", val_fraction, minimum=0.0, maximum=0.5, min_open=True)
        check_number("test_fraction", test_fraction, minimum=0.0, maximum=0.5)
        self.seq_len, self.val_fraction, self.test_fraction = seq_len, val_fraction, test_fraction
        self._text: Optional[str] = None
        self.chars: list[str] = []

    @override
    def _download(self) -> None:
        if not (self.data_dir / self.file_name).is_file():
            download_url(self.url, self.data_dir / self.file_name)

    def _load_text(self) -> str:
        if self._text is None:
            fix = f"pass `download=True` (needs internet) or save char-rnn's input.txt in {str(self.data_dir)!r}"
            (path,) = require_files("Tiny Shakespeare", self.data_dir, [self.file_name], fix)
            self._text = path.read_text(encoding="utf-8")
            self.chars = sorted(set(self._text))
        return self._text

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters (reads ``input.txt`` on first use; link it to the model's)."""
        self._load_text()
        return len(self.chars)

    def decode(self, ids: Tensor) -> str:
        """Character ids back to text."""
        self._load_text()
        return "".join(self.chars[int(i)] for i in ids)

    @override
    def _build(self) -> None:
        text = self._load_text()
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        n = len(ids)
        n_test = int(n * self.test_fraction)
        n_val = int(n * self.val_fraction)
        n_train = n - n_val - n_test
        self.train_set = CharChunks(ids[:n_train], self.seq_len, self.stride)
        self.val_set = CharChunks(ids[n_train : n_train + n_val], self.seq_len)
        self.test_set = CharChunks(ids[n_train + n_val :], self.seq_len) if n_test else self.val_set
        if len(self.val_set) == 0 or len(self.train_set) == 0:
            raise ValueError(
                f"Expected at least one {self.seq_len}-character window per split, but the text has {n} characters. "
                "Fix: lower `seq_len` or raise `val_fraction`."
            )
