"""1-bit Adam and 0/1 Adam under the Trainer on real Gloo ranks: the optimizer checked before the first step,
resume bit-exact in every phase, non-finite gradients skipped or raised on every rank alike in every phase."""

from pathlib import Path

import pytest
import torch

from tests.distributed.onebit_adam_ranks import (
    MLP_STEPS,
    final_sync_run,
    fit_unpaired,
    mlp_runs,
    nonfinite_run,
    resume_run,
)
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


#: pairs refused both ways: 1-bit Adam / 0/1 Adam under strategies that are not theirs (``"fabric:<name>"``: a
#: Fabric loop), and the two strategies with an optimizer that is not theirs
UNPAIRED = [("ddp", "onebit"), ("terngrad", "zero_one"), ("sharded_terngrad", "onebit"), ("diloco", "zero_one"),
            ("fabric:ddp", "zero_one"), ("fabric:terngrad", "onebit"), ("zero_one_adam", "onebit"),
            ("onebit_adam", "zero_one"), ("onebit_adam", "adamw"), ("zero_one_adam", "adamw")]
OPTIMIZERS = {"onebit": "OneBitAdam", "zero_one": "ZeroOneAdam", "adamw": "AdamW"}


def test_a_strategy_optimizer_mismatch_is_refused_before_any_parameter_changes() -> None:
    """One world for every combination: each refused on every rank, before the first update."""
    ranks = run_ranks(fit_unpaired, 2, UNPAIRED, timeout=300)
    for r in ranks:
        for (strategy, method), case in zip(UNPAIRED, r):
            optimizer = OPTIMIZERS[method]
            assert case["raised"] is not None, f"{optimizer} under {strategy} ran"
            assert case["step"] == 0 and not case["changed"], f"{optimizer} under {strategy}: a parameter changed"
            if strategy in ("onebit_adam", "zero_one_adam"):  # the strategy's own check, at setup
                expected = "OneBitAdam" if strategy == "onebit_adam" else "ZeroOneAdam"
                assert (f"Expected configure_optimizers to return one lightning_gradcomp.optimizers.{expected} for "
                        f"strategy={strategy!r}, but got {optimizer}. Fix:") in case["raised"]
            else:  # the optimizer's, at its first step
                paired = "onebit_adam" if method == "onebit" else "zero_one_adam"
                assert case["raised"].startswith(f"Expected {optimizer} to step under Trainer(strategy={paired!r})")
                assert "but got it unbound in a distributed run of 2 rank(s)" in case["raised"]


