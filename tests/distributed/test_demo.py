"""DeMo on 2 and 3 real Gloo ranks: identical replicas, and the averaged update against an independent reference
(scipy's DCT, the method written out per rank: decayed momentum, top-k per chunk, removal, mean of the rest), with
the plain mean over ranks and, on 3 ranks, the reference code's mean over the ranks that sent each coefficient."""

import numpy as np
import pytest
import torch
from scipy.fft import dctn, idctn

from lightning_gradcomp.compressors.demo import largest_divisor
from tests.distributed.demo_ranks import demo_suite
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed
STEPS, TOPK, BETA = 4, 8, 0.9


@pytest.fixture(scope="module", params=[(2, "ranks"), (3, "ranks"), (3, "selectors")], ids=lambda p: f"{p[0]}-{p[1]}")
def run(request: pytest.FixtureRequest) -> tuple[list[dict], str]:
    world_size, average = request.param
    return run_ranks(demo_suite, world_size, STEPS, TOPK, BETA, average, timeout=240), average


@pytest.fixture
def ranks(run: tuple[list[dict], str]) -> list[dict]:
    return run[0]


def _chunks(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The reference's chunking of a tensor of ``shape``: matrix rows, columns and chunk edges ``n1``, ``n2``."""
    rows, cols = (1, int(np.prod(shape))) if len(shape) < 2 else (shape[0], int(np.prod(shape[1:])))
    return rows, cols, largest_divisor(rows, 64) if len(shape) >= 2 else 1, largest_divisor(cols, 64)


def _reference_coefficients(m: np.ndarray) -> np.ndarray:
    """The coefficients DeMo transmits of momentum ``m``: its chunks' orthonormal DCT, all but the top ``TOPK``
    magnitudes of each chunk zeroed (laid out as the matrix of ``m``)."""
    rows, cols, n1, n2 = _chunks(m.shape)
    mat, out = m.reshape(rows, cols), np.zeros((rows, cols))
    for i in range(0, rows, n1):
        for j in range(0, cols, n2):
            coeffs = dctn(mat[i : i + n1, j : j + n2], norm="ortho").reshape(-1)
            keep = np.argsort(-np.abs(coeffs), kind="stable")[: min(TOPK, coeffs.size)]
            sparse = np.zeros_like(coeffs)
            sparse[keep] = coeffs[keep]
            out[i : i + n1, j : j + n2] = sparse.reshape(n1, n2)
    return out


def _reference_decode(coeffs: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor of ``shape`` whose chunks have the DCT coefficients ``coeffs``."""
    rows, cols, n1, n2 = _chunks(shape)
    out = np.zeros((rows, cols))
    for i in range(0, rows, n1):
        for j in range(0, cols, n2):
            out[i : i + n1, j : j + n2] = idctn(coeffs[i : i + n1, j : j + n2], norm="ortho")
    return out.reshape(shape)


def test_replicas_stay_bit_identical(ranks: list[dict]) -> None:
    for other in ranks[1:]:
        for step, (a, b) in enumerate(zip(ranks[0]["params"], other["params"])):
            assert torch.equal(a, b), f"a rank diverged at step {step}"
    assert not torch.equal(ranks[0]["params"][0], ranks[0]["params"][-1])


def test_averaged_update_matches_the_reference_method(run: tuple[list[dict], str]) -> None:
    ranks, average = run
    momentum = [{n: np.zeros(g.shape, dtype=np.float64) for n, g in r["local"][0].items()} for r in ranks]
    for step in range(STEPS):
        for name in ranks[0]["local"][step]:
            sent = []
            for r, rank in enumerate(ranks):
                m = BETA * momentum[r][name] + rank["local"][step][name].double().numpy()
                coeffs = _reference_coefficients(m)
                momentum[r][name] = m - _reference_decode(coeffs, m.shape)
                sent.append(coeffs)
            # the plain mean over ranks, or the reference code's mean over the ranks that sent each coefficient
            senders = len(ranks) if average == "ranks" else np.maximum(np.count_nonzero(sent, axis=0), 1)
            mean = _reference_decode(np.sum(sent, axis=0) / senders, momentum[0][name].shape)
            expected = torch.from_numpy(np.asarray(mean)).float()

            def message(m: str, s: int = step, n: str = name) -> str:
                return f"step {s}, {n}: {m}"

            torch.testing.assert_close(ranks[0]["averaged"][step][name], expected, rtol=1e-4, atol=1e-6, msg=message)


def test_exact_wire_bytes(ranks: list[dict]) -> None:
    # a: 130x70 -> 26x35 chunks (5 x 2 = 10); a.bias 130 -> 26 (5); b: 64x130 -> 64x26 (5); b.bias 64 (1);
    # c: 128x64 -> 64x64 (2); scale: 1 element (1 chunk of 1, one value); 8 coefficients elsewhere, fp32 + int16
    expected = (10 + 5 + 5 + 1 + 2) * TOPK * 6 + 1 * 6
    assert ranks[0]["bytes"][-1] == expected
    assert ranks[0]["dense_bytes"] == 4 * (130 * 70 + 130 + 64 * 130 + 64 + 128 * 64 + 1)
