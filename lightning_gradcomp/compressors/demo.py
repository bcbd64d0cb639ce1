"""DeMo: decoupled momentum with a chunked DCT and top-k per chunk (Peng, Quesnelle & Kingma, arXiv 2411.19870).

Each rank keeps a local momentum ``m`` (the hook's residual memory, decayed: see :meth:`DeMo.sent`). Per step and
parameter, as the reference code (github.com/bloc97/DeMo, ``demo.py``):

1. ``m <- beta * m + g`` (the reference adds ``lr * g``; the update's sign makes the two the same up to the
   relative weighting of steps under a changing learning rate);
2. the tensor is cut into ``n1 x n2`` chunks (``n`` the largest divisor of each dimension not above ``chunk``;
   1-D tensors into chunks of ``n1``) and each chunk is transformed by the orthonormal 2-D DCT-II;
3. the ``topk`` largest-magnitude coefficients of each chunk are sent (values and in-chunk indices) and their
   inverse transform ``q`` is removed from the momentum: ``m <- m - q``;
4. the packets are all-gathered, summed in the coefficient domain in rank order, averaged and inverse-transformed.
   ``average="ranks"`` (the default) divides every coefficient by the world size: the plain mean, the hook's
   contract for every other compressor. ``average="selectors"`` divides each coefficient by the number of ranks
   that sent it, as the reference's ``scatter_reduce(reduce="mean", include_self=False)`` does. The two differ
   where the ranks' selections differ: a coefficient one rank of four sent counts four times more against the
   others under ``"selectors"``, so the decoded update, and its sign, can differ;
5. the optimizer applies ``p <- p * (1 - lr * wd) - lr * sign(update)``:
   :class:`~lightning_gradcomp.optimizers.SignSGD` (``optimizer: signsgd`` in the tasks). The sign is the
   optimizer's part, not the decode's, so the averaged update stays a mean as every compressor's does.

Tensors with more than 2 dimensions are chunked as ``(shape[0], numel / shape[0])`` matrices (the reference
handles only 1-D and 2-D); 0-d tensors as one element; empty tensors send nothing.

Wire format (exact, gathered): per chunk ``min(topk, chunk elements)`` float32 values and as many in-chunk
indices as int16 (``index_dtype="int16"``; the reference sends int64, ``index_dtype="int64"``; chunks of at most
16 x 16 can send them as ``"uint8"``, one byte each). At the defaults
(chunk 64, top-32) a 64x64 chunk of 16384 fp32 bytes travels in 32 x (4 + 2) = 192 bytes: 85x less. A layer's
packet holds its values, then its indices.

Batched (the hook's flat pipeline, :meth:`DeMo.compress_flat`): the layers of a group whose chunking gives the same
chunk shape ``n1 x n2`` form one *chunk class*; their chunks are gathered from the flat gradient with one
``index_select``, stacked, transformed with one batched product per side and cut with one ``topk``; decoding
scatters them back with one ``scatter_``. The ops per group grow with the number of distinct chunk shapes, not
with the number of layers. The group payload holds, class after class, the values of all its chunks, then their
indices; each layer still puts exactly its own packet's bytes on the wire. A single layer (:meth:`DeMo.compress`) is
a group of one: one implementation. Against the layer-by-layer path, where a class holds chunks of several layers,
coefficients and decoded values may differ in the last bit (BLAS may sum a product of another height in another
order), so a chunk whose k-th and (k+1)-th magnitudes are within a rounding error of each other may select the other
one; every rank runs the same products, so replicas agree (``tests/unit/test_flat_demo_powersgd.py``).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Aggregation, OptimizerCheck, SharedStatistic, SelectsElements
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.validation import check_choice, check_int, check_number

IndexDtype = Literal["uint8", "int16", "int64"]
Average = Literal["ranks", "selectors"]
_INDEX_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int64": torch.int64}
#: largest chunk edge per index dtype: n x n in-chunk indices must fit it (uint8: 16 x 16 = 256; int16: 128 x 128);
#: int64 keeps int16's bound, the chunks DeMo's reference uses
_MAX_CHUNK = {"uint8": 16, "int16": 128, "int64": 128}


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


def dct_blocks(blocks: Tensor, d1: Tensor, d2: Tensor) -> Tensor:
    """The 2-D DCT ``D1 @ B @ D2.T`` of every block ``B`` of ``blocks`` (``[K, n1, n2]``), ``[K, n1, n2]``.

    One batched product per side whatever ``K``. A side of 1 is skipped: its DCT is exactly the identity.
    """
    y = blocks if d1.shape[0] == 1 else torch.matmul(d1, blocks)
    return y if d2.shape[0] == 1 else torch.matmul(y, d2.mT)


def idct_blocks(coeffs: Tensor, d1: Tensor, d2: Tensor) -> Tensor:
    """The inverse of :func:`dct_blocks`: ``D1.T @ C @ D2`` of every block of ``coeffs`` (``[K, n1, n2]``)."""
    y = coeffs if d1.shape[0] == 1 else torch.matmul(d1.mT, coeffs)
    return y if d2.shape[0] == 1 else torch.matmul(y, d2)


class ChunkedDCT:
    """The chunked 2-D DCT of one tensor shape: :meth:`encode` to ``(chunks, n1 * n2)`` coefficients and back.

    Args:
        shape: the tensor's shape (more than 2 dimensions: treated as ``(shape[0], rest)``; 0-d: ``(1,)``).
        chunk: target chunk edge.
        dtype: dtype of the transform matrices (the tensor's).
        device: device of the transform matrices.
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

    def blocks(self, x: Tensor) -> Tensor:
        """The chunks of ``x`` (the tensor, any shape of its numel), ``[chunks, n1, n2]``, row of chunks after row."""
        blocks = x.reshape(self.rows // self.n1, self.n1, self.cols // self.n2, self.n2).transpose(1, 2)
        return blocks.reshape(self.chunks, self.n1, self.n2)

    def positions(self) -> Tensor:
        """int64 ``[numel]`` (CPU): the flat position of every element of :meth:`blocks`, chunk after chunk."""
        return self.blocks(torch.arange(self.rows * self.cols)).reshape(-1)

    def encode(self, x: Tensor) -> Tensor:
        """Coefficients ``(chunks, n1 * n2)`` of ``x``: ``D1 @ block @ D2.T`` per chunk."""
        return dct_blocks(self.blocks(x), self.d1, self.d2).reshape(self.chunks, self.chunk_numel)

    def decode(self, coeffs: Tensor, shape: torch.Size) -> Tensor:
        """The tensor of ``shape`` whose chunks have coefficients ``coeffs`` (``D1.T @ C @ D2`` per chunk)."""
        blocks = idct_blocks(coeffs.reshape(self.chunks, self.n1, self.n2), self.d1, self.d2)
        out = blocks.new_empty(self.rows * self.cols)
        return out.scatter_(0, self.positions().to(out.device), blocks.reshape(-1)).view(shape)


@dataclass(frozen=True)
class _ChunkClass:
    """The chunks of every layer of a group whose chunks are ``n1 x n2``, stacked: one transform and one top-k.

    Attributes:
        n1, n2: the chunk shape.
        k: coefficients kept per chunk.
        chunks: chunks of the class (all its layers).
        d1, d2: the DCT matrices of the two sides.
        positions: int64 ``[chunks * n1 * n2]``: the flat position in the group of every chunk element, chunk
            after chunk, layer after layer.
        values_at, indices_at: byte offsets of the class's values and indices in the group payload.
    """

    n1: int
    n2: int
    k: int
    chunks: int
    d1: Tensor
    d2: Tensor
    positions: Tensor
    values_at: int
    indices_at: int


@dataclass(frozen=True)
class _GroupPlan:
    """How a group of layers (shapes, dtype, device) is chunked: its chunk classes and per-layer constants.

    Attributes:
        classes: the chunk classes, in order of their first layer.
        chunk_layer: int64 ``[all chunks]``: the layer of every chunk, class after class (per-layer statistics).
        layer_nbytes: wire bytes of every layer.
        sparsity: float32 ``[layers]``: share of each layer's coefficients not sent (0 for an empty layer).
    """

    classes: tuple[_ChunkClass, ...]
    chunk_layer: Tensor
    layer_nbytes: tuple[int, ...]
    sparsity: Tensor


class DeMo(OptimizerCheck, SelectsElements):
    """DeMo's momentum extraction: top-k DCT coefficients per chunk of a decayed local momentum.

    Use with :class:`~lightning_gradcomp.optimizers.SignSGD` (the method's update; see the module docstring).

    Args:
        topk: coefficients sent per chunk (reference default 32; clamped to the chunk's size, as the reference).
        chunk: target chunk edge (reference default 64; at most 128 so in-chunk indices fit int16).
        beta: momentum decay ``compression_decay`` in [0, 1) (reference default 0.999).
        index_dtype: ``"int16"`` in-chunk indices on the wire, the reference's ``"int64"``, or ``"uint8"`` where
            ``chunk <= 16`` (a chunk of at most 256 coefficients: 5 bytes per coefficient instead of 6).
        average: how the gathered coefficients are averaged: ``"ranks"`` over the world size (the plain mean,
            as every compressor), or ``"selectors"`` over the ranks that sent each coefficient (the reference's
            decode). Bytes, residual and replicas are the same under both; only the decoded mean differs.
    """

    aggregation = Aggregation.GATHER
    uses_memory = True
    fixed_size = True
    batched = True

    def __init__(
        self,
        topk: int = 32,
        chunk: int = 64,
        beta: float = 0.999,
        index_dtype: IndexDtype = "int16",
        average: Average = "ranks",
    ) -> None:
        super().__init__()
        check_int("topk", topk, minimum=1, fix="send at least 1 coefficient per chunk (DeMo: 32)")
        check_int("chunk", chunk, minimum=1)
        check_number("beta", beta, minimum=0.0, maximum=1.0, max_open=True, fix="use DeMo's 0.999")
        check_choice("index_dtype", index_dtype, tuple(_INDEX_DTYPES))
        if chunk > _MAX_CHUNK[index_dtype]:
            raise ValueError(
                f"Expected `chunk` to be an integer <= {_MAX_CHUNK[index_dtype]} with index_dtype={index_dtype!r} (a "
                f"chunk's in-chunk indices must fit it), but got {chunk!r}. Fix: use DeMo's 64 with 'int16' indices."
            )
        check_choice("average", average, ("ranks", "selectors"))
        self.topk, self.chunk, self.beta, self.index_dtype = topk, chunk, float(beta), index_dtype
        self.average: Average = average
        self._plans: dict[tuple[tuple[torch.Size, ...], torch.dtype, torch.device], _GroupPlan] = {}

    def kept_per_chunk(self, shape: torch.Size) -> int:
        """Coefficients sent per chunk of a tensor of ``shape``."""
        return min(self.topk, ChunkedDCT(torch.Size(shape), self.chunk, torch.float32, torch.device("cpu")).chunk_numel)

    def packet_bytes(self, shape: torch.Size) -> int:
        """Exact wire bytes of one packet for a tensor of ``shape``."""
        t = ChunkedDCT(torch.Size(shape), self.chunk, torch.float32, torch.device("cpu"))
        k = min(self.topk, t.chunk_numel)
        return t.chunks * k * (4 + _INDEX_DTYPES[self.index_dtype].itemsize)

    def _plan(self, segments: Segments, dtype: torch.dtype, device: torch.device) -> _GroupPlan:
        """The (cached) chunking of a group: built once per layout, dtype and device, on the host."""
        key = (segments.shapes, dtype, device)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        members: dict[tuple[int, int], list[tuple[int, ChunkedDCT]]] = {}
        sparsity = []
        for i, shape in enumerate(segments.shapes):
            t = ChunkedDCT(shape, self.chunk, dtype, device)
            sparsity.append(1.0 - min(self.topk, t.chunk_numel) / t.chunk_numel if t.chunks else 0.0)
            if t.chunks:
                members.setdefault((t.n1, t.n2), []).append((i, t))
        index_size = _INDEX_DTYPES[self.index_dtype].itemsize
        classes, chunk_layer, at = [], [], 0
        for (n1, n2), layers in members.items():
            k = min(self.topk, n1 * n2)
            chunks = sum(t.chunks for _, t in layers)
            positions = torch.cat([t.positions() + segments.offsets[i] for i, t in layers]).to(device)
            first = layers[0][1]
            classes.append(_ChunkClass(n1, n2, k, chunks, first.d1, first.d2, positions, at, at + 4 * chunks * k))
            chunk_layer += [torch.full((t.chunks,), i, dtype=torch.int64) for i, t in layers]
            at += chunks * k * (4 + index_size)
        plan = _GroupPlan(
            classes=tuple(classes),
            chunk_layer=(torch.cat(chunk_layer) if chunk_layer else torch.zeros(0, dtype=torch.int64)).to(device),
            layer_nbytes=tuple(self.packet_bytes(s) for s in segments.shapes),
            sparsity=torch.tensor(sparsity, dtype=torch.float32, device=device),
        )
        self._plans[key] = plan
        return plan

    @staticmethod
    def _energy_kept(plan: _GroupPlan, kept: list[Tensor], total: list[Tensor], layers: int, like: Tensor) -> Tensor:
        """Per layer: the share of the momentum's energy the packet removes from it (the transform is orthonormal,
        so coefficient energy is tensor energy); 1 for a layer without energy, an empty one included."""
        if not kept:
            return torch.ones(layers, dtype=torch.float32, device=like.device)
        kept_l = like.new_zeros(layers).index_add_(0, plan.chunk_layer, torch.cat(kept))
        total_l = like.new_zeros(layers).index_add_(0, plan.chunk_layer, torch.cat(total))
        return torch.where(total_l > 0, kept_l / total_l, torch.ones_like(total_l)).float()

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return None

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        x = flat.detach()
        plan = self._plan(segments, x.dtype, x.device)
        index_dtype = _INDEX_DTYPES[self.index_dtype]
        parts: list[Tensor] = []
        kept: list[Tensor] = []
        total: list[Tensor] = []
        for c in plan.classes:
            blocks = x.index_select(0, c.positions).view(c.chunks, c.n1, c.n2)
            coeffs = dct_blocks(blocks, c.d1, c.d2).reshape(c.chunks, c.n1 * c.n2)
            indices = torch.topk(coeffs.abs(), c.k, dim=1, sorted=False).indices
            values = torch.gather(coeffs, 1, indices)
            parts += [values.float().reshape(-1).view(torch.uint8), indices.to(index_dtype).reshape(-1).view(torch.uint8)]
            kept.append(values.pow(2).sum(1))
            total.append(coeffs.pow(2).sum(1))
        payload = torch.cat(parts) if parts else x.new_empty(0, dtype=torch.uint8)
        stats = {"sparsity": plan.sparsity, "energy_kept": self._energy_kept(plan, kept, total, len(segments), x)}
        return FlatPacket(payload, segments, x.dtype, plan.layer_nbytes, stats=stats)

    def _sum_into(self, payloads: Sequence[Tensor], plan: _GroupPlan, out: Tensor, per_selector: bool = False) -> Tensor:
        """The sum of the payloads' decoded groups, in the given (rank) order, written over ``out`` (flat).

        Summed in the coefficient domain (linear), one ``scatter_add_`` per payload: a payload's indices are
        distinct within each chunk, so each call is free of colliding writes and the ranks add up in the given
        order on every device (one call for all ranks would leave that order to atomics on a GPU). With
        ``per_selector`` each coefficient is divided by the number of payloads that carry it before the inverse
        transform (the reference's mean over the ranks that selected it).
        """
        index_dtype = _INDEX_DTYPES[self.index_dtype]
        index_size = index_dtype.itemsize
        for c in plan.classes:
            n = c.chunks * c.k
            coeffs = out.new_zeros(c.chunks, c.n1 * c.n2)
            # the count of senders per coefficient, one ``ones`` added per payload
            selectors = out.new_zeros(c.chunks, c.n1 * c.n2) if per_selector else None
            ones = out.new_ones(c.chunks, c.k) if per_selector else None
            for payload in payloads:
                raw = payload.view(torch.uint8)
                # clone: a slice of a gathered byte buffer may be misaligned for wider dtypes
                values = raw[c.values_at : c.values_at + 4 * n].clone().view(torch.float32).to(out.dtype)
                indices = raw[c.indices_at : c.indices_at + index_size * n].clone().view(index_dtype).long()
                coeffs.scatter_add_(1, indices.view(c.chunks, c.k), values.view(c.chunks, c.k))
                if selectors is not None and ones is not None:
                    selectors.scatter_add_(1, indices.view(c.chunks, c.k), ones)
            if selectors is not None:
                coeffs.div_(selectors.clamp_(min=1))  # counts are exact small integers: no rounding but the division
            blocks = idct_blocks(coeffs.view(c.chunks, c.n1, c.n2), c.d1, c.d2)
            out.scatter_(0, c.positions, blocks.reshape(-1))
        return out

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        out = torch.empty(packet.segments.total, dtype=packet.dtype, device=packet.payload.device)
        return self._sum_into([packet.payload], self._plan(packet.segments, packet.dtype, out.device), out)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        first = packets[0]
        plan = self._plan(first.segments, first.dtype, out.device)
        if self.average == "selectors":
            return self._sum_into([p.payload for p in packets], plan, out, per_selector=True)
        return self._sum_into([p.payload for p in packets], plan, out).div_(len(packets))

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        """``x - beta * (x - q)``, so the hook's residual ``x - sent`` is DeMo's decayed momentum ``beta * (m - q)``.

        The hook's error feedback keeps ``x - sent`` and adds it to the next gradient, which makes the next
        input ``g + beta * (m - q)``: DeMo's ``m <- beta * m + g`` after the transmitted ``q`` was removed.
        """
        return self._decayed(flat, self.decompress_flat(packet))

    def _decayed(self, x: Tensor, q: Tensor) -> Tensor:
        return x - self.beta * (x - q)

    def check_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Warn once (rank 0, at setup) about an optimizer that keeps momentum of its own on top of DeMo's.

        DeMo's decoded update is already a momentum (``beta``, decayed in the residual); its update is
        ``sign(update)`` (:class:`~lightning_gradcomp.optimizers.SignSGD`). Adam or AdamW normalise it again with
        moments of their own, and SGD momentum adds a second momentum: both run, but neither is DeMo's method, so the
        fix is named before the first step. Allowed rather than refused: another optimizer may be a deliberate
        ablation of DeMo's sign step.
        """
        found = []
        for optimizer in optimizers:
            for index, group in enumerate(optimizer.param_groups):
                if "betas" in group:
                    found.append(f"{type(optimizer).__name__} (param group {index}: moments of its own, betas="
                                 f"{tuple(group['betas'])})")
                elif group.get("momentum", 0.0):
                    found.append(f"{type(optimizer).__name__} with momentum={group['momentum']} (param group {index}: "
                                 f"a second momentum on top of DeMo's)")
        if found:
            rank_zero_warn(
                f"Expected DeMo's optimizer to be SignSGD (DeMo's update is a sign step on its own decayed momentum, "
                f"beta={self.beta}), but got {'; '.join(found)}. This runs, but it is not DeMo's update and can "
                f"train much worse. Fix: use `lightning_gradcomp.optimizers.SignSGD(params, lr=..., weight_decay=...)` "
                f"(`optimizer: signsgd` in a recipe), or plain SGD with momentum=0.",
                category=UserWarning,
            )

    def describe(self) -> dict[str, Any]:
        return {"compressor": "DeMo", "topk": self.topk, "chunk": self.chunk, "beta": self.beta,
                "index_dtype": self.index_dtype, "average": self.average}