# (method, options, checkpoint step, total steps, phase at the checkpoint)
RESUMES = {
    "onebit-warmup": ("onebit", {"freeze_step": 4}, 2, 7, {"step": 2, "frozen": False, "var_updates": 2}),
    "onebit-compressed": ("onebit", {"freeze_step": 2}, 4, 7, {"step": 4, "frozen": True, "var_updates": 2}),
    # frozen after step 2; local interval 2 from step 4 on: step 5 is between synchronisations
    "zero_one-local": ("zero_one", {"var_freeze_step": 1, "local_step_scaler": 2}, 5, 8, None),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_resume_is_bit_exact(case: str, tmp_path: Path) -> None:
    method, options, at, total, phase = RESUMES[case]
    ranks = run_ranks(resume_run, 2, method, options, str(tmp_path), total, at, timeout=400)
    for rank, r in enumerate(ranks):
        assert torch.equal(r["full"], r["resumed"]), f"rank {rank}: the resumed run ends elsewhere"
        assert torch.equal(r["full"], ranks[0]["full"]), f"rank {rank}: replicas differ"
        if phase is not None:
            assert r["phase_at_save"] == phase
        assert r["stats"]["compressed_phase"] == 1.0
        assert r["stats"]["worker_error_norm"] > 0 and r["stats"]["server_error_norm"] > 0
    saved = ranks[0]["entry"]
    if case != "onebit-warmup":
        # both error buffers of every rank are in the checkpoint, and the control shows they matter
        assert saved["exchange"]["worker"] and saved["exchange"]["server"]
        assert any(not torch.equal(r["full"], r["reset"]) for r in ranks)
    if case == "zero_one-local":
        assert "params" in saved  # each rank's own weights between synchronisations
        assert not torch.equal(ranks[0]["entry"]["params"]["net.0.weight"], ranks[1]["entry"]["params"]["net.0.weight"])


def test_bytes_per_step_in_the_compressed_phase(tmp_path: Path) -> None:
    """The hook's ledger (progress bar, monitor) shows the 1-bit exchange: worker packet + server packet in the
    latest step; ``bytes_per_step`` is the run's mean, the 2 dense warm-up steps included (an int)."""
    ranks = run_ranks(resume_run, 2, "onebit", {"freeze_step": 2}, str(tmp_path), 4, 2, timeout=400)
    # TinyClassifier: 20x64 + 64, 64x64 + 64, 64x5 + 5 = 5829 elements; chunks of 2915 / 2914: the second weight
    # (elements 1344..5439) is cut in two pieces, 1571 and 2525 elements
    pieces = [[1280, 64, 1571], [2525, 64, 320, 5]]
    # and each piece in blocks of 64 elements (the strategy's default scale_block), each with its two float32
    blocks = [[min(64, n - i) for n in chunk for i in range(0, n, 64)] for chunk in pieces]
    packets = [sum((n + 7) // 8 + 8 for n in chunk) for chunk in blocks]
    assert ranks[0]["dense_bytes"] == 4 * 5829
    for rank, r in enumerate(ranks):
        compressed = sum(packets) + packets[rank]
        assert r["last_bytes"] == compressed == r["stats"]["last_step_bytes"]
        # steps 1-2 fp32 (freeze_step=2), steps 3-4 compressed
        assert isinstance(r["bytes"], int) and r["bytes"] == (2 * 4 * 5829 + 2 * compressed) // 4
        assert r["bytes"] == r["stats"]["bytes_per_step"]


# (method, options, step of the NaN (0-based global step), phase there)
NONFINITE = {
    "onebit-warmup": ("onebit", {"freeze_step": 4}, 1),
    "onebit-compressed": ("onebit", {"freeze_step": 2}, 3),
    "zero_one-compressed-gradient": ("zero_one", {"var_freeze_step": 6, "var_update_scaler": 1}, 2),
    "zero_one-local": ("zero_one", {"var_freeze_step": 1}, 4),
}


@pytest.mark.parametrize("case", sorted(NONFINITE))
def test_nonfinite_is_skipped_on_every_rank(case: str) -> None:
    method, options, nan_at = NONFINITE[case]
    ranks = run_ranks(nonfinite_run, 2, method, options, "skip", nan_at, 6, timeout=300)
    for rank, r in enumerate(ranks):
        assert r["raised"] is None and r["finite"]
        assert r["skipped"] == 1
        assert r["counters"]["step"] == 5  # the skipped step changed no counter
        assert torch.equal(r["params"], ranks[0]["params"]), f"rank {rank} diverged"


@pytest.mark.parametrize("case", ["onebit-compressed", "zero_one-local"])
def test_nonfinite_raises_on_every_rank(case: str) -> None:
    method, options, nan_at = NONFINITE[case]
    ranks = run_ranks(nonfinite_run, 2, method, options, "raise", nan_at, 6, timeout=300)
    for r in ranks:
        assert r["raised"] is not None and r["raised"][0] == "NonFiniteGradientError"


def test_zero_one_adam_fit_ending_between_synchronisations_leaves_every_rank_identical(tmp_path: Path) -> None:
    """Synchronised at step 6, then every 4 steps: fits that end at step 7 (``max_steps``) and at the end of a
    7-batch epoch (``max_epochs``) synchronise once more; every rank leaves fit with the same bits, and the
    checkpoint written at the end holds them (no per-rank weights)."""
    cases = [(7, -1, 10), (-1, 1, 7)]
    ranks = run_ranks(final_sync_run, 2, str(tmp_path), cases, timeout=300)
    for index in range(len(cases)):
        first = ranks[0][index]
        assert first["step"] == 7
        for rank, r in enumerate(ranks):
            case = r[index]
            assert case["in_sync"], f"case {cases[index]}: rank {rank} ends between synchronisations"
            assert torch.equal(case["params"], first["params"]), f"case {cases[index]}: rank {rank} differs"
            assert torch.equal(case["checkpoint"], case["params"]), f"case {cases[index]}: the checkpoint is elsewhere"
            assert "params" not in case["entry"]


# -- at their defaults, on a model nobody tuned them on; a run that cannot recover stops -------------------------
#: the 3-layer MLP (32-256-256-8) at lr 2e-3 for 120 steps on 2 ranks: AdamW DDP, both methods at their defaults
#: and with a short warm-up, a NaN put into a parameter, and a rank whose loss is NaN at every step from step 30
MLP_CASES = {
    "adamw": ("ddp", {}),
    "onebit_default": ("onebit_adam", {}),
    "zero_one_default": ("zero_one_adam", {}),
    "onebit_freeze15": ("onebit_adam", {"freeze_step": 15}),
    "zero_one_freeze15": ("zero_one_adam", {"var_freeze_step": 15}),
    "nan_parameter": ("onebit_adam", {"nan_at": 30}),
    "nan_every_step": ("zero_one_adam", {"nan_loss_from": 30}),
}


@pytest.fixture(scope="module")
def mlp() -> list[dict]:
    return run_ranks(mlp_runs, 2, MLP_CASES, timeout=600)


@pytest.mark.parametrize("case", ["onebit_default", "zero_one_default", "onebit_freeze15", "zero_one_freeze15"])
def test_at_their_defaults_both_train_as_adamw_ddp(mlp: list[dict], case: str) -> None:
    """Within 10 % of AdamW DDP's final loss, on every rank, having compressed most steps (the default warm-up is
    15 % of the run: 18 of 120 steps)."""
    target = mlp[0]["adamw"]["loss"]
    for r in mlp:
        assert r[case]["raised"] is None
        assert r[case]["loss"] <= 1.1 * target, f"{case}: {r[case]['loss']:.4f} against AdamW DDP's {target:.4f}"
        assert r[case]["compressed"] >= 0.8 * MLP_STEPS


def test_non_finite_parameters_stop_the_run_naming_step_and_parameter(mlp: list[dict]) -> None:
    for r in mlp:
        kind, message = r["nan_parameter"]["raised"]
        assert kind == "NonFiniteGradientError" and r["nan_parameter"]["global_step"] == 30
        assert "Non-finite parameters or optimizer state at step 30" in message and "`net.2.bias`" in message
        assert "Fix:" in message


def test_ten_skipped_steps_in_a_row_stop_the_run(mlp: list[dict]) -> None:
    """Rank 1's loss is NaN from step 30 on: steps 30..39 are skipped on both ranks, and the 10th stops both."""
    for rank, r in enumerate(mlp):
        kind, message = r["nan_every_step"]["raised"]
        assert kind == "NonFiniteGradientError" and "The last 10 steps were all skipped" in message
        assert "up to step 39" in message and "Fix:" in message
        # each rank names the parameter whose gradient it found non-finite (rank 1's), or says it was another rank's
        assert ("` on this rank" in message) if rank == 1 else ("a parameter on another rank" in message)


def test_a_warmup_past_the_run_warns_at_setup_and_a_fraction_needs_an_end(mlp: list[dict]) -> None:
    """``freeze_step=100000`` on a 3-step run: rank 0 warns before step 0 with the value to use, and the setup line
    says no compressed step runs instead of promising an exchange's bytes; the default warm-up (a fraction) in a
    run without end is refused before step 0 (in the MLP tests' world: :func:`warmup_setup_runs`)."""
    ranks = [r["__setup__"] for r in mlp]
    [warning] = ranks[0]["warnings"]
    assert "OneBitAdam's freeze_step=100000 is at or past the run's 3 steps: no step is compressed" in warning
    assert "Fix: freeze_step=1 (freeze_step=0.15" in warning
    [line] = [line for line in ranks[0]["lines"] if "fp32 gradient all-reduce" in line]
    assert "no compressed step in the run's 3 steps" in line and "bytes per exchange" not in line
    for rank, r in enumerate(ranks):
        assert r["compressed"] == 0
        assert r["warnings"] == [] or rank == 0
        assert r["endless_step"] == 0 and r["endless"] is not None
        assert "Expected a run with a known number of steps for `var_freeze_step=0.15`" in r["endless"]
        assert "Fix: set `Trainer(max_steps=...)`, or give ZeroOneAdam's var_freeze_step in steps" in r["endless"]
