"""1-bit Adam and 0/1 Adam on 2 and 3 real Gloo ranks against an independent written-out reference (plain torch in
this process simulating the ranks): the compressed all-reduce's worker and server error compensation, replicas
bit-identical, exact bytes, the optimizers' phases and updates."""

import math
from collections.abc import Sequence
from typing import Optional, cast

import pytest
import torch
from torch import nn

from tests.distributed.onebit_adam_ranks import Small, batch, emulated_rounds, exchange_rounds, train_raw
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed
NUMEL = 67  # Small's parameters: chunks of 34/33 on 2 ranks, 23/22/22 on 3 (the 35-element weight is cut in both)
TENSORS = [1, 35, 7, 21, 3]  # in parameters() order: the module's own `scale` before the layers' parameters


# -- the reference -------------------------------------------------------------------------------------------
def ref_sizes(numel: int, world: int) -> list[int]:
    return [numel // world + (r < numel % world) for r in range(world)]


def ref_one_bit(x: torch.Tensor) -> torch.Tensor:
    """One chunk at one bit per element: a sign, decoded as the mean of the non-negative elements or minus the mean
    magnitude of the negative ones (summed in float64)."""
    positive = x >= 0
    wide = x.double()
    mean_pos = (wide[positive].sum() / max(int(positive.sum()), 1)).float()
    mean_neg = ((-wide[~positive]).sum() / max(int((~positive).sum()), 1)).float()
    return torch.where(positive, mean_pos, -mean_neg)


def ref_pieces(tensors: list[int], world: int, block: Optional[int] = None) -> list[list[int]]:
    """Per chunk, the lengths of the tensors' parts in it (tensors back to back, cut at the chunk boundaries), each
    part cut in blocks of ``block`` elements if given."""
    if block is not None:
        return [[min(block, n - i) for n in chunk for i in range(0, n, block)] for chunk in ref_pieces(tensors, world)]
    bounds = [0]
    for n in ref_sizes(sum(tensors), world):
        bounds.append(bounds[-1] + n)
    starts = [0]
    for n in tensors:
        starts.append(starts[-1] + n)
    return [[min(e, bounds[r + 1]) - max(s, bounds[r]) for s, e in zip(starts, starts[1:])
             if min(e, bounds[r + 1]) > max(s, bounds[r])] for r in range(world)]


def ref_compress(x: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    return torch.cat([ref_one_bit(p) for p in x.split(pieces)])


class RefAllReduce:
    """Tang et al.'s compressed all-reduce, every rank simulated: worker errors, chunk r to rank r, server errors;
    every part of a tensor in a chunk compressed with its own scale (DeepSpeed: per tensor)."""

    def __init__(self, tensors: list[int], world: int, block: Optional[int] = None) -> None:
        self.sizes = ref_sizes(sum(tensors), world)
        self.pieces = ref_pieces(tensors, world, block)
        self.world = world
        self.reset()

    def reset(self) -> None:
        self.worker = [torch.zeros(sum(self.sizes)) for _ in range(self.world)]
        self.server = [torch.zeros(n) for n in self.sizes]

    def __call__(self, vectors: list[torch.Tensor]) -> torch.Tensor:
        sent = []
        for i, v in enumerate(vectors):
            x = v + self.worker[i]
            decoded = torch.cat([ref_compress(c, p) for c, p in zip(x.split(self.sizes), self.pieces)])
            self.worker[i] = x - decoded
            sent.append(decoded.split(self.sizes))
        out = []
        for r in range(self.world):
            total = sent[0][r].clone()
            for i in range(1, self.world):
                total += sent[i][r]
            y = total / self.world + self.server[r]
            q = ref_compress(y, self.pieces[r])
            self.server[r] = y - q
            out.append(q)
        return torch.cat(out)


def ref_grads(models: Sequence[nn.Module], step: int) -> list[torch.Tensor]:
    out = []
    for rank, model in enumerate(models):
        model.zero_grad()
        x, y = batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        out.append(torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in model.parameters()]))  # all set by backward
    return out


def ref_mean(vectors: list[torch.Tensor]) -> torch.Tensor:
    total = vectors[0].clone()
    for v in vectors[1:]:
        total += v
    return total / len(vectors)


