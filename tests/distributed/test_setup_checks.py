"""What a run says before and after its first step, on real Gloo ranks: the setup line (exact, or the first step's
measured bytes where the size follows the data), warnings for combinations that train badly, and one
``bytes_per_step`` per strategy behind the progress bar and the monitor."""

import math
import re
from typing import Any

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


@pytest.fixture(scope="module")
def shown() -> list[dict[str, Any]]:
    """One world of 2 ranks for every strategy's byte report (DiLoCo, WeightGrad on 2 sites and on one, a preset
    with a dense warm-up)."""
    return run_ranks(shown_bytes, 2)


def _is_the_runs_mean(run: dict[str, Any]) -> None:
    """``bytes_per_step()`` after every step is an int: every step's ``last_step_bytes()`` so far, summed, over the
    steps (floored); the monitor logs both, and ``comp_ratio`` is fp32 DDP's bytes over the mean."""
    lasts, means = run["lasts"], run["means"]
    assert all(isinstance(m, int) and isinstance(n, int) for m, n in zip(means, lasts)), run
    assert means == [sum(lasts[: i + 1]) // (i + 1) for i in range(len(lasts))], run
    assert run["bytes"] == means[-1] and run["last"] == lasts[-1], run
    logged = run["logged"]
    assert [m["gradcomp/bytes/total"] for m in logged] == means, logged
    assert [m["gradcomp/last_step_bytes/total"] for m in logged] == lasts, logged
    if run["bytes"]:
        assert math.isclose(run["comp_ratio"], run["dense"] / run["bytes"], rel_tol=1e-6), run
        assert run["logged_ratio"] == pytest.approx(run["dense"] / run["bytes"])


def test_progress_bar_and_monitor_show_each_strategys_own_bytes_per_step(shown: list[dict[str, Any]]) -> None:
    for run in shown[0]["sites"]:  # DiLoCo, WeightGrad: rank 0 logs
        assert run["bytes"] and run["dense"], run  # each strategy answers, and something crossed
        _is_the_runs_mean(run)
        # rounds every 2 steps: the latest step (a round's) is not the run's mean
        assert run["lasts"][1] > 0 and run["means"][1] != run["lasts"][1], run
        # the per-step hook inside a site is not what crosses between sites: the two answers differ
        assert run["bytes"] != run["hook_bytes"]


def test_weightgrad_on_one_site_reports_nothing_between_sites_and_its_setup_line_says_so(
    shown: list[dict[str, Any]],
) -> None:
    run = shown[0]["one_site"]
    # nothing crosses between sites: 0, every step, in the strategy, the monitor and no comp_ratio
    assert run["means"] == run["lasts"] == [0, 0, 0], run
    _is_the_runs_mean(run)
    assert math.isnan(run["comp_ratio"]), run
    (line,) = [line for line in run["lines"] if line.startswith("gradcomp: TernGrad in each site of 2 ranks")]
    expected = re.search(r"; expected ([\d,]+) bytes per rank inside the site \(the monitor's lan_bytes; "
                         r"bytes_per_step\(\) counts what crosses between sites\) per step", line)
    assert expected, line
    # the in-site figure is the hook's, every step, as the monitor's lan_bytes shows it
    lan = [m["gradcomp/weightgrad/lan_bytes"] for m in run["logged"]]
    assert lan == [_number(expected.group(1))] * 3 == [run["hook_bytes"]] * 3, (lan, line)
    assert run["weightgrad_lines"] == [
        "weightgrad: one site: nothing crosses between sites, so bytes_per_step() is 0; the in-site exchange's bytes "
        "are the monitor's lan_bytes"
    ]


def test_a_dense_warm_up_counts_in_the_mean_and_the_first_step_line_says_it_is_dense(
    shown: list[dict[str, Any]],
) -> None:
    run = shown[0]["warm_up"]
    _is_the_runs_mean(run)
    dense = run["dense"]
    # 2 dense steps (fp32, as DDP), then 2 compressed: the mean falls as compressed steps come
    assert run["lasts"][:2] == [dense, dense] and 0 < run["lasts"][2] < dense, run
    assert run["means"][-1] == (2 * dense + run["lasts"][2] + run["lasts"][3]) // 4 < dense
    said = [line for line in run["lines"] if line.startswith("gradcomp: step ")]
    assert said == [
        f"gradcomp: step 1 is a dense warm-up step: {dense:,} bytes per rank in fp32, as DDP; the first compressed "
        f"step's bytes follow it; bytes_per_step() and comp_ratio average over the run, warm-up included",
        f"gradcomp: step 3 (the first compressed) sent {run['lasts'][2]:,} bytes per rank vs {dense:,} for fp32 DDP "
        f"({dense / run['lasts'][2]:.1f}x less), measured; bytes_per_step() and the progress bar's comp_ratio average "
        f"over the run so far, warm-up included",
    ], run["lines"]
