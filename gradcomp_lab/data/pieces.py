"""The standard library's sources with a word-piece vocabulary: a second language-model workload whose vocabulary
(2048-8192 tokens by default) is larger than the byte corpora's 256, so that a tied embedding is most of the model.

:class:`PieceTokenizer` splits text into pieces (an identifier or keyword with its leading space, a number, a line
break with the next line's indentation, a run of spaces, one other character), keeps the 256 bytes as tokens (so no
text is ever unknown) and adds the most frequent multi-byte pieces of the training split up to ``vocab_size``; a piece
outside the vocabulary is sent as its UTF-8 bytes. Built offline from the running interpreter's sources, it is the
same for the same Python version and arguments, and both the vocabulary and the token ids are cached on disk.
"""

import hashlib
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from typing_extensions import override

from gradcomp_lab.data.text import StdlibSourceDataModule, TokenWindows
from lightning_gradcomp.validation import check_int

#: a piece: a name or keyword with its leading space, digits, a line break with the next line's indentation, spaces,
#: or any one other character
_PIECE = re.compile(r" ?[A-Za-z_][A-Za-z0-9_]*|[0-9]+|\n[ ]*|[ ]+|.", re.DOTALL)
_BYTES = 256


class PieceTokenizer:
    """Bytes 0-255 plus the most frequent multi-byte pieces of a training text (ties broken by the piece itself).

    Args:
        pieces: the multi-byte pieces, token ids 256, 257, ... in this order.
    """

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = list(pieces)
        self.ids = {p: _BYTES + i for i, p in enumerate(self.pieces)}

    @classmethod
    def fit(cls, text: str, vocab_size: int) -> "PieceTokenizer":
        """The tokenizer of ``vocab_size`` tokens for ``text``: its ``vocab_size - 256`` most frequent pieces of
        more than one byte."""
        check_int("vocab_size", vocab_size, minimum=_BYTES + 1, fix=f"use more than {_BYTES} (the bytes), e.g. 2048")
        counts = Counter(p for p in _PIECE.findall(text) if len(p.encode("utf-8")) > 1)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([p for p, _ in ranked[: vocab_size - _BYTES]])

    @property
    def vocab_size(self) -> int:
        """256 bytes plus the pieces."""
        return _BYTES + len(self.pieces)

    def encode(self, text: str) -> Tensor:
        """Token ids (int64): each piece's id, or its UTF-8 bytes when it is not in the vocabulary."""
        out: list[int] = []
        for piece in _PIECE.findall(text):
            token = self.ids.get(piece)
            if token is None:
                out.extend(piece.encode("utf-8"))
            else:
                out.append(token)
        return torch.tensor(out, dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        """Text of token ids (bytes that do not form UTF-8 become U+FFFD)."""
        raw = b"".join(bytes([i]) if i < _BYTES else self.pieces[i - _BYTES].encode("utf-8") for i in ids.tolist())
        return raw.decode("utf-8", errors="replace")


class StdlibPieceDataModule(StdlibSourceDataModule):
    """:class:`~gradcomp_lab.data.StdlibSourceDataModule`'s corpus and split, tokenized by a :class:`PieceTokenizer`
    of ``vocab_size`` tokens fitted to the training split.

    Args:
        vocab_size: tokens (bytes included); link it to the model's ``vocab_size``.
        cache_dir: where the vocabulary and token ids are kept (``None``: ``gradcomp_lab_pieces`` in the temporary
            folder); the key is the corpus's hash and the arguments, so a change rebuilds them.
        data_dir, batch_size, num_workers, seq_len, stride, max_bytes, val_fraction, seed: see
            :class:`~gradcomp_lab.data.StdlibSourceDataModule`.
    """

    def __init__(
        self,
        vocab_size: int = 2048,
        data_dir: Optional[str] = None,
        batch_size: int = 16,
        num_workers: int = 0,
        seq_len: int = 64,
        stride: Optional[int] = None,
        max_bytes: Optional[int] = 4_000_000,
        val_fraction: float = 0.05,
        seed: int = 0,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__(data_dir, batch_size, num_workers, seq_len, stride, max_bytes, val_fraction, seed)
        check_int("vocab_size", vocab_size, minimum=_BYTES + 1, fix=f"use more than {_BYTES} (the bytes), e.g. 2048")
        self._vocab_size = vocab_size
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "gradcomp_lab_pieces")
        self.tokenizer: PieceTokenizer = PieceTokenizer([])  # type: ignore[assignment]  # fitted in _build

    @property
    def vocab_size(self) -> int:
        """The vocabulary's size, as asked (the training split has many more distinct pieces)."""
        return self._vocab_size

    @override
    def _build(self) -> None:
        train, val, _ = self._split_text()
        key = hashlib.sha256(f"{self._vocab_size}\0{len(val)}\0{train}{val}".encode()).hexdigest()[:16]
        path = self.cache_dir / f"pieces_{key}.pt"
        if path.is_file():
            cached = torch.load(path)
            self.tokenizer = PieceTokenizer(json.loads(cached["pieces"]))
            train_ids, val_ids = cached["train"], cached["val"]
        else:
            self.tokenizer = PieceTokenizer.fit(train, self._vocab_size)
            train_ids, val_ids = self.tokenizer.encode(train), self.tokenizer.encode(val)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            # written under a name of this process, then renamed: ranks building at once never read half a file
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"pieces": json.dumps(self.tokenizer.pieces), "train": train_ids, "val": val_ids}, partial)
            os.replace(partial, path)
        self.train_set = TokenWindows(train_ids, self.seq_len, self.stride)
        self.val_set = self.test_set = TokenWindows(val_ids, self.seq_len)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"Expected at least one {self.seq_len + 1}-token window per split, but got {len(self.train_set)} "
                f"training and {len(self.val_set)} validation windows. Fix: lower `seq_len` or use more text."
            )
