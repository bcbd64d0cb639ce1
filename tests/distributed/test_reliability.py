"""Reliability on real Gloo ranks, for every registered compressor (and the test-only stateful probe).

Each fixture spawns one 2-rank group that runs every compressor (a per-compressor failure is reported by that
compressor's test, not by all of them); the tests then compare what the ranks returned.
"""

import tempfile
from functools import partial
from typing import Any

import pytest
import torch

from tests.distributed.reliability_ranks import MODES as MODE_TABLE
from tests.distributed.reliability_ranks import compressors_under_test, resume_runs, suite
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

COMPRESSORS = compressors_under_test()
TOTAL_STEPS, CUT_AT = 6, 3
MODES = list(MODE_TABLE)


def _ok(results: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    for rank, result in enumerate(results):
        assert "error" not in result[key], f"rank {rank}, {key}:\n{result[key]['error']}"
    return [r[key] for r in results]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmpdir:
        ranks = run_ranks(suite, 2, COMPRESSORS, tmpdir, TOTAL_STEPS, CUT_AT, MODES, timeout=600)
    return {part: [r[part] for r in ranks] for part in ("resume", "guard", "modes")}


@pytest.fixture(scope="module")
def resumed(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return results["resume"]


@pytest.fixture(scope="module")
def guarded(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return results["guard"]


@pytest.fixture(scope="module")
def modes(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return results["modes"]


# -- checkpoint / resume ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", COMPRESSORS)
def test_resume_is_bit_identical_to_the_uninterrupted_run(resumed: list[dict[str, Any]], name: str) -> None:
    runs = _ok(resumed, name)
    for rank, run in enumerate(runs):
        assert run["global_step"] == TOTAL_STEPS
        assert run["saved_ranks"] == 2, "every rank's state must be in rank 0's checkpoint"
        assert torch.equal(run["full"], run["resumed"]), (
            f"rank {rank}: resumed at step {CUT_AT} differs from the uninterrupted run by "
            f"{(run['full'] - run['resumed']).abs().max().item():.3g}"
        )
    assert torch.equal(runs[0]["resumed"], runs[1]["resumed"])
    for rank, run in enumerate(runs):  # the run's mean per step, the steps before the checkpoint included
        assert run["resumed_bytes"] == run["full_bytes"] > 0, f"rank {rank}: {run['resumed_bytes']} != {run['full_bytes']}"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_resume_without_the_compression_state_is_not_exact(resumed: list[dict[str, Any]], name: str) -> None:
    """The control: dropping the state (``resume_compression='reset'``) changes the run whenever there is state."""
    run = _ok(resumed, name)[0]
    stateful = run["other_world_error"] is not None  # a stateless compressor resumes on any world size
    assert torch.equal(run["full"], run["reset"]) != stateful


@pytest.mark.parametrize("name", COMPRESSORS)
def test_resume_on_another_world_size_fails_clearly(resumed: list[dict[str, Any]], name: str) -> None:
    for run in _ok(resumed, name):
        error = run["other_world_error"]
        if error is None:  # accepted only when no rank saved any state: nothing can be lost
            assert not run["saved_memory"]
            continue
        assert "world size is 2" in error and "3 ranks" in error and "resume_compression='reset'" in error


@pytest.fixture(scope="module")
def hierarchical_resumed() -> list[dict[str, Any]]:
    """The hierarchical exchange: 4 ranks as 2 sites of 2. The ranks' math libraries are single-threaded from
    their start (tests/harness.SINGLE_THREADED): DeMo decodes with BLAS on a Gloo thread, where MKL's dynamic threads
    otherwise make a run differ from the next by 1 ulp."""
    with tempfile.TemporaryDirectory() as tmpdir:
        return run_ranks(partial(resume_runs, site_sizes=[2, 2]), 4, COMPRESSORS, tmpdir, TOTAL_STEPS, CUT_AT, timeout=600)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_hierarchical_resume_is_bit_identical_to_the_uninterrupted_run(
    hierarchical_resumed: list[dict[str, Any]], name: str
) -> None:
    runs = [r[name] for r in hierarchical_resumed]
    for rank, run in enumerate(runs):
        assert "error" not in run, f"rank {rank}:\n{run['error']}"
        assert run["global_step"] == TOTAL_STEPS
        assert torch.equal(run["full"], run["resumed"]), (
            f"rank {rank}: resumed at step {CUT_AT} differs from the uninterrupted run by "
            f"{(run['full'] - run['resumed']).abs().max().item():.3g}"
        )
        assert torch.equal(runs[0]["resumed"], run["resumed"])
    # each rank checkpointed the residuals of its own share only (the two local ranks of a site own different ones)
    if name == "memory_probe":
        assert runs[0]["saved_memory"] and runs[1]["saved_memory"]
        assert not set(runs[0]["saved_memory"]) & set(runs[1]["saved_memory"])
        assert runs[0]["saved_memory"] == runs[2]["saved_memory"]


def test_the_stateful_probe_checkpoints_its_residuals(resumed: list[dict[str, Any]]) -> None:
    run = _ok(resumed, "memory_probe")[0]
    assert run["saved_memory"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight", "net.4.bias", "net.4.weight"]
    assert run["other_world_error"] is not None


# -- non-finite gradients and the replica check ---------------------------------------------------------------
@pytest.mark.parametrize("name", COMPRESSORS)
def test_nan_on_one_rank_skips_the_step_on_every_rank(guarded: list[dict[str, Any]], name: str) -> None:
    runs = _ok(guarded, name)
    for a, b in zip(runs[0]["history"], runs[1]["history"]):
        assert torch.equal(a, b), "replicas diverged"
    for run in runs:
        history = run["history"]
        assert run["skipped"] == 1
        assert torch.equal(history[1], history[2]), "the NaN step (2) changed the parameters"
        assert not torch.equal(history[2], history[3]), "training did not go on after the skipped step"
        assert all(bool(torch.isfinite(h).all()) for h in history)
        assert run["residuals_finite"], "a residual was poisoned"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_a_skipped_step_leaves_batchnorm_statistics_untouched(guarded: list[dict[str, Any]], name: str) -> None:
    """A NaN batch on rank 0 (whose buffers DDP broadcasts) at step 2: its running statistics are put back."""
    for rank, run in enumerate(_ok(guarded, name)):
        buffers = run["norm_buffers"]
        assert run["norm_skipped"] == 1
        assert all(bool(torch.isfinite(b).all()) for b in buffers), f"rank {rank}: non-finite BatchNorm statistics"
        assert torch.equal(buffers[1], buffers[2]), f"rank {rank}: the skipped step changed the buffers"
        assert not torch.equal(buffers[2], buffers[3]), f"rank {rank}: the buffers stopped moving"
        assert run["norm_eval_finite"], f"rank {rank}: evaluation outputs NaN"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_nan_on_one_rank_raises_on_every_rank_when_asked(guarded: list[dict[str, Any]], name: str) -> None:
    runs = _ok(guarded, name)
    for rank, run in enumerate(runs):
        assert run["raised"] is not None, f"rank {rank} did not stop"
        kind, message = run["raised"]
        assert kind == "NonFiniteGradientError" and "net." in message and "rank 1" in message, message
        assert "nonfinite='skip'" in message


def test_replica_check_names_the_first_diverging_parameter(guarded: list[dict[str, Any]]) -> None:
    for run in _ok(guarded, "__replicas__"):
        kind, message = run["raised"]
        assert kind == "ReplicaDivergenceError", message
        assert "step 2" in message and "`net.2.bias`" in message and "rank(s) [1]" in message


# -- training modes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_training_mode_keeps_replicas_identical(modes: list[dict[str, Any]], name: str, mode: str) -> None:
    a, b = _ok(modes, f"{name}/{mode}")
    assert torch.equal(a["params"], b["params"]), "replicas diverged"
    assert a["finite"] and a["moved"], "training did not move the parameters, or made them non-finite"
    assert a["hook_calls"] > 0, "the compression hook never ran"
    for n, r in a["residuals"].items():
        assert bool(torch.isfinite(r).all()), n


@pytest.mark.parametrize("name", COMPRESSORS)
def test_accumulation_runs_the_hook_only_on_synchronizing_steps(modes: list[dict[str, Any]], name: str) -> None:
    accumulated, _ = _ok(modes, f"{name}/accumulate_validate")
    big, _ = _ok(modes, f"{name}/big_batch")
    assert accumulated["steps"] == big["steps"] == 4
    # two micro-batches per step, yet as many hook calls as the run with one double-size batch per step
    assert accumulated["hook_calls"] == big["hook_calls"]


@pytest.mark.parametrize("name", ["fp32", "memory_probe"])
def test_accumulated_residuals_equal_those_of_the_equivalent_big_batch(modes: list[dict[str, Any]], name: str) -> None:
    """Deterministic compressors: accumulating two half batches compresses the same gradient as one full batch."""
    accumulated, _ = _ok(modes, f"{name}/accumulate_validate")
    big, _ = _ok(modes, f"{name}/big_batch")
    torch.testing.assert_close(accumulated["params"], big["params"], rtol=1e-4, atol=1e-5)
    assert accumulated["residuals"].keys() == big["residuals"].keys()
    for n in big["residuals"]:
        torch.testing.assert_close(accumulated["residuals"][n], big["residuals"][n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_half_precision_gradients_go_through_the_hook(modes: list[dict[str, Any]], name: str) -> None:
    assert _ok(modes, f"{name}/bf16_true")[0]["grad_dtypes"] == ["torch.bfloat16"]
    assert _ok(modes, f"{name}/fp16_true_static_graph")[0]["grad_dtypes"] == ["torch.float16"]


@pytest.mark.parametrize("name", COMPRESSORS)
def test_unused_frozen_and_tied_parameters(modes: list[dict[str, Any]], name: str) -> None:
    for mode in ("unused_frozen_tied", "fp16_true_static_graph"):
        names = _ok(modes, f"{name}/{mode}")[0]["names"]
        assert "unused.weight" in names and "enc.weight" in names
        assert "dec.weight" not in names, "a tied parameter must be compressed once, under its first name"
        assert not any(n.startswith("frozen.") for n in names), "frozen parameters have no gradient to send"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_validation_and_test_loops_during_fit(modes: list[dict[str, Any]], name: str) -> None:
    a, b = _ok(modes, f"{name}/accumulate_validate")
    assert {"val_loss", "test_loss"} <= a["metrics"].keys()
    assert a["metrics"]["val_loss"] == b["metrics"]["val_loss"]
