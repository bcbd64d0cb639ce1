"""DiLoCo over FSDP2 sites on 4 real Gloo ranks: 2 sites of 2 shards (ranks 0, 1 shard site 0; ranks 2, 3 site 1;
rank r and rank r + 2 hold the same shard). One spawned world runs every configuration (spawns are expensive)."""

from typing import Any, Optional

import pytest
import torch

from lightning_gradcomp.outer import ShardedDiLoCoStrategy
from tests.distributed.sharded_diloco_ranks import sharded_diloco_configs
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

H2 = {"sync_every": 2, "compressor": "fp32"}
RESUMED = {"shard_size": 2, "sync_every": 3, "compressor": "sparseloco", "check_replicas_every": 1}
CONFIGS: list[dict[str, Any]] = [
    # 0, 1: the same DiLoCo (AdamW inner steps, outer Nesterov 0.7 / 0.9, identity outer compression, H = 2, a final
    # round after step 5) over DDP sites of 2 ranks and over FSDP2 sites of 2 shards
    {"kind": "ddp", "strategy": dict(H2, site_size=2), "steps": 5},
    {"strategy": dict(H2, shard_size=2), "steps": 5},
    # 2: Streaming DiLoCo: 3 fragments (one per Linear) synced at steps 1, 2, 4 of each window of 4, each landing one
    # step after its launch, mixing 0.5, int8 shards; fit ends with fragment 2 in flight
    {"strategy": {"shard_size": 2, "sync_every": 4, "fragments": 3, "sync_delay": 1, "mixing": 0.5,
                  "compressor": "int8", "check_replicas_every": 1}, "steps": 5},
    # 3: rank 1 moves its anchor shard before step 0: the check right after the round at step 1 catches it
    {"strategy": {"shard_size": 2, "sync_every": 2, "check_replicas_every": 1}, "steps": 3, "perturb": (1, 0)},
    # 4-6: bad input, refused on every rank before the first step
    {"strategy": {"shard_size": 3}},
    {"kind": "unsharded", "strategy": {"shard_size": 2}},
    {"strategy": {"shard_size": 2, "fragments": 4}},
    # 7-9: resume at the end of epoch 0 (step 4, between the rounds at 3 and 6), SparseLoCo-style top-k with 2-bit
    # values and error feedback (all-gathered), checked after every round: uninterrupted, resumed, and resumed
    # without the per-rank state
    {"strategy": RESUMED, "steps": 8, "save": "ckpt"},
    {"strategy": RESUMED, "steps": 8, "resume": "ckpt/epoch=0-step=4.ckpt"},
    {"strategy": dict(RESUMED, resume_compression="reset"), "steps": 8, "resume": "ckpt/epoch=0-step=4.ckpt"},
    # 10: the same checkpoint on 4 sites of 1 shard: the outer state is per shard, refused before the first step
    {"strategy": dict(RESUMED, shard_size=1), "steps": 8, "resume": "ckpt/epoch=0-step=4.ckpt"},
]
DDP, IDENTITY, STREAMING, PERTURBED, BAD_SIZE, UNSHARDED, BAD_FRAGMENTS, FULL, RESUMED_RUN, RESET, RESHARDED = range(11)

