"""DeMo: decoupled momentum with a chunked DCT and top-k per chunk (Peng, Quesnelle & Kingma, arXiv 2411.19870).

Each rank keeps a local momentum ``m`` (the hook's residual memory, decayed: see :meth:`DeMo.sent`). Per step and
parameter, as the reference code (github.com/bloc97/DeMo, ``demo.py``):

1. ``m <- beta * m + g`` (the reference adds ``lr * g``; the update's sign makes the two the same up to the
   relative weighting of steps under a changing learning rate);
2. the tensor is cut into ``n1 x n2`` chunks (``n`` the largest divisor of each dimension not above ``chunk``;
   1-D tensors into chunks of ``n1``) and each chunk is transformed by the orthonormal 2-D DCT-II;
3. the ``topk`` largest-magnitude coefficients of each chunk are sent (values and in-chunk indices) and their
   inverse transform ``q`` is removed from the momentum: ``m <- m - q``;
4. the packets are all-gathered, summed in the coefficient domain in rank order, divided by the world size
   and inverse-transformed (the reference averages each coefficient over the ranks that selected it; we take
   the plain mean over ranks, the hook's contract; the sign step below sees the same signs whenever one rank
   dominates a coefficient);
5. the optimizer applies ``p <- p * (1 - lr * wd) - lr * sign(update)``:
   :class:`~lightning_gradcomp.optimizers.SignSGD` (``optimizer: signsgd`` in the tasks). The sign is the
   optimizer's part, not the decode's, so the averaged update stays a mean as every compressor's does.

Tensors with more than 2 dimensions are chunked as ``(shape[0], numel / shape[0])`` matrices (the reference
handles only 1-D and 2-D); 0-d tensors as one element; empty tensors send nothing.

Wire format (exact, gathered): per chunk ``min(topk, chunk elements)`` float32 values, then as many in-chunk
indices as int16 (``index_dtype="int16"``; the reference sends int64, ``index_dtype="int64"``). At the defaults
(chunk 64, top-32) a 64x64 chunk of 16384 fp32 bytes travels in 32 x (4 + 2) = 192 bytes: 85x less.
"""

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet
from lightning_gradcomp.validation import check_choice, check_int, check_number

IndexDtype = Literal["int16", "int64"]
_INDEX_DTYPES = {"int16": torch.int16, "int64": torch.int64}
#: largest chunk edge whose n x n in-chunk indices fit int16
_MAX_CHUNK = 128


