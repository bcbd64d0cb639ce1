"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r gradient approximation by one step of power iteration.

Per matrix M (the gradient viewed as ``[shape[0], -1]``, plus this rank's error), as torch's
``powerSGD_hook`` computes it:

1. Q (m x r): the previous step's averaged Q (warm start) or a random one drawn identically on every rank,
   orthogonalized;
2. P = M Q, all-reduced (summed: the scale is removed by the next step), orthogonalized;
3. Q = M^T P, all-reduced and divided by the world size;
4. the decoded mean is P Q^T; the error kept for the next step is ``M - P Q^T``.

Tensors with ``dim() <= 1``, or too small to gain ``min_compression_rate`` (``(n + m) * r *
min_compression_rate >= n * m``), are all-reduced dense; they travel in the same all-reduce as the P factors.

Unlike torch's hook, both rounds are issued from the hook body through
:meth:`~lightning_gradcomp.compressors.multiround.MultiRoundCompressor.exchange`, so it cannot hang on Gloo
with several buckets. Factors are kept by parameter name, not by bucket index.

Batched by shape: the tensors of a bucket with the same shape are stacked, so P, Q and the approximation are one
batched product each (:func:`project`, :func:`project_back`, :func:`outer`: each written in the form torch's CPU
``bmm`` runs fastest) and the orthogonalization runs on the whole stack (:func:`orthogonalize_` takes a batch); dense
tensors of one shape travel stacked too. The ops per exchange grow with the number of distinct shapes, not of
tensors; the rounds stay two all-reduces for the whole bucket, each laid out shape group after shape group
(``tests/unit/test_flat_demo_powersgd.py``). A fresh random Q (the first step, a new shape, ``warm_start=False``)
is still drawn tensor by tensor in layer order, as torch's hook draws it, so the random start stays torch's.

The hook calls :meth:`PowerSGD.exchange_flat` on a group in one flat tensor: every class's elements are gathered with
one ``index_select`` (all dense classes in one, all low-rank classes in another) and the results scattered back with
one ``scatter`` each, so the hook's whole multi-round path dispatches a number of ops set by the shapes.
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import SharedStatistic
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.multiround import AllReduce, Exchanged, FlatExchanged, MultiRoundCompressor
from lightning_gradcomp.validation import check_int, check_number


def orthogonalize_(matrix: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalize the columns of ``matrix`` (``[m, r]``, or a batch ``[B, m, r]`` of them, each on its own) in
    place, as torch's PowerSGD does, and return it.

    Gram-Schmidt for rank <= 2 (faster there, and the only choice for half precision), QR otherwise.
    """
    rank = matrix.shape[-1]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrix[..., i : i + 1]
            # torch divides by the bare norm (NaN for an all-zero column, e.g. a layer with no gradient this step);
            # clamping at the smallest normal float changes nothing else and sends zeros instead
            col /= torch.norm(col, dim=-2, keepdim=True).clamp_min(torch.finfo(col.dtype).tiny) + epsilon
            if i + 1 < rank:
                rest = matrix[..., i + 1 :]
                rest -= torch.sum(col * rest, dim=-2, keepdim=True) * col
    else:
        matrix.copy_(torch.linalg.qr(matrix).Q)
    return matrix


def project(matrices: Tensor, factors: Tensor) -> Tensor:
    """``M Q`` for a stack: ``[B, n, m]`` by ``[B, m, r]``, as ``(Q^T M^T)^T`` (a view, not contiguous).

    The same product; on CPU torch's ``bmm`` runs the skinny ``[n, m] x [m, r]`` form up to 5x slower than its
    transpose, for stacks of several matrices and for ranks above 1 (``benchmarks/powersgd_products.py``). On a GPU
    the transposes are only flags to cuBLAS.
    """
    return torch.bmm(factors.mT, matrices.mT).mT


def project_back(matrices: Tensor, factors: Tensor) -> Tensor:
    """``M^T P`` for a stack: ``[B, n, m]`` and ``[B, n, r]`` give ``[B, m, r]``, as ``(P^T M)^T`` (a view, not
    contiguous): up to 50x faster than ``bmm(M.mT, P)`` on CPU, where ``M.mT`` is read against its layout."""
    return torch.bmm(factors.mT, matrices).mT


def outer(p: Tensor, q: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``P Q^T`` for a stack (``[B, n, r]``, ``[B, m, r]``), into ``out`` when given. At rank 1 the product is an
    outer product: one broadcast multiply, the same values as ``bmm`` (one product per element, no sum), which torch's
    CPU ``bmm`` computes 10x slower."""
    if p.shape[-1] == 1:
        return torch.mul(p, q.mT) if out is None else torch.mul(p, q.mT, out=out)
    return torch.bmm(p, q.mT) if out is None else torch.bmm(p, q.mT, out=out)


def _by_kind(kinds: Sequence[Hashable], indices: Sequence[int]) -> list[list[int]]:
    """``indices`` grouped by ``kinds[i]`` (shape, dtype, device: what one stack can hold), groups in the order of
    their first member, members in the given order."""
    groups: dict[Hashable, list[int]] = {}
    for i in indices:
        groups.setdefault(kinds[i], []).append(i)
    return list(groups.values())


@dataclass
class _Classes:
    """A bucket's tensors sorted into shape classes: the unit every op of the exchange runs on.

    Attributes:
        plans: ``(n, m, r)`` of every low-rank tensor, by index.
        dense: the indices of the tensors sent dense, by class.
        lowrank: the indices of the low-rank tensors, by class.
    """

    plans: dict[int, tuple[int, int, int]]
    dense: list[list[int]]
    lowrank: list[list[int]]


@dataclass
class _FlatPlan:
    """A group's shape classes and where their elements lie in its flat tensor (built once per layout).

    Attributes:
        classes: the group's layers by class.
        layer_units: per layer, the elements it puts on the wire (times the element size: its bytes).
    """

    classes: _Classes
    layer_units: tuple[int, ...]
    _dense: Tensor
    _lowrank: Tensor
    _index: dict[torch.device, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def index(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """int64 flat positions of the dense layers' elements and of the low-rank ones, each class after class
        (the order their parts take in the rounds); cached per device."""
        cached = self._index.get(device)
        if cached is None:
            cached = self._index[device] = (self._dense.to(device), self._lowrank.to(device))
        return cached


class PowerSGD(MultiRoundCompressor):
    """Rank-r PowerSGD with warm start and error feedback.

    Args:
        rank: r, the approximation rank (torch's ``matrix_approximation_rank``, default 1).
        warm_start: reuse the previous step's Q (the paper's default); otherwise draw a fresh random Q each step.
        min_compression_rate: compress a matrix only if ``(n + m) * r * rate < n * m`` (torch: 2).
        orthogonalization_epsilon: added to column norms in Gram-Schmidt (torch: 0).
        seed: seed of the random Q, identical on every rank (torch draws ``RandomState(seed).randint(1e9)``
            per initialisation and seeds the CPU generator with it; so do we).
    """

    uses_memory = True

    def __init__(
        self,
        rank: int = 1,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_int("rank", rank, minimum=1, fix="use 1, 2 or 4 (the paper)")
        check_number("min_compression_rate", min_compression_rate, minimum=0.0, fix="use 2 (torch's default)")
        check_number("orthogonalization_epsilon", orthogonalization_epsilon, minimum=0.0, fix="use 0 or 1e-8")
        check_int("seed", seed, minimum=0)
        self.approximation_rank = rank
        self.warm_start = bool(warm_start)
        self.min_compression_rate = float(min_compression_rate)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.seed = seed
        self._seeds = np.random.RandomState(seed)
        #: the averaged Q of the last step, by parameter name (warm start)
        self.q_memory: dict[str, Tensor] = {}
        self._flat_plans: dict[Segments, _FlatPlan] = {}

    def plan(self, shape: torch.Size) -> Optional[tuple[int, int, int]]:
        """``(n, m, r)`` of the low-rank form of a tensor of ``shape``, or ``None`` when it is sent dense."""
        if len(shape) <= 1 or shape.numel() == 0:
            return None
        n = shape[0]
        m = shape.numel() // n
        r = min(n, m, self.approximation_rank)
        if (n + m) * r * self.min_compression_rate >= n * m:
            return None
        return n, m, r

    def _classes(self, shapes: Sequence[torch.Size], kinds: Sequence[Hashable]) -> _Classes:
        """The tensors of ``shapes`` in classes of one ``kinds`` entry each, dense and low-rank apart."""
        plans = {i: p for i, p in enumerate(self.plan(s) for s in shapes) if p is not None}
        dense = _by_kind(kinds, [i for i in range(len(shapes)) if i not in plans])
        return _Classes(plans, dense, _by_kind(kinds, list(plans)))

    def _flat_plan(self, segments: Segments) -> _FlatPlan:
        """The shape classes of a group and their elements' positions in its flat tensor (built once per layout:
        a :class:`~lightning_gradcomp.flat.Segments` is made once per group and reused every step)."""
        plan = self._flat_plans.get(segments)
        if plan is None:
            classes = self._classes(segments.shapes, segments.shapes)

            def positions(groups: list[list[int]]) -> Tensor:
                ranges = [torch.arange(segments.offsets[i], segments.offsets[i + 1]) for g in groups for i in g]
                return torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.int64)

            units = tuple(numel if i not in classes.plans else (classes.plans[i][0] + classes.plans[i][1]) * classes.plans[i][2]
                          for i, numel in enumerate(segments.numels))
            plan = _FlatPlan(classes, units, positions(classes.dense), positions(classes.lowrank))
            self._flat_plans[segments] = plan
        return plan

    def _initial_qs(self, names: Sequence[str], classes: _Classes, like: Sequence[Tensor]) -> list[Tensor]:
        """The orthogonalized starting Q of every low-rank class, ``[B, m, r]`` (dtype and device of ``like``, the
        class's matrices): the last step's where there is one."""
        fresh: dict[int, Tensor] = {}
        needs = []
        for group, matrix in zip(classes.lowrank, like):
            for i in group:
                _, m, r = classes.plans[i]
                if not self.warm_start or names[i] not in self.q_memory or self.q_memory[names[i]].shape != (m, r):
                    needs.append((i, m, r, matrix))
        if needs:  # one seed per exchange, as torch draws one per bucket
            generator = torch.Generator().manual_seed(int(self._seeds.randint(1_000_000_000)))
            for i, m, r, matrix in sorted(needs, key=lambda need: need[0]):  # layer order: the order torch draws in
                fresh[i] = torch.randn(m, r, generator=generator, dtype=matrix.dtype).to(matrix.device)
        # ``to``: a state loaded from a checkpoint holds CPU tensors (no op when already there)
        stacks = [torch.stack([fresh[i] if i in fresh else self.q_memory[names[i]].to(matrix.device) for i in group])
                  for group, matrix in zip(classes.lowrank, like)]
        return [orthogonalize_(q, self.orthogonalization_epsilon) for q in stacks]

    def _rounds(
        self,
        dense: Sequence[Tensor],
        matrices: Sequence[Tensor],
        classes: _Classes,
        names: Sequence[str],
        all_reduce: AllReduce,
        world_size: int,
        approx_out: Optional[Tensor] = None,
    ) -> tuple[Optional[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
        """Both rounds on a bucket's shape classes: the dense values and every P in one all-reduce, every Q in
        another, each laid out class after class.

        Args:
            dense: the dense tensors' values, 1-D parts in class order (the head of the first round).
            matrices: each low-rank class's ``[B, n, m]`` stack.
            classes: the bucket's classes.
            names: the tensors' names, by index (warm-start factors).
            all_reduce: blocking in-place sum over the ranks.
            world_size: the ranks ``all_reduce`` sums over.
            approx_out: where to write the approximations, class after class, flat (``None``: new tensors).

        Returns:
            The dense tensors' mean (1-D, laid out as ``dense``; ``None`` without dense tensors), and per low-rank
            class the approximation ``[B, n, m]`` (its mean and what this rank sent), P ``[B, n, r]`` and Q
            ``[B, m, r]``.
        """
        qs = self._initial_qs(names, classes, matrices)
        ps = [project(matrix, q) for matrix, q in zip(matrices, qs)]

        # round 1: dense values and the P factors
        parts = [*dense, *(p.reshape(-1) for p in ps)]
        dense_mean: Optional[Tensor] = None
        if parts:
            flat = all_reduce(torch.cat(parts))
            offset = sum(d.numel() for d in dense)
            if dense:
                dense_mean = flat[:offset] / world_size
            for k, p in enumerate(ps):
                # orthogonalized in place: this part of the round's buffer is read by nothing else
                ps[k] = orthogonalize_(flat[offset : offset + p.numel()].view_as(p), self.orthogonalization_epsilon)
                offset += p.numel()

        approx: list[Tensor] = []
        averaged: list[Tensor] = []
        if classes.lowrank:
            # round 2: the Q factors
            local_qs = [project_back(matrix, p) for matrix, p in zip(matrices, ps)]
            flat_q = all_reduce(torch.cat([q.reshape(-1) for q in local_qs])) / world_size
            offset = at = 0
            for group, matrix, p, local_q in zip(classes.lowrank, matrices, ps, local_qs):
                q = flat_q[offset : offset + local_q.numel()].view_as(local_q)
                offset += q.numel()
                if approx_out is None:
                    approx.append(outer(p, q))
                else:
                    approx.append(outer(p, q, out=approx_out[at : at + matrix.numel()].view_as(matrix)))
                    at += matrix.numel()
                averaged.append(q)
                if self.warm_start:
                    for i, q_i in zip(group, q.unbind(0)):
                        self.q_memory[names[i]] = q_i
        return dense_mean, approx, ps, averaged

    def _exchange(
        self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce, world_size: int
    ) -> tuple[list[Exchanged], dict[str, tuple[Tensor, Tensor]]]:
        with torch.no_grad():  # gradients in, no graph: and no per-tensor ``detach`` op
            classes = self._classes([t.shape for t in tensors], [(t.shape, t.dtype, t.device) for t in tensors])
            stacks = [torch.stack([tensors[i] for i in group]) for group in classes.dense]
            matrices = [torch.stack([tensors[i] for i in group]).view(len(group), *classes.plans[group[0]][:2])
                        for group in classes.lowrank]
            dense_mean, approx, ps, qs = self._rounds(
                [s.view(-1) for s in stacks], matrices, classes, names, all_reduce, world_size
            )
        results: list[Optional[Exchanged]] = [None] * len(tensors)
        offset = 0
        for group, stack in zip(classes.dense, stacks):
            assert dense_mean is not None
            means = dense_mean[offset : offset + stack.numel()].view_as(stack).unbind(0)
            nbytes = tensors[group[0]].numel() * stack.element_size()
            for i, mean in zip(group, means):
                results[i] = Exchanged(mean=mean, sent=tensors[i], nbytes=nbytes)
            offset += stack.numel()
        factors: dict[str, tuple[Tensor, Tensor]] = {}
        for group, a, p, q in zip(classes.lowrank, approx, ps, qs):
            first = tensors[group[0]]
            n, m, r = classes.plans[group[0]]
            nbytes = (n + m) * r * first.element_size()
            for i, a_i, p_i, q_i in zip(group, a.view(len(group), *first.shape).unbind(0), p.unbind(0), q.unbind(0)):
                results[i] = Exchanged(mean=a_i, sent=a_i, nbytes=nbytes)
                factors[names[i]] = (p_i, q_i)
        return [r for r in results if r is not None], factors

    def exchange(self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce) -> list[Exchanged]:
        return self._exchange(tensors, names, all_reduce, self.world_size)[0]

    def exchange_flat(self, flat: Tensor, segments: Segments, all_reduce: AllReduce) -> FlatExchanged:
        """:meth:`exchange` on a group in one flat tensor: each class's elements gathered with one ``index_select``
        (all dense classes in one), results scattered back with one ``scatter`` for the low-rank classes and one
        for the dense ones; the same rounds, values and bytes as :meth:`exchange` on the group's layers."""
        plan = self._flat_plan(segments)
        classes = plan.classes
        dense_index, lowrank_index = plan.index(flat.device)
        with torch.no_grad():
            dense = [flat.index_select(0, dense_index)] if classes.dense else []
            matrices: list[Tensor] = []
            approx_out: Optional[Tensor] = None
            if classes.lowrank:
                gathered = flat.index_select(0, lowrank_index)
                at = 0
                for group in classes.lowrank:
                    n, m, _ = classes.plans[group[0]]
                    matrices.append(gathered[at : at + len(group) * n * m].view(len(group), n, m))
                    at += len(group) * n * m
                approx_out = torch.empty_like(gathered)
            dense_mean, _, _, _ = self._rounds(dense, matrices, classes, segments.names, all_reduce, self.world_size,
                                               approx_out)
            # a dense layer counts as sent whole (no residual); a low-rank one as its approximation
            sent = flat if approx_out is None else flat.scatter(0, lowrank_index, approx_out)
            mean = sent if dense_mean is None else sent.scatter(0, dense_index, dense_mean)
        return FlatExchanged(mean, sent, tuple(u * flat.element_size() for u in plan.layer_units))

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        """The single-process form, for tools and tests (the hook runs :meth:`exchange_flat`): the factors P and Q
        of this rank alone (a world of one), layer after layer; a layer kept dense travels as it is."""
        _, factors = self._exchange(segments.views(flat), segments.names, lambda t: t, 1)
        parts: list[Tensor] = []
        layers: list[Optional[tuple[torch.Size, torch.Size]]] = []
        nbytes: list[int] = []
        for name, x in segments.items(flat):
            pieces = [x.detach().reshape(-1)] if name not in factors else [f.reshape(-1) for f in factors[name]]
            layers.append(None if name not in factors else (factors[name][0].shape, factors[name][1].shape))
            nbytes.append(sum(piece.numel() * piece.element_size() for piece in pieces))
            parts += pieces
        payload = torch.cat(parts) if len(parts) > 1 else parts[0].clone() if parts else flat.new_empty(0)
        return FlatPacket(payload, segments, flat.dtype, tuple(nbytes), ctx={"factors": tuple(layers)})

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        """A single-process packet decoded: each low-rank layer ``P Q^T``, each dense layer as it travelled."""
        out: list[Tensor] = []
        at = 0
        for shape, layer in zip(packet.segments.shapes, packet.ctx["factors"]):
            if layer is None:
                out.append(packet.payload[at : at + shape.numel()].to(packet.dtype))
                at += shape.numel()
                continue
            p_shape, q_shape = layer
            p = packet.payload[at : at + p_shape.numel()].view(p_shape)
            at += p_shape.numel()
            q = packet.payload[at : at + q_shape.numel()].view(q_shape)
            at += q_shape.numel()
            out.append((p @ q.t()).to(packet.dtype).reshape(-1))
        return torch.cat(out) if len(out) > 1 else out[0] if out else packet.payload.new_empty(0, dtype=packet.dtype)

    def state_dict(self) -> dict[str, Any]:
        # numpy's MT19937 state as tensors and ints: Lightning loads checkpoints with torch.load(weights_only=True)
        state = self._seeds.get_state(legacy=True)
        assert isinstance(state, tuple)  # legacy=True: the tuple form, whatever numpy's annotation allows
        kind, keys, pos, has_gauss, cached = state
        seeds = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                 "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        return {"q_memory": {n: q.detach().cpu().clone() for n, q in self.q_memory.items()}, "seeds": seeds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q_memory = dict(state.get("q_memory", {}))
        if "seeds" in state:
            seeds = state["seeds"]
            keys = seeds["keys"].numpy().astype("uint32")
            self._seeds.set_state((seeds["kind"], keys, seeds["pos"], seeds["has_gauss"], seeds["cached_gaussian"]))

    def describe(self) -> dict[str, Any]:
        return {"compressor": "PowerSGD", "rank": self.approximation_rank, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate, "seed": self.seed}
