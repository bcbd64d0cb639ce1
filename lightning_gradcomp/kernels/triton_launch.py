"""What every Triton kernel module of the library shares: whether Triton imports, tile tables, and the launch.

Triton is imported on first use (the library imports without it). Under ``TRITON_INTERPRET=1`` (set before Triton
is imported) kernels run on CPU tensors in Triton's interpreter: how CI compares them with the torch ops they
replace without a GPU (``tests/triton_interpreter.py``).
"""

import functools
import importlib
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor


@functools.cache
def available() -> bool:
    """Whether Triton imports here (tried once per process)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # not installed, or installed but failing to load (no matching libraries, say): torch ops run
        return False
    return True


@functools.cache
def bodies(module: str) -> ModuleType:
    """The ``@triton.jit`` bodies of ``lightning_gradcomp.kernels.<module>``, imported at their first launch: they import
    Triton at their top, and the library must import without it."""
    return importlib.import_module(f"lightning_gradcomp.kernels.{module}")


def usable(device: torch.device) -> bool:
    """Whether the library's Triton kernels run a group on ``device``: CUDA with Triton importable."""
    return device.type == "cuda" and available()


def tiles(lengths: Sequence[int], block: int) -> Tensor:
    """int64 ``[tiles, 2]``: (layer, start) of every ``block``-long tile of every layer of ``lengths`` (a grid over a
    group of layers of any sizes, one program per tile, with no per-element index tensor)."""
    rows = [(i, start) for i, n in enumerate(lengths) for start in range(0, n, block)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


def programs(n: int, block: int) -> int:
    """Programs of a grid that covers ``n`` elements ``block`` at a time."""
    return -(-n // block)


def launch(kernel: object, grid: int, *args: object, **constants: object) -> None:
    """Run ``kernel`` on ``grid`` programs (none when 0: an empty group has no tile, and Triton refuses an empty grid).

    Fused multiply-add is off: each product and sum rounds as the torch op it stands for, so the kernels match
    those ops bit for bit.
    """
    if grid:
        kernel[(grid,)](*args, **constants, enable_fp_fusion=False)  # type: ignore[index]


__all__ = ["available", "bodies", "launch", "programs", "tiles", "usable"]
