"""Compression is visible on a first run: one setup line, the ratio in the progress bar, no extra warnings."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _first_run(strategy: str) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "integration" / "first_run.py"), strategy],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict, str]]:
    return {name: _first_run(name) for name in ("ddp", "terngrad")}


def test_setup_line_names_compressor_collectives_and_bytes_against_fp32(runs: dict[str, tuple[dict, str]]) -> None:
    _, stderr = runs["terngrad"]
    lines = [line for line in stderr.splitlines() if line.startswith("gradcomp: ")]
    assert len(lines) == 1, stderr[-3000:]
    match = re.fullmatch(
        r"gradcomp: TernGrad on 2 ranks: all-gather of each rank's packed payload after one small all-reduce of shared "
        r"scalers; expected ([\d,]+) bytes per rank per step vs ([\d,]+) for fp32 DDP \(([\d.]+)x less\)",
        lines[0],
    )
    assert match, lines[0]
    expected, dense = (int(g.replace(",", "")) for g in match.groups()[:2])
    assert dense == 4 * (20 * 64 + 64 + 64 * 64 + 64 + 64 * 5 + 5)  # TinyClassifier's parameters in fp32
    assert dense / 20 < expected < dense / 10  # 2-bit codes and a scaler per tensor: about 16x less


def test_compression_ratio_in_the_progress_bar_without_a_logger(runs: dict[str, tuple[dict, str]]) -> None:
    assert "comp_ratio" in runs["terngrad"][0]["progress_bar"]
    assert 10 < runs["terngrad"][0]["progress_bar"]["comp_ratio"] < 20
    assert "comp_ratio" not in runs["ddp"][0]["progress_bar"]


def test_no_warning_that_stock_ddp_does_not_print(runs: dict[str, tuple[dict, str]]) -> None:
    ours, theirs = set(runs["terngrad"][0]["warnings"]), set(runs["ddp"][0]["warnings"])
    assert ours <= theirs, ours - theirs
    assert "broadcast_buffers" not in runs["terngrad"][1]
