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
    """Orthonormalize the columns of ``matrix`` in place (as torch's PowerSGD does), and return it.

    Gram-Schmidt for rank <= 2 (faster there, and the only choice for half precision), QR otherwise.
    """
    rank = matrix.shape[1]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrix[:, i : i + 1]
            # torch divides by the bare norm (NaN for an all-zero column, e.g. a layer with no gradient this step);
            # clamping at the smallest normal float changes nothing else and sends zeros instead
            col /= torch.norm(col, dim=0, keepdim=True).clamp_min(torch.finfo(col.dtype).tiny) + epsilon
            if i + 1 < rank:
                rest = matrix[:, i + 1 :]
                rest -= torch.sum(col * rest, dim=0, keepdim=True) * col
    else:
        matrix.copy_(torch.linalg.qr(matrix).Q)
    return matrix


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

    def _initial_qs(self, matrices: Sequence[Tensor], names: Sequence[str], plans: Sequence[tuple[int, int, int]]) -> list[Tensor]:
        needs = [
            not self.warm_start or name not in self.q_memory or self.q_memory[name].shape != (m, r)
            for name, (_, m, r) in zip(names, plans)
        ]
        generator = None
        if any(needs):  # one seed per exchange, as torch draws one per bucket
            generator = torch.Generator().manual_seed(int(self._seeds.randint(1_000_000_000)))
        qs = []
        for need, name, matrix, (_, m, r) in zip(needs, names, matrices, plans):
            if need:
                q = torch.randn(m, r, generator=generator, dtype=matrix.dtype).to(matrix.device)
            else:
                q = self.q_memory[name]
            qs.append(orthogonalize_(q, self.orthogonalization_epsilon))
        return qs

    def _exchange(
        self, tensors: Sequence[Tensor], names: Sequence[str], all_reduce: AllReduce, world_size: int
    ) -> tuple[list[Exchanged], dict[str, tuple[Tensor, Tensor]]]:
        plans = [self.plan(t.shape) for t in tensors]
        dense = [i for i, p in enumerate(plans) if p is None]
        lowrank = [i for i, p in enumerate(plans) if p is not None]
        matrices = [tensors[i].detach().reshape(tensors[i].shape[0], -1) for i in lowrank]
        lr_names = [names[i] for i in lowrank]
        lr_plans = [plans[i] for i in lowrank]
        qs = self._initial_qs(matrices, lr_names, lr_plans)  # type: ignore[arg-type]
        ps = [matrix @ q for matrix, q in zip(matrices, qs)]

        # round 1: dense tensors and the P factors, one all-reduce
        parts = [tensors[i].detach().reshape(-1) for i in dense] + [p.reshape(-1) for p in ps]
        results: list[Optional[Exchanged]] = [None] * len(tensors)
        if parts:
            flat = all_reduce(torch.cat(parts))
            offset = 0
            for i in dense:
                n = tensors[i].numel()
                mean = flat[offset : offset + n].view_as(tensors[i]) / world_size
                results[i] = Exchanged(mean=mean, sent=tensors[i], nbytes=n * tensors[i].element_size())
                offset += n
            for k, p in enumerate(ps):
                ps[k] = orthogonalize_(flat[offset : offset + p.numel()].view_as(p).clone(), self.orthogonalization_epsilon)
                offset += p.numel()

        factors: dict[str, tuple[Tensor, Tensor]] = {}
        if lowrank:
            # round 2: the Q factors
            qs = [matrix.t() @ p for matrix, p in zip(matrices, ps)]
            flat_q = all_reduce(torch.cat([q.reshape(-1) for q in qs])) / world_size
            offset = 0
            for k, i in enumerate(lowrank):
                q = flat_q[offset : offset + qs[k].numel()].view_as(qs[k])
                offset += q.numel()
                approx = (ps[k] @ q.t()).view_as(tensors[i])
                nbytes = (ps[k].numel() + q.numel()) * approx.element_size()
                results[i] = Exchanged(mean=approx, sent=approx, nbytes=nbytes)
                factors[names[i]] = (ps[k], q)
                if self.warm_start:
                    self.q_memory[names[i]] = q
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
