"""The pieces of ``benchmarks/gpu_session.sh`` a CPU can check: the single-layer kernel group, the profiler's per-step
counts of ``benchmarks/hook_overhead.py --trace``, and the script's shell syntax."""

import gzip
import json
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import hook_overhead, kernels

ROOT = Path(__file__).resolve().parents[2]


def test_a_group_of_one_layer_holds_every_element() -> None:
    # GPT-2's embedding as one group: the per-layer statistics of a single large segment
    assert kernels.group_shapes(38597376, layers=1) == [(38597376,)]
    mixed = kernels.group_shapes(2**20)
    assert len(mixed) == 64 and sum(n for (n,) in mixed) == 2**20


def test_trace_counts_ops_and_host_reads_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.arange(6.0)

    def step() -> None:
        (x * 2).sum().item()  # mul, sum, and one host read

    counts = hook_overhead._trace("tiny", step, torch.device("cpu"), tmp_path, record=True)
    assert counts["host reads"] == 1 and counts["aten ops"] >= 3  # per step, over TRACE_STEPS steps
    assert counts["launches"] == counts["syncs"] == 0  # no GPU
    with gzip.open(tmp_path / "trace_tiny.json.gz") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert "aten::_local_scalar_dense" in names
    assert hook_overhead._trace("tiny", step, torch.device("cpu"), tmp_path / "other", record=False) == {}
    hook_overhead.print_traces({"ddp": counts, "tiny": {**counts, "aten ops": counts["aten ops"] + 5}}, "ddp",
                               2**20, "cpu")
    out = capsys.readouterr().out
    assert "| variant | aten ops | host reads | aten ops beyond ddp |" in out and "| tiny |" in out and "| +5 |" in out


def test_the_session_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu_session.sh")], check=True)
