"""The cost-model planner inside the hook, on real Gloo ranks: its choices, and replicas that never diverge."""

import pytest
import torch

from lightning_gradcomp import GradCompStrategy
from tests.distributed.planner_ranks import planner_checks
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def test_planner_choices_and_parity() -> None:
    results = run_ranks(planner_checks, 2)
    for case in ("slow", "fast", "int8", "terngrad", "split"):
        for step, (a, b) in enumerate(zip(results[0][case]["params"], results[1][case]["params"])):
            assert torch.equal(a, b), f"{case}: rank 1 diverged at step {step}"
    r = results[0]
    # slow link: all-gather of packed payloads (2 ranks), the same updates as TernGrad without a planner
    assert r["slow"]["plans"] == ["allgather"] and r["slow"]["collectives"]["plan_allgather"] > 0
    for a, b in zip(r["slow"]["params"], r["terngrad"]["params"]):
        assert torch.equal(a, b)
    # fast link, dear compressor: plain fp32 all-reduce, exactly the fp32 hook's updates
    assert r["fast"]["plans"] == ["allreduce_fp32"] and "allgather" not in r["fast"]["collectives"]
    for a, b in zip(r["fast"]["params"], r["fp32"]["params"]):
        assert torch.equal(a, b)
    # int8 sums of the same ternaries: exact, so again the same updates as the all-gather
    assert r["int8"]["plans"] == ["allreduce_int8"] and r["int8"]["collectives"]["allreduce_int8"] > 0
    for a, b in zip(r["int8"]["params"], r["terngrad"]["params"]):
        assert torch.equal(a, b)
    # the planner handed its choice to the hook per bucket; the compressor itself was left on "auto"
    assert r["int8"]["described"] == r["terngrad"]["described"] and r["int8"]["described"]["collective"] == "auto"
    # ranks given different links vote; the split vote falls back to plain fp32 on both (no collective mismatch)
    assert r["split_rank0_alone"]["plans"] != ["allreduce_fp32"]  # so rank 0's own choice really differed
    assert results[0]["split"]["plans"] == results[1]["split"]["plans"] == ["allreduce_fp32"]
    for a, b in zip(r["split"]["params"], r["fp32"]["params"]):
        assert torch.equal(a, b)


def test_strategy_link_option() -> None:
    assert GradCompStrategy(compressor="terngrad").planner is None
    strategy = GradCompStrategy(compressor="terngrad", link="1gbit@50us")
    assert strategy.planner is not None and strategy.planner.network.link.bandwidth == 1e9
    with pytest.raises(ValueError, match="1 gbit"):
        GradCompStrategy(compressor="terngrad", link="1 gbit/s")
