"""Compile the CPU kernels on first use and remember whether that worked.

The extension is built with ``torch.utils.cpp_extension.load_inline`` into torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), which caches it across processes: only the
first import on a machine pays the compile time, and concurrent ranks wait on torch's build lock instead of
compiling twice. Set ``LIGHTNING_GRADCOMP_NO_EXT=1`` to skip it and use the torch-ops fallback.
"""

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Optional

from lightning_gradcomp.kernels._cpu_source import CPU_SOURCE, FUNCTIONS

log = logging.getLogger(__name__)

#: the name carries a hash of the source: checkouts with different kernels (branches, worktrees, versions) that
#: share one extension directory keep a build each, instead of rebuilding over one another on every start
EXTENSION_NAME = "lightning_gradcomp_kernels_cpu_" + hashlib.sha256(CPU_SOURCE.encode()).hexdigest()[:12]

_lock = threading.Lock()
_module: Optional[ModuleType] = None
_tried = False
#: seconds the first load took in this process (compile, or loading the cached build), None before it
load_seconds: Optional[float] = None
#: why the extension is unavailable, None when it loaded
unavailable_reason: Optional[str] = None
_forced_torch = threading.local()
#: what a first use prints before compiling; the duration is docs/kernels.md's (`python benchmarks/kernels.py`)
COMPILE_NOTICE = (
    "lightning_gradcomp: compiling the fused CPU kernels once (about 30 s on 2 idle cores, up to 100 s on a busy "
    "machine; cached in %s for every later run) ..."
)


def build_directory() -> Optional[str]:
    """Where torch builds and caches the extension (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private, but the directory load_inline uses

        return _get_build_directory(EXTENSION_NAME, verbose=False)
    except Exception:  # another torch layout: no notice is better than a wrong one
        return None


def is_compiled() -> bool:
    """Whether this source's build is already in torch's extension cache (loading it then takes about 0.1 s)."""
    directory = build_directory()
    return directory is not None and os.path.exists(os.path.join(directory, f"{EXTENSION_NAME}.so"))


@contextmanager
def torch_ops() -> Iterator[None]:
    """Within this block (this thread), every kernel takes its torch-ops path: for references and tests."""
    previous = getattr(_forced_torch, "on", False)
    _forced_torch.on = True
    try:
        yield
    finally:
        _forced_torch.on = previous


def cpu_extension() -> Optional[ModuleType]:
    """The compiled CPU kernels, or ``None`` (after one warning) when they cannot be built here."""
    global _module, _tried, load_seconds, unavailable_reason
    if getattr(_forced_torch, "on", False):
        return None
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get("LIGHTNING_GRADCOMP_NO_EXT", "") not in ("", "0"):
            unavailable_reason = "disabled by LIGHTNING_GRADCOMP_NO_EXT"
        else:
            start = time.perf_counter()
            compiling = not is_compiled()
            if compiling:  # a user must not mistake the one-time compile for a slow first step
                log.warning(COMPILE_NOTICE, build_directory())
            try:
                from torch.utils.cpp_extension import load_inline

                _module = load_inline(
                    name=EXTENSION_NAME,
                    cpp_sources=[CPU_SOURCE],
                    functions=FUNCTIONS,
                    # -O3 auto-vectorises; target_clones in the source picks AVX-512/AVX2/baseline at run time,
                    # so no -march=native: the build stays valid on any x86-64 machine sharing the cache
                    extra_cflags=["-O3", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
                load_seconds = time.perf_counter() - start
                if compiling:
                    log.warning("lightning_gradcomp: fused CPU kernels compiled in %.0f s", load_seconds)
            except Exception as err:  # no compiler, no ninja, no headers: fall back, never fail training
                unavailable_reason = f"{type(err).__name__}: {err}"
        _tried = True
        if _module is None:
            log.warning(
                "lightning_gradcomp: fused CPU kernels unavailable (%s); using the slower torch-ops path "
                "(same results).",
                unavailable_reason,
            )
        return _module
