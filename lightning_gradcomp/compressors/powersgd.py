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
``torch.bmm`` each and the orthogonalization runs on the whole stack (:func:`orthogonalize_` takes a batch); dense
tensors of one shape travel stacked too. The ops per exchange grow with the number of distinct shapes, not of
tensors; the rounds stay two all-reduces for the whole bucket, each laid out shape group after shape group
(``tests/unit/test_flat_demo_powersgd.py``). A fresh random Q (the first step, a new shape, ``warm_start=False``)
is still drawn tensor by tensor in layer order, as torch's hook draws it, so the random start stays torch's.
"""

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Packet
from lightning_gradcomp.compressors.multiround import AllReduce, Exchanged, MultiRoundCompressor
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


def _by_shape(tensors: Sequence[Tensor], indices: Sequence[int]) -> list[list[int]]:
    """``indices`` grouped by their tensors' shape, dtype and device (the tensors a stack can hold), groups in the
    order of their first member, members in the given order."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
    for i in indices:
        groups.setdefault((tensors[i].shape, tensors[i].dtype, tensors[i].device), []).append(i)
    return list(groups.values())


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

    def _initial_qs(self, tensors: Sequence[Tensor], names: Sequence[str], groups: Sequence[list[int]],
                    plans: dict[int, tuple[int, int, int]]) -> list[Tensor]:
        """The orthogonalized starting Q of every low-rank group, ``[B, m, r]``: the last step's where there is one."""
        fresh: dict[int, Tensor] = {}
        needs = []
        for i in sorted(plans):  # layer order: the order torch draws in
            _, m, r = plans[i]
            if not self.warm_start or names[i] not in self.q_memory or self.q_memory[names[i]].shape != (m, r):
                needs.append((i, m, r))
        if needs:  # one seed per exchange, as torch draws one per bucket
            generator = torch.Generator().manual_seed(int(self._seeds.randint(1_000_000_000)))
            for i, m, r in needs:
                fresh[i] = torch.randn(m, r, generator=generator, dtype=tensors[i].dtype).to(tensors[i].device)
        # ``to``: a state loaded from a checkpoint holds CPU tensors (no op when already there)
        stacks = [torch.stack([fresh[i] if i in fresh else self.q_memory[names[i]].to(tensors[i].device) for i in group])
                  for group in groups]
        return [orthogonalize_(q, self.orthogonalization_epsilon) for q in stacks]

    def _exchange(
        self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce, world_size: int
    ) -> tuple[list[Exchanged], dict[str, tuple[Tensor, Tensor]]]:
        with torch.no_grad():  # gradients in, no graph: and no per-tensor ``detach`` op
            return self._exchange_groups(tensors, names, all_reduce, world_size)

    def _exchange_groups(
        self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce, world_size: int
    ) -> tuple[list[Exchanged], dict[str, tuple[Tensor, Tensor]]]:
        plans = {i: p for i, p in enumerate(self.plan(t.shape) for t in tensors) if p is not None}
        dense = _by_shape(tensors, [i for i in range(len(tensors)) if i not in plans])
        lowrank = _by_shape(tensors, list(plans))
        shapes = [plans[group[0]] for group in lowrank]
        matrices = [torch.stack([tensors[i] for i in group]).view(len(group), n, m)
                    for group, (n, m, _) in zip(lowrank, shapes)]
        qs = self._initial_qs(tensors, names, lowrank, plans)
        ps = [torch.bmm(matrix, q) for matrix, q in zip(matrices, qs)]

        # round 1: dense tensors and the P factors, one all-reduce, shape group after shape group
        stacked_dense = [torch.stack([tensors[i] for i in group]) for group in dense]
        parts = [d.view(-1) for d in stacked_dense] + [p.view(-1) for p in ps]
        results: list[Optional[Exchanged]] = [None] * len(tensors)
        if parts:
            flat = all_reduce(torch.cat(parts))
            offset = 0
            for group, stack in zip(dense, stacked_dense):
                means = (flat[offset : offset + stack.numel()].view_as(stack) / world_size).unbind(0)
                nbytes = tensors[group[0]].numel() * stack.element_size()
                for i, mean in zip(group, means):
                    results[i] = Exchanged(mean=mean, sent=tensors[i], nbytes=nbytes)
                offset += stack.numel()
            for k, p in enumerate(ps):
                # orthogonalized in place: this part of the round's buffer is read by nothing else
                ps[k] = orthogonalize_(flat[offset : offset + p.numel()].view_as(p), self.orthogonalization_epsilon)
                offset += p.numel()

        factors: dict[str, tuple[Tensor, Tensor]] = {}
        if lowrank:
            # round 2: the Q factors
            local_qs = [torch.bmm(matrix.mT, p) for matrix, p in zip(matrices, ps)]
            flat_q = all_reduce(torch.cat([q.view(-1) for q in local_qs])) / world_size
            offset = 0
            for group, (n, m, r), p, local_q in zip(lowrank, shapes, ps, local_qs):
                q = flat_q[offset : offset + local_q.numel()].view_as(local_q)
                offset += q.numel()
                first = tensors[group[0]]
                approx = torch.bmm(p, q.mT).view(len(group), *first.shape).unbind(0)
                nbytes = (n + m) * r * first.element_size()
                for i, a, p_i, q_i in zip(group, approx, p.unbind(0), q.unbind(0)):
                    results[i] = Exchanged(mean=a, sent=a, nbytes=nbytes)
                    factors[names[i]] = (p_i, q_i)
                    if self.warm_start:
                        self.q_memory[names[i]] = q_i
        return [r for r in results if r is not None], factors

    def exchange(self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce) -> list[Exchanged]:
        return self._exchange(tensors, names, all_reduce, self.world_size)[0]

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        """Single-process form: the factors P and Q of this rank alone (a world of one)."""
        results, factors = self._exchange([tensor], [name], lambda t: t, 1)
        if name not in factors:
            return Packet(payload=tensor.detach().reshape(-1).clone(), shape=tensor.shape, dtype=tensor.dtype)
        p, q = factors[name]
        return Packet(payload=torch.cat((p.reshape(-1), q.reshape(-1))), shape=tensor.shape, dtype=tensor.dtype,
                      ctx={"factors": (p.shape, q.shape)})

    def decompress(self, packet: Packet) -> Tensor:
        if "factors" not in packet.ctx:
            return packet.payload.view(packet.shape).to(packet.dtype)
        p_shape, q_shape = packet.ctx["factors"]
        n_p = p_shape.numel()
        p = packet.payload[:n_p].view(p_shape)
        q = packet.payload[n_p:].view(q_shape)
        return (p @ q.t()).to(packet.dtype).view(packet.shape)

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
