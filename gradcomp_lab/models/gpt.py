"""A small decoder-only transformer (GPT-2 layout): pre-norm blocks, causal self-attention, tied embeddings."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gradcomp.validation import check_int, check_number


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention over earlier positions only (``scaled_dot_product_attention``, causal)."""

    def __init__(self, width: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))`` (pre-norm, GPT-2)."""

    def __init__(self, width: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, num_heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and learned position embeddings, ``depth`` pre-norm blocks, a final norm, tied output projection.

    Initialised as GPT-2: normal(0, 0.02) weights, residual projections scaled by ``1 / sqrt(2 * depth)``.

    Args:
        vocab_size: tokens (256 for the byte corpora).
        width: embedding width (divisible by ``num_heads``).
        depth: transformer blocks.
        num_heads: attention heads per block.
        context: longest sequence (learned position embeddings).
        dropout: dropout on embeddings, attention and MLP outputs.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        width: int = 128,
        depth: int = 4,
        num_heads: int = 4,
        context: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("width", width), ("depth", depth), ("num_heads", num_heads),
                            ("context", context)):
            check_int(name, value, minimum=1)
        if width % num_heads:
            raise ValueError(
                f"Expected `width` to be divisible by `num_heads` ({num_heads}), but got {width}. "
                f"Fix: use a width that is a multiple of num_heads, e.g. {num_heads * max(1, width // num_heads)}."
            )
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True)
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, num_heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``x`` of shape ``(B, T)`` with ``T <= context``."""
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"Expected sequences of at most {self.context} tokens, but got {t}. Fix: raise `context`.")
        h = self.drop(self.token_embedding(x) + self.position_embedding(torch.arange(t, device=x.device)))
        for block in self.blocks:
            h = block(h)
        # tied: the output projection is the token embedding (one matrix, one gradient, one packet)
        return F.linear(self.ln_f(h), self.token_embedding.weight)
