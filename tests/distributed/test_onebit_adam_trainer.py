"""1-bit Adam and 0/1 Adam under the Trainer on real Gloo ranks: the optimizer checked before the first step,
resume bit-exact in every phase, non-finite gradients skipped or raised on every rank alike in every phase."""

from pathlib import Path

import pytest
import torch

from tests.distributed.onebit_adam_ranks import final_sync_run, fit_unpaired, nonfinite_run, resume_run
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
    packets = [sum((n + 7) // 8 + 8 for n in chunk) for chunk in pieces]
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
