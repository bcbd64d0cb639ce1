"""Running the library's Triton kernels in CI, without a GPU.

Kernels run in Triton's interpreter on CPU tensors, which needs ``TRITON_INTERPRET=1`` set before Triton is
imported: so a test module's cases run in one subprocess (:func:`interpreter_test`, whose child calls
:func:`run_cases`) that reports each case's outcome as JSON, and the tests of this process only read the report
(neither the variable nor Triton leaks into other tests). :func:`compile_for_hopper` compiles kernels for an sm_90
GPU with Triton's real code generator (no GPU needed), for what the interpreter cannot show: that they compile for
CUDA, and which rounding instructions they hold.

Every such subprocess is a *job* registered when its test module is imported (collection) and started, all of them,
at the first test that needs one, two at a time (each is one thread; CI has 2 cores, and the Triton tests' modules
run one after another, so the jobs overlap only each other): a test then waits for its own job's report.
"""

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
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
    _index_scalars_as_numpy_2_4_requires()
    report = {}
    for name, case in cases.items():
        try:
            case()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()
    print(json.dumps(report))


def _index_scalars_as_numpy_2_4_requires() -> None:
    """Triton 3.6's interpreter converts a scalar argument used as an index (``range(ranks)``) with ``int()`` of a
    one-element array, which NumPy 2.4 refuses; Triton's fix (triton-lang/triton#9172) squeezes the array first.
    Applied here only where the installed interpreter still has the old conversion; compiled kernels are unaffected."""
    import inspect

    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if "int(self.handle.data)" not in inspect.getsource(patch):
        return

    def patched(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


#: key -> (code, environment) of every registered job; key -> its report, once started
_JOBS: dict[str, tuple[str, dict[str, str]]] = {}
_STARTED: dict[str, "Future[dict[str, Any]]"] = {}
_POOL = ThreadPoolExecutor(max_workers=2)


def register_job(key: str, code: str, env: Mapping[str, str]) -> Callable[[], dict[str, Any]]:
    """Register ``run_subprocess(code, env)`` under ``key``; returns the function that waits for its report (the
    first such call of the session starts every registered job)."""
    _JOBS[key] = (code, dict(env))

    def report() -> dict[str, Any]:
        # alone, the first job needed starts them all (two at a time, beside the tests in this process); under
        # pytest-xdist a worker starts only the jobs of the module it runs, so that no job runs in two workers
        module = key.split(":")[0]
        wanted = [k for k in _JOBS if k.split(":")[0] == module] if os.environ.get("PYTEST_XDIST_WORKER") else list(_JOBS)
        for name in wanted:
            if name not in _STARTED:
                _STARTED[name] = _POOL.submit(run_subprocess, *_JOBS[name])
        return _STARTED[key].result()

    return report


def hopper_job(module: str, function: str = "_compile_all") -> Callable[[], tuple[dict[str, Any], Path]]:
    """Register the job that calls ``module.function()`` (which prints :func:`compile_for_hopper`'s report) with a
    Triton cache of its own; returns the function that waits for (the report, that cache directory)."""
    cache = Path(tempfile.mkdtemp(prefix="gradcomp-triton-cache-"))
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    report = register_job(f"{module}:{function}", f"from {module} import {function}; {function}()",
                          {"TRITON_CACHE_DIR": str(cache)})
    return lambda: (report(), cache)


def interpreter_test(module: str, cases: Mapping[str, Callable[[], None]], name: str = "CASES") -> Callable[[str], None]:
    """A test parametrized over ``cases`` (``module``'s mapping called ``name``), each passing when its case ran "ok"
    in the interpreter: the whole mapping runs once, in one subprocess (a job). Bind it to a ``test_*`` name in the
    test module: ``test_kernels_... = interpreter_test(__name__, CASES)``."""
    code = f"from tests.triton_interpreter import run_cases; from {module} import {name}; run_cases({name})"
    interpreted = register_job(f"{module}:{name}", code, {"TRITON_INTERPRET": "1"})

    @needs_triton
    @pytest.mark.parametrize("case", sorted(cases))
    def test(case: str) -> None:
        report = interpreted()
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
