"""Every baseline on 2 real Gloo ranks: identical replicas, multi-bucket PowerSGD, DGC's callbacks end to end."""

import pytest
import torch

from tests.distributed.baseline_ranks import baselines_suite, callbacks_suite
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

BASELINES = ["fp32", "fp16", "bf16", "powersgd", "topk", "dgc", "onebit", "qsgd"]


@pytest.fixture(scope="module")
def baselines() -> list[dict]:
    # one spawned group for all of them; the harness kills it if PowerSGD (or anything) hangs
    return run_ranks(baselines_suite, 2, BASELINES, timeout=240)


@pytest.fixture(scope="module")
def callbacks() -> list[dict]:
    return run_ranks(callbacks_suite, 2, timeout=240)


@pytest.mark.parametrize("name", BASELINES + ["powersgd_dense_first"])
def test_baseline_replicas_stay_bit_identical(baselines: list[dict], name: str) -> None:
    ours, other = baselines[0][name], baselines[1][name]
    for step, (a, b) in enumerate(zip(ours["params"], other["params"])):
        assert torch.equal(a, b), f"{name}: rank 1 diverged at step {step}"
    assert not torch.equal(ours["params"][0], ours["params"][-1]), f"{name} did not train"
    # DDP starts with one bucket and rebuilds smaller ones after the first step
    assert ours["hook_calls"] >= 2 * len(ours["params"]) - 1, "expected two or more buckets per step"


def test_bytes_on_the_wire(baselines: list[dict]) -> None:
    r = {name: baselines[0][name] for name in BASELINES}
    dense = r["fp32"]["dense_bytes"]
    assert r["fp32"]["bytes"][-1] == dense
    assert r["fp16"]["bytes"][-1] == r["bf16"]["bytes"][-1] == dense // 2
    assert r["onebit"]["bytes"][-1] < dense / 5  # 1 bit + two fp32 per row of 20-64 elements
    assert r["qsgd"]["bytes"][-1] < dense / 7
    assert r["topk"]["bytes"][-1] < dense / 10 and r["dgc"]["bytes"][-1] < dense / 10
    assert r["powersgd"]["bytes"][-1] < dense / 5
    assert "allreduce_round" in r["powersgd"]["collectives"]
    first = baselines[0]["powersgd_dense_first"]
    assert first["bytes"][0] == dense and first["bytes"][1] == r["powersgd"]["bytes"][-1]


def test_powersgd_matches_torch_powersgd_on_one_tensor(baselines: list[dict]) -> None:
    for rank in range(2):
        for step, (theirs, ours) in enumerate(zip(baselines[rank]["parity_torch"]["params"],
                                                  baselines[rank]["parity_ours"]["params"])):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    # PowerSGD really ran from step 2 on: low-rank bytes
    assert baselines[0]["parity_ours"]["bytes"][-1] == 4 * (40 + 30) * 2


def test_momentum_correction_equals_sgd_momentum_without_compression(callbacks: list[dict]) -> None:
    torch.testing.assert_close(callbacks[0]["momentum_correction"]["params"], callbacks[0]["sgd_momentum"]["params"],
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(callbacks[0]["momentum_correction"]["params"], callbacks[1]["momentum_correction"]["params"])


def test_dgc_with_clipping_momentum_correction_and_warmup(callbacks: list[dict]) -> None:
    dgc = [c["dgc"] for c in callbacks]
    assert torch.equal(dgc[0]["params"], dgc[1]["params"])
    sent = dgc[0]["bytes"]
    assert sent[0] == sent[1] == dgc[0]["dense_bytes"], "the first two steps are dense"
    assert max(sent[2:4]) < dgc[0]["dense_bytes"], "then 25% kept"
    assert max(sent[4:]) < min(sent[2:4]), "then 5% kept"


def test_powersgd_by_name_through_lightning(callbacks: list[dict]) -> None:
    assert torch.equal(callbacks[0]["powersgd"]["params"], callbacks[1]["powersgd"]["params"])
    assert callbacks[0]["powersgd"]["bytes"][-1] < callbacks[0]["powersgd"]["dense_bytes"] / 5


def test_momentum_correction_refuses_optimizer_momentum_before_training(callbacks: list[dict]) -> None:
    message = callbacks[0]["refused"]
    assert message is not None and "momentum=0" in message and "MomentumCorrection(momentum=0.9)" in message
