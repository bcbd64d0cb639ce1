"""Character-level LSTM language model (Karpathy's char-rnn; AdaComp's Shakespeare LSTM)."""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gradcomp.validation import check_int, check_number


class CharLSTM(nn.Module):
    """One-hot characters -> ``num_layers`` LSTM layers of ``hidden_size`` -> fc to character logits.

    AdaComp Table 2: 2 LSTM layers (67x512, 512x512) + fc 512x67, about 3.3M parameters (13 MB); char-rnn
    feeds one-hot vectors, not an embedding (``embedding_dim=None``).

    Args:
        vocab_size: number of characters.
        hidden_size: LSTM units per layer.
        num_layers: stacked LSTM layers.
        dropout: dropout between LSTM layers and before the output fc (char-rnn default 0).
        embedding_dim: learn an embedding of this size instead of the one-hot input.
    """

    def __init__(
        self,
        vocab_size: int = 65,
        hidden_size: int = 512,
        num_layers: int = 2,
        dropout: float = 0.0,
        embedding_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_int("vocab_size", vocab_size, minimum=1)
        check_int("hidden_size", hidden_size, minimum=1)
        check_int("num_layers", num_layers, minimum=1)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embedding_dim) if embedding_dim else None
        input_size = embedding_dim or vocab_size
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True, dropout=dropout if num_layers > 1 else 0.0)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden_size, vocab_size)

    def forward(self, x: Tensor, state: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for character ids ``x`` of shape ``(B, T)``."""
        inputs = self.embedding(x) if self.embedding is not None else F.one_hot(x, self.vocab_size).float()
        out, _ = self.lstm(inputs, state)
        return self.fc(self.dropout(out))
