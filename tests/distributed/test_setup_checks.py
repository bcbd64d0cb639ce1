"""What a run says before and after its first step, on real Gloo ranks: the setup line (exact, or the first step's
measured bytes where the size follows the data), warnings for combinations that train badly, and one
``bytes_per_step`` per strategy behind the progress bar and the monitor."""

import math
import re

import pytest

from lightning_gradcomp import GradCompFabricStrategy, GradCompStrategy
from lightning_gradcomp.registry import compressor_names, make_compressor
from tests.distributed.setup_ranks import first_steps, setup_lines_of, shown_bytes
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def _number(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_sparse_setup_line_promises_no_estimate_and_the_first_step_is_measured(api: str) -> None:
    ranks = run_ranks(first_steps, 2, api, "adacomp")
    lines = ranks[0]["lines"]
    setup = [line for line in lines if line.startswith("gradcomp: AdaComp on 2 ranks")]
    assert len(setup) == 1, lines
    # AdaComp sends what the gradients select: a number computed from random tensors bounds nothing
    assert "expected" not in setup[0] and "step 1's measured bytes follow" in setup[0], setup[0]
    measured = [line for line in lines if line.startswith("gradcomp: step 1 sent")]
    assert len(measured) == 1, lines
    sent = re.match(r"gradcomp: step 1 sent ([\d,]+) bytes per rank", measured[0])
    assert sent and _number(sent.group(1)) == ranks[0]["first"] > 0  # the ledger's bytes of that step
    assert ranks[1]["lines"] == []  # rank 0 speaks for the run


def test_fabric_prints_the_setup_line_and_fixed_size_bytes_are_what_every_step_sends() -> None:
    names = [n for n in compressor_names() if make_compressor(n).fixed_size]
    assert {"terngrad", "qsgd", "demo", "powersgd"} <= set(names)
    ranks = run_ranks(setup_lines_of, 2, names)
    assert all(ranks[1][name]["lines"] == [] for name in names)  # rank 0 speaks for the run
    for name in names:
        run = ranks[0][name]
        (line,) = run["lines"]
        expected = re.search(r"; expected ([\d,]+) bytes per rank per step vs ([\d,]+) for fp32 DDP", line)
        assert expected, line
        # exact: what the ledger counted on the step (packets, fp32 layers and the shared statistics)
        assert _number(expected.group(1)) == run["first"], (name, line, run["first"])
    assert ranks[0]["terngrad"]["lines"][0].startswith("gradcomp: TernGrad on 2 ranks: all-gather of each rank's packed "
                                                       "payload after one small all-reduce of shared scalers; expected ")


def test_hierarchical_setup_line_states_what_a_site_sends_between_sites() -> None:
    ranks = run_ranks(first_steps, 4, "trainer", GradCompStrategy("terngrad", site_size=2), "sgd", 1)
    (line, _) = ranks[0]["lines"]  # the setup line, then the hierarchical exchange's own
    expected = re.search(r"^gradcomp: TernGrad between 2 sites: .*; expected ([\d,]+) bytes per site \(its ranks send "
                         r"one share each\) per step", line)
    assert expected, line
    # each rank's ledger holds its share between sites: a site's ranks together send the stated bytes
    assert _number(expected.group(1)) == ranks[0]["first"] + ranks[1]["first"] == ranks[2]["first"] + ranks[3]["first"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_demo_with_an_optimizer_keeping_its_own_momentum_warns_once_on_rank_0(optimizer: str) -> None:
    ranks = run_ranks(first_steps, 2, "fabric", GradCompFabricStrategy("demo"), optimizer, 1)
    mine = [w for w in ranks[0]["warnings"] if "DeMo's optimizer" in w]
    assert len(mine) == 1, ranks[0]["warnings"]
    assert "SignSGD" in mine[0] and "Fix:" in mine[0]
    assert not any("DeMo's optimizer" in w for w in ranks[1]["warnings"])


def test_demo_with_signsgd_warns_nothing() -> None:
    ranks = run_ranks(first_steps, 2, "fabric", GradCompFabricStrategy("demo"), "signsgd", 1)
    assert not any("DeMo" in w for r in ranks for w in r["warnings"])


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_compression_on_one_rank_warns_and_claims_no_exchange(api: str) -> None:
    (rank,) = run_ranks(first_steps, 1, api, "terngrad", "sgd", 1)
    single = [w for w in rank["warnings"] if "Expected at least 2 ranks" in w]
    assert len(single) == 1 and "Fix:" in single[0] and "TowerStrategy" in single[0], rank["warnings"]
    assert len(rank["lines"]) == 1 and "on 1 rank: nothing is exchanged" in rank["lines"][0], rank["lines"]
    assert "all-gather" not in rank["lines"][0] and "expected" not in rank["lines"][0]


def test_progress_bar_and_monitor_show_each_strategys_own_bytes_per_step() -> None:
    ranks = run_ranks(shown_bytes, 2)
    for run in ranks[0]:  # DiLoCo, WeightGrad: rank 0 logs
        assert run["bytes"] and run["dense"], run  # each strategy answers, and something crossed
        ratio = run["dense"] / run["bytes"]
        assert math.isclose(run["comp_ratio"], ratio, rel_tol=1e-6), run
        assert run["logged_bytes"] == pytest.approx(run["bytes"]) and run["logged_ratio"] == pytest.approx(ratio)
        # the per-step hook inside a site is not what crosses between sites: the two answers differ
        assert run["bytes"] != run["hook_bytes"]
