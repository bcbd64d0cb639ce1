"""benchmarks/ratio_summary.py: per-run ratios from step_time.py's JSON, and their median over runs."""

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ratio_summary.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ratio_summary", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_json(path: Path, ddp: float, bf16: float, terngrad: float) -> Path:
    results = [{"model": "mlp", "strategy": s, "median_s": t} for s, t in (("ddp", ddp), ("ddp_bf16", bf16), ("terngrad", terngrad))]
    path.write_text(json.dumps({"runs": [{"nproc": 4, "link": "1gbit", "results": results}]}))
    return path


def test_ratios_are_per_run_and_summarised_by_their_median(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    summary = _load()
    a = _run_json(tmp_path / "a.json", 2.0, 1.5, 0.6)
    b = _run_json(tmp_path / "b.json", 2.4, 1.2, 0.72)
    c = _run_json(tmp_path / "c.json", 2.0, 1.6, 0.8)
    assert summary.ratios(a, "terngrad", ["ddp", "ddp_bf16"])[4, "1gbit", "mlp"] == pytest.approx(
        {"step_s": 0.6, "ddp": 0.3, "ddp_bf16": 0.4})
    summary.main([str(a), str(b), str(c)])
    out = capsys.readouterr().out
    # per-run ratios 0.3, 0.3, 0.4 over DDP and 0.4, 0.6, 0.5 over bf16: medians of the ratios, not of the steps
    assert "terngrad / ddp: median 0.300 (min 0.300, max 0.400)" in out
    assert "terngrad / ddp_bf16: median 0.500 (min 0.400, max 0.600)" in out