@lru_cache(maxsize=64)
def dct_matrix(n: int) -> Tensor:
    """The orthonormal DCT-II matrix ``D`` (``n x n``, float64, ``D @ D.T == I``): ``X = D @ x``."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


def largest_divisor(size: int, target: int) -> int:
    """The largest divisor of ``size`` not above ``target`` (the reference's ``_get_smaller_split``)."""
    for d in range(min(size, target), 0, -1):
        if size % d == 0:
            return d
    return 1


class ChunkedDCT:
    """The chunked 2-D DCT of one tensor shape: :meth:`encode` to ``(chunks, n1 * n2)`` coefficients and back.

    Args:
        shape: the tensor's shape (more than 2 dimensions: treated as ``(shape[0], rest)``; 0-d: ``(1,)``).
        chunk: target chunk edge.
        dtype: dtype of the transform matrices (the tensor's).
    """

    def __init__(self, shape: torch.Size, chunk: int, dtype: torch.dtype, device: torch.device) -> None:
        numel = shape.numel()
        rows, cols = (shape[0], numel // max(1, shape[0])) if len(shape) >= 2 else (1, numel)
        self.rows, self.cols = rows, cols
        self.n1 = largest_divisor(rows, chunk) if len(shape) >= 2 else 1
        self.n2 = largest_divisor(cols, chunk) if cols else 1
        self.d1 = dct_matrix(self.n1).to(dtype=dtype, device=device)
        self.d2 = dct_matrix(self.n2).to(dtype=dtype, device=device)
        self.chunks = (rows // self.n1) * (cols // self.n2) if numel else 0
        self.chunk_numel = self.n1 * self.n2

    def encode(self, x: Tensor) -> Tensor:
        """Coefficients ``(chunks, n1 * n2)`` of ``x``: ``D1 @ block @ D2.T`` per chunk."""
        blocks = x.reshape(self.rows // self.n1, self.n1, self.cols // self.n2, self.n2)
        coeffs = torch.einsum("yhxw,bh,dw->yxbd", blocks, self.d1, self.d2)
        return coeffs.reshape(self.chunks, self.chunk_numel)

    def decode(self, coeffs: Tensor, shape: torch.Size) -> Tensor:
        """The tensor of ``shape`` whose chunks have coefficients ``coeffs`` (``D1.T @ C @ D2`` per chunk)."""
        c = coeffs.reshape(self.rows // self.n1, self.cols // self.n2, self.n1, self.n2)
        return torch.einsum("yxbd,bh,dw->yhxw", c, self.d1, self.d2).reshape(shape)


class DeMo(Compressor):
    """DeMo's momentum extraction: top-k DCT coefficients per chunk of a decayed local momentum.

    Use with :class:`~lightning_gradcomp.optimizers.SignSGD` (the method's update; see the module docstring).

    Args:
        topk: coefficients sent per chunk (reference default 32; clamped to the chunk's size, as the reference).
        chunk: target chunk edge (reference default 64; at most 128 so in-chunk indices fit int16).
        beta: momentum decay ``compression_decay`` in [0, 1) (reference default 0.999).
        index_dtype: ``"int16"`` in-chunk indices on the wire, or the reference's ``"int64"``.
    """

    aggregation = Aggregation.GATHER
    uses_memory = True
    fixed_size = True

    def __init__(self, topk: int = 32, chunk: int = 64, beta: float = 0.999, index_dtype: IndexDtype = "int16") -> None:
        super().__init__()
        check_int("topk", topk, minimum=1, fix="send at least 1 coefficient per chunk (DeMo: 32)")
        check_int("chunk", chunk, minimum=1)
        if chunk > _MAX_CHUNK:
            raise ValueError(
                f"Expected `chunk` to be an integer <= {_MAX_CHUNK}, but got {chunk!r}. "
                f"Fix: use DeMo's 64 (in-chunk indices travel as int16)."
            )
        check_number("beta", beta, minimum=0.0, maximum=1.0, max_open=True, fix="use DeMo's 0.999")
        check_choice("index_dtype", index_dtype, tuple(_INDEX_DTYPES))
        self.topk, self.chunk, self.beta, self.index_dtype = topk, chunk, float(beta), index_dtype
        self._transforms: dict[tuple[torch.Size, torch.dtype, torch.device], ChunkedDCT] = {}

    def transform(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> ChunkedDCT:
        """The (cached) chunked DCT of a tensor shape."""
        key = (torch.Size(shape), dtype, device)
        if key not in self._transforms:
            self._transforms[key] = ChunkedDCT(torch.Size(shape), self.chunk, dtype, device)
        return self._transforms[key]

    def kept_per_chunk(self, shape: torch.Size) -> int:
        """Coefficients sent per chunk of a tensor of ``shape``."""
        return min(self.topk, ChunkedDCT(torch.Size(shape), self.chunk, torch.float32, torch.device("cpu")).chunk_numel)

    def packet_bytes(self, shape: torch.Size) -> int:
        """Exact wire bytes of one packet for a tensor of ``shape``."""
        t = ChunkedDCT(torch.Size(shape), self.chunk, torch.float32, torch.device("cpu"))
        k = min(self.topk, t.chunk_numel)
        return t.chunks * k * (4 + _INDEX_DTYPES[self.index_dtype].itemsize)

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        x = tensor.detach()
        t = self.transform(x.shape, x.dtype, x.device)
        if t.chunks == 0:
            empty = x.new_empty(0, dtype=torch.uint8)
            return Packet(payload=empty, shape=x.shape, dtype=x.dtype, stats={"sparsity": x.new_zeros((), dtype=torch.float32)})
        coeffs = t.encode(x)
        k = min(self.topk, t.chunk_numel)
        indices = torch.topk(coeffs.abs(), k, dim=1, sorted=False).indices
        values = torch.gather(coeffs, 1, indices)
        payload = torch.cat((
            values.float().reshape(-1).view(torch.uint8),
            indices.to(_INDEX_DTYPES[self.index_dtype]).reshape(-1).view(torch.uint8),
        ))
        total = coeffs.pow(2).sum()
        # orthonormal transform: the share of the momentum's energy this packet removes from it
        energy = torch.where(total > 0, values.pow(2).sum() / total, torch.ones_like(total)).float()
        stats = {"sparsity": x.new_tensor(1.0 - k / t.chunk_numel, dtype=torch.float32), "energy_kept": energy}
        return Packet(payload=payload, shape=x.shape, dtype=x.dtype, stats=stats)

    def _coefficients(self, packets: Sequence[Packet]) -> tuple[ChunkedDCT, Tensor]:
        """The packets' coefficients summed in the given order, ``(chunks, n1 * n2)``."""
        first = packets[0]
        t = self.transform(first.shape, first.dtype, first.payload.device)
        k = min(self.topk, t.chunk_numel)
        n = t.chunks * k
        coeffs = torch.zeros(t.chunks, t.chunk_numel, dtype=first.dtype, device=first.payload.device)
        index_dtype = _INDEX_DTYPES[self.index_dtype]
        for packet in packets:
            raw = packet.payload
            # clone: a slice of a gathered byte buffer may be misaligned for wider dtypes
            values = raw[: 4 * n].clone().view(torch.float32).to(first.dtype).view(t.chunks, k)
            indices = raw[4 * n :].clone().view(index_dtype).long().view(t.chunks, k)
            coeffs.scatter_add_(1, indices, values)
        return t, coeffs

    def decompress(self, packet: Packet) -> Tensor:
        return self.decompress_sum([packet])

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        # linear: summing in the coefficient domain and transforming once equals transforming each and summing
        first = packets[0]
        if first.numel == 0:
            return torch.zeros(first.shape, dtype=first.dtype, device=first.payload.device)
        t, coeffs = self._coefficients(packets)
        return t.decode(coeffs, first.shape)

    def sent(self, tensor: Tensor, packet: Packet) -> Tensor:
        """``x - beta * (x - q)``, so the hook's residual ``x - sent`` is DeMo's decayed momentum ``beta * (m - q)``.

        The hook's error feedback keeps ``x - sent`` and adds it to the next gradient, which makes the next
        input ``g + beta * (m - q)``: DeMo's ``m <- beta * m + g`` after the transmitted ``q`` was removed.
        """
        q = self.decompress(packet)
        return tensor - self.beta * (tensor - q)

    def describe(self) -> dict[str, Any]:
        return {"compressor": "DeMo", "topk": self.topk, "chunk": self.chunk, "beta": self.beta,
                "index_dtype": self.index_dtype}
