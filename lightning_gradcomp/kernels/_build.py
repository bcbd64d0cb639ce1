"""Compile the CPU kernels on first use and remember whether that worked.

The C++ lives in ``csrc/`` beside this module (package data): ``common.h`` and one source per kernel family,
compiled together as one translation unit so the helpers in ``common.h`` inline as they would in one file. The
extension is built with ``torch.utils.cpp_extension.load_inline`` into torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), which caches it across processes: only the
first import on a machine pays the compile time, and concurrent ranks wait on torch's build lock instead of
compiling twice. Set ``LIGHTNING_GRADCOMP_NO_EXT=1`` to skip it and use the torch-ops fallback.
"""

import functools
import hashlib
import logging
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

#: the C++ sources, shipped as package data (pyproject.toml's ``[tool.setuptools.package-data]``)
SOURCE_DIR = Path(__file__).parent / "csrc"
_HEADERS = ("common.h",)
_SOURCES = ("terngrad.cpp", "selection.cpp", "binwords.cpp")
#: the functions the extension exposes to Python
FUNCTIONS = [
    "terngrad_stats",
    "terngrad_scale_clip",
    "terngrad_ternarize_pack",
    "terngrad_ternarize_int8",
    "terngrad_decode",
    "terngrad_decode_sum",
    "terngrad_scale_clip_flat",
    "terngrad_ternarize_flat",
    "terngrad_decode_sum_flat",
    "terngrad_scale_int8_flat",
    "sample_abs",
    "kth_smallest",
    "select_above",
    "bin_absmax",
    "adacomp_select",
    "sparse_decode_sum",
    "bin_words_encode",
    "bin_words_decode_sum",
    "graddrop_group_sample",
    "graddrop_group_kth",
    "graddrop_group_select",
    "adacomp_group_encode",
    "adacomp_group_decode_sum",
    "counter_uniform_flat",
]
_CFLAGS = ["-O3", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

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


@functools.lru_cache(maxsize=1)
def _source_texts() -> tuple[str, ...]:
    return tuple((SOURCE_DIR / name).read_text() for name in (*_HEADERS, *_SOURCES))


def cpu_source() -> str:
    """The full C++ source (the header, then each source file): what the extension's name hashes."""
    return "\n".join(_source_texts())


def translation_unit() -> str:
    """The one translation unit compiled: the header's text in place of each ``#include "common.h"``.

    Handed to ``load_inline`` as text, not as files on an include path: ninja would then track the header's
    modification time, and a fresh checkout of the same source (same extension name, newer files) would silently
    recompile inside the first training step, past the compile notice.
    """
    texts = _source_texts()
    headers, sources = texts[: len(_HEADERS)], texts[len(_HEADERS) :]
    for name in _HEADERS:
        sources = tuple(text.replace(f'#include "{name}"', f"// {name}: above") for text in sources)
    return "\n".join((*headers, *sources))


def build_directory() -> Optional[str]:
    """Where torch builds and caches the extension (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private, but the directory load_inline uses

        return _get_build_directory(current_extension_name(), verbose=False)
    except Exception:  # another torch layout: no notice is better than a wrong one
        return None


def is_compiled() -> bool:
    """Whether this source's build is already in torch's extension cache (loading it then takes about 0.1 s)."""
    directory = build_directory()
    return directory is not None and os.path.exists(os.path.join(directory, f"{current_extension_name()}.so"))


def build_inputs() -> list[str]:
    """Everything besides the source that changes the binary: torch and Python versions, the compiler, flags, and
    the include and library paths torch writes into its ninja file.

    The paths matter most: two virtual environments with the same torch have different ones, so with one shared
    name each environment's ninja file would replace the other's and every first use would recompile (30-65 s).
    """
    from torch import __version__ as torch_version
    from torch.utils.cpp_extension import include_paths, library_paths

    return [
        torch_version,
        sys.version,
        sysconfig.get_paths()["include"],
        os.environ.get("CXX", "c++"),
        *include_paths(),
        *library_paths(),
        *_CFLAGS,
        *_LDFLAGS,
    ]


def extension_name(source: str, inputs: Sequence[str]) -> str:
    """The extension's name, a hash of the source and the build inputs: each distinct build keeps its own cache
    entry in the shared extension directory (branches, worktrees, venvs, torch versions)."""
    digest = hashlib.sha256()
    for part in (source, *inputs):
        digest.update(part.encode())
        digest.update(b"\0")  # ("ab", "c") and ("a", "bc") must not collide
    return "lightning_gradcomp_kernels_cpu_" + digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def current_extension_name() -> str:
    """This environment's extension name (:func:`extension_name` of the source and :func:`build_inputs`)."""
    return extension_name(cpu_source(), build_inputs())


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
                    name=current_extension_name(),
                    cpp_sources=[translation_unit()],
                    functions=FUNCTIONS,
                    # -O3 auto-vectorises; target_clones in the source picks AVX-512/AVX2/baseline at run time,
                    # so no -march=native: the build stays valid on any x86-64 machine sharing the cache
                    extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS,
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


def extension_for(*tensors: "Tensor") -> Optional[ModuleType]:
    """The compiled CPU kernels when every tensor is on the CPU and they are available here, else ``None``."""
    return cpu_extension() if all(t.device.type == "cpu" for t in tensors) else None
