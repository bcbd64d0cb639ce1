"""DiLoCo at run time on 2 real Gloo ranks (sites of one rank): the end of fit, what is reported as sent, replica
checks by site, resume and layout warnings, a non-finite pseudo-gradient. One spawned world runs every scenario."""

from typing import Any

import pytest
import torch

from lightning_gradcomp.outer import DiLoCoStrategy
from tests.distributed.diloco_runtime_ranks import runtime_scenarios
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

# TinyClassifier: Linear(20, 64), Linear(64, 64), Linear(64, 5)
NUMEL = 20 * 64 + 64 + 64 * 64 + 64 + 64 * 5 + 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(runtime_scenarios, 2, str(tmp_path_factory.mktemp("diloco_runtime")), timeout=400.0)


def _ok(runs: list[dict[str, dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    for rank, r in enumerate(runs):
        assert r[name]["error"] is None, f"rank {rank}: {r[name]['error']}"
    return [r[name] for r in runs]


def test_a_run_shorter_than_sync_every_ends_with_identical_replicas(runs: list[dict[str, dict[str, Any]]]) -> None:
    short = _ok(runs, "short")
    assert torch.equal(short[0]["params"], short[1]["params"]), "replicas differ when fit returned"
    # the one round that ran (the final one) is what was sent: dense fp32, over the 3 steps
    assert short[0]["rounds"] == 1
    assert short[0]["bytes_per_step"] == 4 * NUMEL // 3
    # no round ran on schedule; the final one runs right after the last step, and the progress bar shows it as
    # bytes_per_step() counts it: 3.0x less than DDP over the 3 steps (not the in-site hook's 1.0x of nothing sent)
    assert short[0]["progress_bar"]["comp_ratio"] == pytest.approx(3.0, rel=1e-3)


def test_progress_bar_shows_ddp_bytes_over_the_outer_rounds(runs: list[dict[str, dict[str, Any]]]) -> None:
    checked = _ok(runs, "checked")
    # H = 2 over 4 steps: two dense rounds, half of DDP's bytes per step
    assert checked[0]["progress_bar"]["comp_ratio"] == pytest.approx(2.0)
    assert checked[0]["bytes_per_step"] == 4 * NUMEL // 2


def test_streaming_lands_in_flight_fragments_and_drops_mixing_at_the_end(runs: list[dict[str, dict[str, Any]]]) -> None:
    streaming = _ok(runs, "streaming")
    assert torch.equal(streaming[0]["params"], streaming[1]["params"])


@pytest.mark.parametrize("name", ["last_checkpoint", "last_checkpoint_streaming"])
def test_the_last_checkpoint_holds_the_weights_every_rank_leaves_fit_with(runs: list[dict[str, dict[str, Any]]],
                                                                          name: str) -> None:
    ranks = _ok(runs, name)
    final = ranks[0]["params"]
    for rank, r in enumerate(ranks):
        assert torch.equal(r["params"], final), f"rank {rank} left fit with other weights than rank 0"
        assert torch.equal(r["checkpoint_params"], final), (
            f"the last checkpoint (step {r['checkpoint_step']}) holds weights other than those fit returned"
        )
        for site, weights in enumerate(r["checkpoint_sites"]):
            assert torch.equal(weights, final), f"the last checkpoint holds other weights for rank {site}'s site"


def test_a_fit_stopped_between_rounds_ends_with_identical_replicas(runs: list[dict[str, dict[str, Any]]]) -> None:
    stopped = _ok(runs, "stopped")
    assert torch.equal(stopped[0]["params"], stopped[1]["params"]), "replicas differ when fit returned"
    assert stopped[0]["rounds"] == 2  # the round at step 2, and the final one after step 3


def test_setup_line_describes_the_outer_exchange(runs: list[dict[str, dict[str, Any]]]) -> None:
    logs = runs[0]["short"]["logs"]
    assert any("no exchange inside a site" in line for line in logs), logs
    outer = [line for line in logs if "outer rounds between 2 sites" in line]
    assert outer, logs
    assert f"{4 * NUMEL:,} bytes per round every 100 inner steps" in outer[0]
    assert f"{4 * NUMEL / 100:,.0f} bytes per inner step at sync_every=100" in outer[0] and "(100.0x less)" in outer[0]
    # nothing claims the in-site hook's bytes as traffic
    assert not any("Identity on 1 rank" in line for line in logs), logs


@pytest.mark.parametrize("name", ["checked", "weightgrad_checked"])
def test_replica_check_compares_sites_only_where_they_must_agree(runs: list[dict[str, dict[str, Any]]],
                                                                 name: str) -> None:
    _ok(runs, name)


def test_replica_check_catches_global_weights_that_differ_after_a_round(runs: list[dict[str, dict[str, Any]]]) -> None:
    for r in runs:
        kind, message = r["anchor_perturbed"]["error"]
        assert kind == "ReplicaDivergenceError", message
        assert "step 1" in message and "rank(s) [1]" in message and "right after an outer round" in message, message


def test_one_site_warns_that_nothing_crosses(runs: list[dict[str, dict[str, Any]]]) -> None:
    one = _ok(runs, "one_site")
    assert any("form one site (site_size=2)" in w and "Fix:" in w for w in one[0]["warnings"]), one[0]["warnings"]


def test_resume_with_another_sync_every_warns(runs: list[dict[str, dict[str, Any]]]) -> None:
    other = _ok(runs, "other_h")
    assert any("Expected `sync_every` to be the checkpoint's 2, but got 3" in w and "Fix:" in w
               for w in other[0]["warnings"]), other[0]["warnings"]
    assert torch.equal(other[0]["params"], other[1]["params"])


def test_resume_from_a_ddp_checkpoint_warns_that_the_outer_state_starts_afresh(
        runs: list[dict[str, dict[str, Any]]]) -> None:
    from_ddp = _ok(runs, "from_ddp")
    assert any("holds no DiLoCo state" in w and "Fix:" in w for w in from_ddp[0]["warnings"]), from_ddp[0]["warnings"]


def test_resume_from_a_gradcomp_checkpoint_is_refused_unless_reset(runs: list[dict[str, dict[str, Any]]]) -> None:
    for r in runs:
        kind, message = r["from_gradcomp"]["error"]
        assert kind == "ValueError" and "resume_compression='reset'" in message, message
    reset = _ok(runs, "from_gradcomp_reset")
    assert torch.equal(reset[0]["params"], reset[1]["params"])


def test_nonfinite_pseudo_gradient_names_the_site_and_no_skip_option(runs: list[dict[str, dict[str, Any]]]) -> None:
    for r in runs:
        kind, message = r["nan"]["error"]
        assert kind == "NonFiniteGradientError", message
        assert "pseudo-gradient" in message and "inner step 2" in message and "Fix:" in message, message
        assert "nonfinite='skip'" not in message, message
    assert "of site 1" in runs[1]["nan"]["error"][1]


@pytest.mark.parametrize("kwargs, world_size, where", [({}, 1, r"runs on one device"),
                                                       ({"site_size": 4}, 4, r"its 4 ranks form one site \(site_size=4\)")])
def test_one_site_layouts_warn(kwargs: dict[str, Any], world_size: int, where: str) -> None:
    with pytest.warns(UserWarning, match=where):
        DiLoCoStrategy(**kwargs).make_layout(world_size)
