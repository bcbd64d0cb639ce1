"""A small attentional LSTM encoder-decoder (the shape of Aji & Heafield's NMT model, at toy scale)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_gradcomp.validation import check_int, check_number

PAD_ID, BOS_ID, EOS_ID = 0, 2, 3  # the ids of gradcomp_lab.data.parallel_text.Vocab


class Seq2SeqAttention(nn.Module):
    """Bidirectional LSTM encoder, LSTM decoder with Luong "general" attention, teacher-forced training.

    The decoder starts from the encoder's final states (forward and backward halves concatenated) and
    attends over the encoder outputs, padding masked out; ``tanh(W [context; h])`` feeds the output layer.
    ``layer_norm`` normalises that attentional vector (Aji & Heafield need layer norm for a global threshold).

    Args:
        src_vocab_size: source vocabulary (id 0 is padding).
        tgt_vocab_size: target vocabulary (ids 0, 2, 3 are padding, begin, end).
        embedding_dim: token embedding size on both sides.
        hidden_size: encoder output and decoder state size (even: each encoder direction gets half).
        num_layers: LSTM layers on each side.
        dropout: dropout on embeddings and the attentional vector.
        layer_norm: LayerNorm on the attentional vector.
    """

    def __init__(
        self,
        src_vocab_size: int = 10000,
        tgt_vocab_size: int = 10000,
        embedding_dim: int = 256,
        hidden_size: int = 256,
        num_layers: int = 1,
        dropout: float = 0.1,
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        check_int("src_vocab_size", src_vocab_size, minimum=4)
        check_int("tgt_vocab_size", tgt_vocab_size, minimum=4)
        check_int("num_layers", num_layers, minimum=1)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        if hidden_size < 2 or hidden_size % 2:
            raise ValueError(f"Expected `hidden_size` to be an even integer >= 2, but got {hidden_size!r}.")
        self.num_layers = num_layers
        self.src_embedding = nn.Embedding(src_vocab_size, embedding_dim, padding_idx=PAD_ID)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, embedding_dim, padding_idx=PAD_ID)
        self.encoder = nn.LSTM(embedding_dim, hidden_size // 2, num_layers, batch_first=True, bidirectional=True)
        self.decoder = nn.LSTM(embedding_dim, hidden_size, num_layers, batch_first=True)
        self.attention = nn.Linear(hidden_size, hidden_size, bias=False)
        self.combine = nn.Linear(2 * hidden_size, hidden_size)
        self.norm = nn.LayerNorm(hidden_size) if layer_norm else nn.Identity()
        self.dropout = nn.Dropout(dropout)
        self.output = nn.Linear(hidden_size, tgt_vocab_size)

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """Encoder outputs ``(B, S, H)``, the padding mask ``(B, S)`` and the decoder's initial state."""
        embedded = self.dropout(self.src_embedding(src))
        packed = pack_padded_sequence(embedded, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, (h, c) = self.encoder(packed)
        memory, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])

        def merge(state: Tensor) -> Tensor:  # (2L, B, H/2) -> (L, B, H): join directions per layer
            return state.view(self.num_layers, 2, *state.shape[1:]).transpose(1, 2).flatten(2)

        return memory, src != PAD_ID, (merge(h), merge(c))

    def _attend(self, dec_out: Tensor, memory: Tensor, mask: Tensor) -> Tensor:
        scores = torch.bmm(self.attention(dec_out), memory.transpose(1, 2))  # (B, T, S)
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        context = torch.bmm(scores.softmax(-1), memory)
        combined = self.norm(torch.tanh(self.combine(torch.cat([context, dec_out], dim=-1))))
        return self.output(self.dropout(combined))

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits ``(B, T, tgt_vocab_size)`` for decoder inputs ``tgt_in`` (``<bos>`` first)."""
        memory, mask, state = self.encode(src, src_lengths)
        dec_out, _ = self.decoder(self.dropout(self.tgt_embedding(tgt_in)), state)
        return self._attend(dec_out, memory, mask)

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, src_lengths: Tensor, max_len: int) -> Tensor:
        """Greedy translations ``(B, max_len)``; positions after ``<eos>`` are padding."""
        memory, mask, state = self.encode(src, src_lengths)
        token = torch.full((src.shape[0], 1), BOS_ID, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        out = []
        for _ in range(max_len):
            dec_out, state = self.decoder(self.tgt_embedding(token), state)
            token = self._attend(dec_out, memory, mask).argmax(-1)
            out.append(token.masked_fill(done.unsqueeze(1), PAD_ID))
            done |= token.squeeze(1) == EOS_ID
            if bool(done.all()):
                break
        result = torch.cat(out, dim=1)
        return F.pad(result, (0, max_len - result.shape[1]), value=PAD_ID)