# ShardedRegressor: Linear(8, 16), Linear(16, 12), Linear(12, 3), each split over 2 ranks along its first dimension
SHARD_NUMEL = {0: 8 * 8 + 8 + 6 * 16 + 6 + 2 * 12 + 2, 1: 8 * 8 + 8 + 6 * 16 + 6 + 1 * 12 + 1}
NUMEL = SHARD_NUMEL[0] + SHARD_NUMEL[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    tmpdir = str(tmp_path_factory.mktemp("sharded_diloco"))
    return run_ranks(sharded_diloco_configs, 4, CONFIGS, tmpdir, timeout=600.0)


def _ok(results: list[list[dict[str, Any]]], i: int) -> list[dict[str, Any]]:
    runs = [results[r][i] for r in range(4)]
    for rank, run in enumerate(runs):
        assert run["error"] is None, f"rank {rank}: {run['error']}"
    return runs


def _whole(runs: list[dict[str, Any]], site: int, step: Optional[int]) -> list[torch.Tensor]:
    """Site ``site``'s parameters after ``step`` (``None``: when fit returned, after the final round), each put back
    together from its two ranks' shards."""
    first, second = ((r["final"] if step is None else r["params"][step]) for r in runs[2 * site : 2 * site + 2])
    return [torch.cat([a, b]) for a, b in zip(first, second)]


def test_identity_over_shards_equals_diloco_over_ddp_sites_bit_for_bit(results: list[list[dict[str, Any]]]) -> None:
    ddp, sharded = _ok(results, DDP), _ok(results, IDENTITY)
    for step in [*range(5), None]:
        for site in range(2):
            reference = ddp[2 * site]["final" if step is None else "params"]
            for i, (a, b) in enumerate(zip(_whole(sharded, site, step), reference if step is None else reference[step])):
                assert torch.equal(a, b), f"site {site}, parameter {i}, step {step}: FSDP2 sites differ from DDP sites"
    # the sites trained apart between rounds (step 3: one step after the round at step 2), and the final round after
    # step 5 made them one model
    assert not torch.equal(_whole(sharded, 0, 2)[0], _whole(sharded, 1, 2)[0])
    assert all(torch.equal(a, b) for a, b in zip(_whole(sharded, 0, None), _whole(sharded, 1, None)))


def test_the_outer_round_sends_each_ranks_shard_only(results: list[list[dict[str, Any]]]) -> None:
    ddp, sharded = _ok(results, DDP), _ok(results, IDENTITY)
    for rank in range(4):
        shard = SHARD_NUMEL[rank % 2]
        assert sum(t.numel() for t in sharded[rank]["params"][0]) == shard
        # fp32: 4 bytes per element of this rank's shard, from every rank (not only a site's leader)
        assert int(sharded[rank]["stats"][1]["bytes_per_round"]) == 4 * shard
        assert int(sharded[rank]["stats"][1]["lan_bytes_per_round"]) == 0  # no broadcast inside the site
        # rounds at steps 2 and 4 and the final one after step 5, over 5 steps; dense HSDP: the shard every step
        assert sharded[rank]["rounds"] == 3
        assert sharded[rank]["bytes_per_step"] == 3 * 4 * shard // 5
        assert sharded[rank]["dense_bytes_per_step"] == 4 * shard
        # the outer state is sharded too: the anchor and the outer momentum cover this rank's shard
        assert sharded[rank]["anchor_numel"] == sharded[rank]["momentum_numel"] == shard
    # a site's two ranks together send what a DDP site's leader sends
    assert int(ddp[0]["stats"][1]["bytes_per_round"]) == 4 * NUMEL and int(ddp[1]["stats"][1]["bytes_per_round"]) == 0
    # and then fans the decoded mean out inside its site (fp32, the site transport's broadcast, counted by the ledger)
    assert [int(ddp[r]["stats"][1]["lan_bytes_per_round"]) for r in range(4)] == [4 * NUMEL, 0, 4 * NUMEL, 0]
    assert ddp[0]["anchor_numel"] == NUMEL


@pytest.mark.parametrize("index", [STREAMING, FULL], ids=["streaming-int8", "sparseloco"])
def test_compressed_shards_keep_the_copies_of_each_shard_identical(results: list[list[dict[str, Any]]],
                                                                   index: int) -> None:
    """Checked inside the run right after every round (``check_replicas_every=1``: each shard against its copy in
    the other site); here, after the final round, each shard equals its copy, and less than fp32 was sent."""
    runs = _ok(results, index)
    for rank in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(runs[rank]["final"], runs[rank + 2]["final"])), rank
        assert not torch.equal(runs[rank]["params"][0][0], runs[rank]["final"][0])  # it trained
    for rank in range(4):
        assert 0 < int(runs[rank]["stats"][-1]["bytes_per_round"]) < 4 * SHARD_NUMEL[rank % 2] / 3


def test_streaming_fragments_land_after_the_delay(results: list[list[dict[str, Any]]]) -> None:
    runs = _ok(results, STREAMING)
    # fragments launch at 1, 2, 4 (1-based) and land one step later; the one launched at step 4 lands at 5
    assert [int(s["rounds"]) for s in runs[0]["stats"]] == [0, 1, 2, 2, 3]
    # with mixing 0.5 the sites keep part of their own weights between rounds
    assert not torch.equal(runs[0]["params"][3][0], runs[2]["params"][3][0])


def test_replica_check_after_a_round_compares_each_shard_with_its_copy(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        kind, message = results[rank][PERTURBED]["error"]
        assert kind == "ReplicaDivergenceError", message
        assert "step 1" in message and "rank(s) [3] differs from rank 1" in message, message
        assert "the ranks holding the same shard must hold the same weights right after an outer round" in message


def test_bad_input_is_refused_before_the_first_step(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        kind, message = results[rank][BAD_SIZE]["error"]
        assert kind == "ValueError" and "Expected `shard_size` to divide the world size (4 ranks), but got 3" in message
        kind, message = results[rank][UNSHARDED]["error"]
        assert "Expected the model to be sharded with FSDP2 in `configure_model`" in message and "Fix:" in message
        kind, message = results[rank][BAD_FRAGMENTS]["error"]
        assert "Expected `fragments` to be at most the model's 3 layers" in message and "Fix:" in message


def test_resume_mid_window_is_bit_identical(results: list[list[dict[str, Any]]]) -> None:
    """The checkpoint holds every rank's outer state (anchor shard, outer error feedback, the site's weights) and
    its shard of the inner AdamW moments, which differ between the sites; without them the run differs."""
    full, resumed, reset = _ok(results, FULL), _ok(results, RESUMED_RUN), _ok(results, RESET)
    for rank in range(4):
        assert len(resumed[rank]["params"]) == 4
        for step in range(4):
            for a, b in zip(full[rank]["params"][4 + step], resumed[rank]["params"][step]):
                assert torch.equal(a, b), f"rank {rank}, step {4 + step}: resume differs from the uninterrupted run"
    assert any(not torch.equal(full[r]["params"][4][0], reset[r]["params"][0][0]) for r in range(4))


def test_resume_with_another_shard_size_is_refused(results: list[list[dict[str, Any]]]) -> None:
    for rank in range(4):
        kind, message = results[rank][RESHARDED]["error"]
        assert kind == "ValueError", message
        assert "come from `shard_size=1` as this run, but got one written with `shard_size=2`" in message
        assert "Fix: resume with `shard_size=2`" in message


def test_registered_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    streaming = StrategyRegistry.get("sharded_streaming_diloco")
    assert isinstance(streaming, ShardedDiLoCoStrategy)
    assert (streaming.num_fragments, streaming.sync_delay, streaming.mixing) == (4, 5, 0.5)
    assert isinstance(StrategyRegistry.get("sharded_diloco"), ShardedDiLoCoStrategy)
    assert "sharded_diloco_notebook" not in StrategyRegistry

