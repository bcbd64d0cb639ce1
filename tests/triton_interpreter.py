"""Running the library's Triton kernels in CI, without a GPU.

Kernels run in Triton's interpreter on CPU tensors, which needs ``TRITON_INTERPRET=1`` set before Triton is
imported: so a test module's cases run in one subprocess (:func:`interpret`, whose child calls :func:`run_cases`)
that reports each case's outcome as JSON, and the tests of this process only read the report (neither the
variable nor Triton leaks into other tests). :func:`compile_for_hopper` compiles kernels for an sm_90 GPU with
Triton's real code generator (no GPU needed), for what the interpreter cannot show: that they compile for CUDA,
and which rounding instructions they hold.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[triton]')"
)

#: PTX instructions that decide how a kernel rounds: fused multiply-add, correctly rounded and approximate division
ROUNDING_OPS = ("fma.", "div.rn.f32", "div.full", "div.approx", "rcp.approx")


def run_subprocess(code: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter at the repository root with ``env`` added; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def run_cases(cases: Mapping[str, Callable[[], None]]) -> None:
    """Run every case (in the subprocess, under ``TRITON_INTERPRET=1``); print one JSON line: case -> "ok" or the
    traceback."""
    assert os.environ.get("TRITON_INTERPRET") == "1"  # read at each launch (torch may have imported Triton already)
    report = {}
    for name, case in cases.items():
        try:
            case()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()
    print(json.dumps(report))


def interpret(module: str, cases: str = "CASES") -> dict[str, Any]:
    """The report of ``module``'s mapping ``cases`` run in the interpreter, in a subprocess."""
    code = f"from tests.triton_interpreter import run_cases; from {module} import {cases}; run_cases({cases})"
    return run_subprocess(code, {"TRITON_INTERPRET": "1"})


@functools.cache
def _report(module: str, cases: str) -> dict[str, Any]:
    return interpret(module, cases)


def interpreter_test(module: str, cases: Mapping[str, Callable[[], None]], name: str = "CASES") -> Callable[[str], None]:
    """A test parametrized over ``cases`` (``module``'s mapping called ``name``), each passing when its case ran "ok"
    in the interpreter: the whole mapping runs once, in one subprocess, at the first case. Bind it to a ``test_*``
    name in the test module: ``test_kernels_... = interpreter_test(__name__, CASES)``."""

    @needs_triton
    @pytest.mark.parametrize("case", sorted(cases))
    def test(case: str) -> None:
        report = _report(module, name)
        assert report[case] == "ok", report[case]

    return test


def compile_for_hopper(
    variants: Mapping[str, tuple[Any, Mapping[str, str], Mapping[str, Any]]], cache_dir: Optional[Path] = None
) -> dict[str, dict[str, int]]:
    """Compile each ``name -> (kernel, signature, constexprs)`` for sm_90 (in this process: call it from a subprocess
    without ``TRITON_INTERPRET``); per variant, the counts of :data:`ROUNDING_OPS` in its PTX and its cubin's size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    report = {}
    for name, (fn, signature, constants) in variants.items():
        source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constants}}, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        report[name] = {op: ptx.count(op) for op in ROUNDING_OPS}
        report[name]["cubin"] = len(compiled.asm["cubin"])
    return report