def load(models: Sequence[nn.Module], flats: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for model, flat in zip(models, flats):
            torch.nn.utils.vector_to_parameters(flat, model.parameters())


LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8


def ref_onebit_adam(world: int, steps: int, freeze_step: int) -> list[torch.Tensor]:
    """Algorithm 1: dense Adam for ``freeze_step`` steps, then v frozen and m_i = b1 m + (1 - b1) g_i averaged by
    the compressed all-reduce; p -= lr m / (sqrt(v) + eps). Returns the parameters after every step."""
    models = [Small() for _ in range(world)]
    p = torch.nn.utils.parameters_to_vector(models[0].parameters()).detach()
    m, v = torch.zeros(NUMEL), torch.zeros(NUMEL)
    allreduce, frozen, out = RefAllReduce(TENSORS, world), False, []
    for t in range(1, steps + 1):
        load(models, [p] * world)
        grads = ref_grads(models, t - 1)
        if not frozen:
            g = ref_mean(grads)
            m = m * B1 + (1 - B1) * g
            v = v * B2 + (1 - B2) * g * g
        else:
            m = allreduce([m * B1 + (1 - B1) * g for g in grads])
        p = p - LR * (m / (v.sqrt() + EPS))
        out.append(p.clone())
        frozen = frozen or t >= freeze_step
    return out


def ref_zero_one_adam(world: int, steps: int, var_freeze: int, var_scaler: int, local_scaler: int,
                      clipper: int) -> tuple[list[list[torch.Tensor]], list[bool]]:
    """0/1 Adam (Lu et al.): per step, every rank's parameters, and whether the ranks were synchronised."""
    models = [Small() for _ in range(world)]
    p = [torch.nn.utils.parameters_to_vector(models[0].parameters()).detach()] * world
    m, v = [torch.zeros(NUMEL)] * world, torch.zeros(NUMEL)
    allreduce = RefAllReduce(TENSORS, world)
    var_interval, var_counter, local_interval, local_counter, frozen, lrs = 1, 0, 1, 0, False, 0.0
    anchor = p[0]
    out, synced = [], []
    for t in range(1, steps + 1):
        load(models, p)
        grads = ref_grads(models, t - 1)
        if not frozen:
            dense = t % var_interval == 0
            if dense:
                g = ref_mean(grads)
                v = v * B2 + (1 - B2) * g * g
            else:
                g = allreduce(grads)
            m = [m[0] * B1 + (1 - B1) * g] * world
            p = [p[0] - LR * (m[0] / (v.sqrt() + EPS))] * world
            if dense:
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, 2 * var_interval
            if t > var_freeze:
                frozen = True
                allreduce.reset()
                anchor = p[0]
            synced.append(True)
        else:
            lrs += LR
            m = [mi * B1 + (1 - B1) * g for mi, g in zip(m, grads)]
            p = [pi - LR * (mi / (v.sqrt() + EPS)) for pi, mi in zip(p, m)]
            sync = t % local_interval == 0
            if sync:
                mean = allreduce([(pi - anchor) * (v.sqrt() + EPS) for pi in p])
                anchor = anchor + mean / (v.sqrt() + EPS)
                p = [anchor] * world
                m = [-mean / lrs] * world
                lrs = 0.0
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, 2 * local_interval)
            synced.append(sync)
        out.append([pi.clone() for pi in p])
    return out, synced


def expected_bytes(tensors: list[int], world: int, rank: int, block: Optional[int] = None) -> int:
    """Worker packet (every piece: its sign bits and two float32) plus this rank's server packet (its chunk's)."""
    packet = [sum(math.ceil(n / 8) + 8 for n in chunk) for chunk in ref_pieces(tensors, world, block)]
    return sum(packet) + packet[rank]


