"""DeMo on 2 and 3 real Gloo ranks: identical replicas, and the averaged update against an independent reference
(scipy's DCT, the method written out per rank: decayed momentum, top-k per chunk, removal, mean of the rest)."""

import numpy as np
import pytest
import torch
from scipy.fft import dctn, idctn

from lightning_gradcomp.compressors.demo import largest_divisor
from tests.distributed.demo_ranks import demo_suite
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed
STEPS, TOPK, BETA = 4, 8, 0.9


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(demo_suite, request.param, STEPS, TOPK, BETA, timeout=240)


def _reference_sent(m: np.ndarray) -> np.ndarray:
    """The part of momentum ``m`` DeMo transmits: top-``TOPK`` orthonormal DCT coefficients of each chunk."""
    mat = m.reshape(1, -1) if m.ndim < 2 else m.reshape(m.shape[0], -1)
    n1 = largest_divisor(mat.shape[0], 64) if m.ndim >= 2 else 1
    n2 = largest_divisor(mat.shape[1], 64)
    out = np.zeros_like(mat)
    for i in range(0, mat.shape[0], n1):
        for j in range(0, mat.shape[1], n2):
            coeffs = dctn(mat[i : i + n1, j : j + n2], norm="ortho")
            flat = coeffs.reshape(-1)
            keep = np.argsort(-np.abs(flat), kind="stable")[: min(TOPK, flat.size)]
            sparse = np.zeros_like(flat)
            sparse[keep] = flat[keep]
            out[i : i + n1, j : j + n2] = idctn(sparse.reshape(coeffs.shape), norm="ortho")
    return out.reshape(m.shape)


def test_replicas_stay_bit_identical(ranks: list[dict]) -> None:
    for other in ranks[1:]:
        for step, (a, b) in enumerate(zip(ranks[0]["params"], other["params"])):
            assert torch.equal(a, b), f"a rank diverged at step {step}"
    assert not torch.equal(ranks[0]["params"][0], ranks[0]["params"][-1])


def test_averaged_update_matches_the_reference_method(ranks: list[dict]) -> None:
    momentum = [{n: np.zeros(g.shape, dtype=np.float64) for n, g in r["local"][0].items()} for r in ranks]
    for step in range(STEPS):
        for name in ranks[0]["local"][step]:
            sent = []
            for r, rank in enumerate(ranks):
                m = BETA * momentum[r][name] + rank["local"][step][name].double().numpy()
                q = _reference_sent(m)
                momentum[r][name] = m - q
                sent.append(q)
            expected = torch.from_numpy(np.asarray(np.mean(sent, axis=0))).float()
            torch.testing.assert_close(ranks[0]["averaged"][step][name], expected, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}")


def test_exact_wire_bytes(ranks: list[dict]) -> None:
    # a: 130x70 -> 26x35 chunks (5 x 2 = 10); a.bias 130 -> 26 (5); b: 64x130 -> 64x26 (5); b.bias 64 (1);
    # c: 128x64 -> 64x64 (2); scale: 1 element (1 chunk of 1, one value); 8 coefficients elsewhere, fp32 + int16
    expected = (10 + 5 + 5 + 1 + 2) * TOPK * 6 + 1 * 6
    assert ranks[0]["bytes"][-1] == expected
    assert ranks[0]["dense_bytes"] == 4 * (130 * 70 + 130 + 64 * 130 + 64 + 128 * 64 + 1)
