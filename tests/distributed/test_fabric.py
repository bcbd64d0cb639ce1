"""``Fabric(strategy=...)`` with the gradcomp hook, on real Gloo ranks."""

import pytest
import torch

from lightning_gradcomp import GradCompFabricStrategy
from lightning_gradcomp.callbacks import SigmaClipping
from tests.distributed.fabric_ranks import diverge_fabric, fit_fabric, hierarchy_fabric, make_model, resume_fabric
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def test_fabric_terngrad_by_name_trains_with_bit_identical_replicas() -> None:
    ranks = run_ranks(fit_fabric, 2, "terngrad")
    assert ranks[0]["strategy"] == "GradCompFabricStrategy" and ranks[0]["compressor"] == "TernGrad"
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["dense_bytes"] / ranks[0]["bytes_per_step"] > 10  # 2-bit payloads: the hook really ran


def test_fabric_fp32_through_the_hook_equals_plain_fabric_ddp() -> None:
    stock = run_ranks(fit_fabric, 2, "ddp")
    ours = run_ranks(fit_fabric, 2, "fp32")
    assert stock[0]["strategy"] == "DDPStrategy" and ours[0]["strategy"] == "GradCompFabricStrategy"
    assert torch.equal(ours[0]["params"], ours[1]["params"])
    torch.testing.assert_close(stock[0]["params"], ours[0]["params"], rtol=1e-5, atol=1e-6)
    initial = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    assert not torch.allclose(ours[0]["params"], initial), "nothing trained"


def test_fabric_transforms_given_to_the_strategy_run_inside_the_hook() -> None:
    clipped = run_ranks(fit_fabric, 2, GradCompFabricStrategy("fp32", transforms=[SigmaClipping(0.5)]))
    plain = run_ranks(fit_fabric, 2, GradCompFabricStrategy("fp32"))
    assert clipped[0]["transforms"] == ["SigmaClip"]
    assert torch.equal(clipped[0]["params"], clipped[1]["params"])
    assert not torch.allclose(plain[0]["params"], clipped[0]["params"]), "clipping changed nothing"


def test_fabric_nan_on_one_rank_skips_the_step_on_every_rank() -> None:
    # the rank body asserts that the skipped step left the weights unchanged
    ranks = run_ranks(fit_fabric, 2, "graddrop", 4, 2)
    assert [r["skipped_steps"] for r in ranks] == [1, 1]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.isfinite(ranks[0]["params"]).all()


def test_fabric_save_and_load_resume_the_compression_state_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ranks = run_ranks(resume_fabric, 2, "graddrop", str(tmp_path / "fabric.ckpt"))
    for r in ranks:
        assert torch.equal(r["exact"], r["straight"]), "resumed run differs from the uninterrupted one"
        # control: without the residuals and random streams the run differs, so the test can fail
        assert not torch.equal(r["reset"], r["straight"])
    assert torch.equal(ranks[0]["exact"], ranks[1]["exact"])


def test_fabric_whole_checkpoint_load_restores_the_compression_state_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # `full = fabric.load(path)`, then model/optimizer.load_state_dict(full[...]): Gradient Dropping's residuals and
    # SGD momentum must continue as in the uninterrupted run, not start afresh
    ranks = run_ranks(resume_fabric, 2, "graddrop", str(tmp_path / "fabric.ckpt"), ("full", "reset"))
    for r in ranks:
        assert torch.equal(r["full"], r["straight"]), "resumed from the whole checkpoint, the run differs"
        assert not torch.equal(r["reset"], r["straight"])  # control: without the compression state it differs


def test_fabric_replica_check_stops_every_rank_at_the_step_replicas_diverge() -> None:
    # the last rank nudges `2.weight` before the second optimizer step: every rank stops right after that step
    ranks = run_ranks(diverge_fabric, 2, 1)
    for r in ranks:
        assert r["error"] is not None and r["step"] == 1, r
        kind, message = r["error"]
        assert kind == "ReplicaDivergenceError" and "`2.weight`" in message and "at step 2" in message, message
    # control: the same run without the nudge passes every check
    clean = run_ranks(diverge_fabric, 2, None)
    assert [r["error"] for r in clean] == [None, None] and torch.equal(clean[0]["params"], clean[1]["params"])


def test_fabric_hierarchy_sends_a_share_between_sites_and_averages_over_every_rank() -> None:
    # 2 sites of 2 ranks: dense inside a site, each rank's share between sites (about half the flat exchange's bytes)
    ranks = run_ranks(hierarchy_fabric, 4)
    assert all(torch.equal(r["params"], ranks[0]["params"]) for r in ranks[1:])
    torch.testing.assert_close(ranks[0]["params"], ranks[0]["reference"], rtol=1e-5, atol=1e-6)
    dense = 4 * sum(p.numel() for p in make_model().parameters())  # what flat fp32 DDP sends per rank
    assert 0 < ranks[0]["bytes_per_step"] < 0.75 * dense  # rank 0's share only crosses sites