# -- the compressed all-reduce ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("world", "block"), [(2, None), (3, None), (3, 64)], ids=["2-ranks", "3-ranks", "3-ranks-block64"])
def test_compressed_allreduce_matches_reference_and_keeps_both_errors(world: int, block: Optional[int]) -> None:
    tensors, rounds = [500, 1, 3, 297, 200], 4  # 1001 elements, scales 0.01 to 10, some cut between chunks
    ranks = run_ranks(exchange_rounds, world, [(f"t{i}", n) for i, n in enumerate(tensors)], rounds, block,
                      timeout=120)
    ref = RefAllReduce(tensors, world, block)
    for k in range(rounds):
        expected = ref([r["inputs"][k] for r in ranks])
        for rank, r in enumerate(ranks):
            assert torch.equal(r["outputs"][k], ranks[0]["outputs"][k]), f"rank {rank} decoded other bits"
        torch.testing.assert_close(ranks[0]["outputs"][k], expected, rtol=1e-6, atol=1e-7)
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["worker"], ref.worker[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["server"], ref.server[rank], rtol=1e-6, atol=1e-6)
    # nothing is lost: what the exchanges did not deliver of the ranks' mean is exactly in the two error buffers
    # (the mean of the workers' errors, and each server's error in its chunk)
    delivered = torch.stack(ranks[0]["outputs"]).double().sum(0)
    wanted = torch.stack([torch.stack(r["inputs"]) for r in ranks]).double().sum(1).mean(0)
    worker = torch.stack([r["worker"] for r in ranks]).double().mean(0)
    server = torch.cat([r["server"] for r in ranks]).double()
    torch.testing.assert_close(delivered + worker + server, wanted, rtol=0, atol=1e-5)
    assert worker.abs().max() > 0 and server.abs().max() > 0  # both stages compress (the check above has teeth)
    for rank, r in enumerate(ranks):
        assert r["nbytes"] == [expected_bytes(tensors, world, rank, block)] * rounds == [r["expected"]] * rounds
        assert r["sizes"] == ref_sizes(sum(tensors), world)
    # the same exchange between emulated workers (threads on a WorkerTransport) computes the Gloo ranks' bits
    emulated = emulated_rounds([(f"t{i}", n) for i, n in enumerate(tensors)], [r["inputs"] for r in ranks], block)
    for rank, r in enumerate(ranks):
        assert all(torch.equal(a, b) for a, b in zip(emulated[rank]["outputs"], r["outputs"])), f"worker {rank}"
        assert torch.equal(emulated[rank]["worker"], r["worker"]) and torch.equal(emulated[rank]["server"], r["server"])
        assert emulated[rank]["nbytes"] == r["nbytes"]


# -- the optimizers through DDP and the strategy's hook ----------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_onebit_adam_matches_algorithm_1(world: int) -> None:
    steps, freeze = 7, 3
    ranks = run_ranks(train_raw, world, "onebit", steps, {"lr": LR, "freeze_step": freeze, "deepspeed_compat": True},
                      timeout=120)
    reference = ref_onebit_adam(world, steps, freeze)
    for t in range(steps):
        for rank, r in enumerate(ranks):
            assert torch.equal(r["params"][t], ranks[0]["params"][t]), f"step {t + 1}: rank {rank} diverged"
        torch.testing.assert_close(ranks[0]["params"][t], reference[t], rtol=1e-5, atol=1e-6)
    for rank, r in enumerate(ranks):
        assert r["dense"] == [True] * freeze + [False] * (steps - freeze)
        assert r["phases"] == ["warmup"] * (freeze - 1) + ["compressed"] * (steps - freeze + 1)
        assert r["nbytes"] == [0] * freeze + [expected_bytes(TENSORS, world, rank)] * (steps - freeze)


@pytest.mark.parametrize("world", [2, 3])
def test_zero_one_adam_matches_reference(world: int) -> None:
    steps = 14
    # the reference is DeepSpeed's arithmetic (no bias correction, no variance floor)
    options = {"lr": LR, "var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4,
               "deepspeed_compat": True}
    ranks = run_ranks(train_raw, world, "zero_one", steps, options, timeout=120)
    reference, synced = ref_zero_one_adam(world, steps, 6, 2, 2, 4)
    # variance updates at steps 1, 2 (interval 1), 4, 6 (interval 2); 1-bit gradient averaging at 3, 5, 7 (the
    # interval is 4 from step 6 on); frozen after step 7; then local steps, synchronised at 8, 9 (interval 1), 10,
    # 12 (interval 2 from step 9 on; 4 from step 11 on: not at 13, 14)
    assert ranks[0]["dense"] == [True, True, False, True, False, True, False] + [False] * 7
    assert synced == [True] * 7 + [True, True, True, False, True, False, False]
    for t in range(steps):
        for rank, r in enumerate(ranks):
            torch.testing.assert_close(r["params"][t], reference[t][rank], rtol=1e-5, atol=1e-6)
            if synced[t]:
                assert torch.equal(r["params"][t], ranks[0]["params"][t]), f"step {t + 1}: rank {rank} differs"
        if not synced[t]:
            assert not torch.equal(ranks[0]["params"][t], ranks[1]["params"][t])  # local steps really are local
    exchanged = [t for t in range(steps) if ranks[0]["nbytes"][t]]
    assert exchanged == [2, 4, 6, 7, 8, 9, 11]
    for rank, r in enumerate(ranks):
        assert all(r["nbytes"][t] == expected_bytes(TENSORS, world, rank) for t in exchanged)
