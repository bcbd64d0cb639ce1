"""Top-k's and DGC's Triton kernels (lightning_gradcomp/kernels/triton_topk.py, with triton_compact: the CUDA path of a
group) against the torch ops they replace, bit for bit, without a GPU.

The cases run in Triton's interpreter in one subprocess (``tests/triton_interpreter.py``); a second subprocess
compiles every kernel for a Hopper GPU (sm_90): that they compile for CUDA, with no fused multiply-add.
"""

import json
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest
import torch

from gradcomp_lab.opcount import count_ops
from lightning_gradcomp.compressors import DGC, TopK
from lightning_gradcomp.flat import FlatPacket, Segments
from tests.triton_interpreter import compile_for_hopper, hopper_job, interpreter_test, needs_triton

CPU = torch.device("cpu")
#: mixed sizes: empty, one-element, 1-D (dense unless dense_1d=False), layers over one tile (1024 elements)
SHAPES = [(40, 30), (1,), (0, 4), (7,), (50, 60), (1, 1), (2500,), (2, 3, 4), (3, 700)]

COMPRESSORS: dict[str, Callable[[], TopK]] = {
    "topk": lambda: TopK(0.01),
    "topk-fp16": lambda: TopK(0.05, value_dtype="fp16"),
    "topk-sparse-1d": lambda: TopK(0.2, dense_1d=False),
    "topk-all": lambda: TopK(1.0, dense_1d=False),
    "topk-int2": lambda: TopK(0.03, value_dtype="int2", dense_1d=False),  # the kernels select, torch ops code
    "dgc-int2": lambda: DGC(0.02, value_dtype="int2", dense_1d=False),  # the kernels select, torch ops code
    "dgc": lambda: DGC(0.01),
    "dgc-fp16-sparse-1d": lambda: DGC(0.02, value_dtype="fp16", dense_1d=False),
    "dgc-no-adaptation": lambda: DGC(0.05, max_adaptation_iters=0),
}


def _segments(shapes: Sequence[tuple[int, ...]] = SHAPES) -> Segments:
    return Segments([f"layer{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _ranks(make: Callable[[], TopK], ranks: int, triton: bool, device: torch.device = CPU) -> list[TopK]:
    comps = [make() for _ in range(ranks)]
    for r, c in enumerate(comps):
        c.selection = "batched"  # the torch ops a GPU runs without Triton
        c.triton = triton  # an option: read when setup chooses the kernels
        c.setup(r, ranks, device)
    return comps


def _gradient(total: int, step: int, rank: int, special: bool) -> torch.Tensor:
    """Values on a coarse grid (many ties at every layer's k-th largest, across tiles), -0.0s, every second step
    mostly zeros (DGC's sample misses the few large values: an exact top-k follows, or the threshold adapts), and
    with ``special`` NaN and +-inf (a descending sort puts NaN first)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = (torch.randn(total, generator=gen) * 2).round() / 4
    x[torch.rand(total, generator=gen) < 0.05] = -0.0
    if step % 2:
        x = x * (torch.rand(total, generator=gen) < 0.02)
    if special and total > 2000:
        x[[5, 1300, 1301, 1900]] = torch.tensor([float("nan"), -float("inf"), float("nan"), float("inf")])
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.contiguous().view(torch.int16)


def _step(
    comps: list[TopK], seg: Segments, step: int, special: bool, device: torch.device
) -> tuple[list[FlatPacket], list[Any], Any]:
    packets, sent = [], []
    for r, c in enumerate(comps):
        x = _gradient(seg.total, step, r, special).to(device)
        packet = c.compress_flat(x, seg)
        packets.append(packet)
        sent.append(_bits(c.sent_flat(x, packet)))
    out = torch.empty(seg.total, device=device)
    comps[0].decompress_flat_mean_into(packets, out)
    return packets, sent, _bits(out)


def _case_group(
    name: str, ranks: int, shapes: Sequence[tuple[int, ...]] = SHAPES, special: bool = False, device: torch.device = CPU
) -> None:
    """Two steps of ``ranks`` ranks: payload bytes, per-layer sizes, stats, sent and the ranks' mean equal the
    torch ops' bit for bit."""
    seg = _segments(shapes)
    reference, kernels = _ranks(COMPRESSORS[name], ranks, False, device), _ranks(COMPRESSORS[name], ranks, True, device)
    for step in range(2):
        want, got = _step(reference, seg, step, special, device), _step(kernels, seg, step, special, device)
        for a, b in zip(want[0], got[0]):
            assert torch.equal(a.payload, b.payload), step
            sizes = [s.tolist() if isinstance(s, torch.Tensor) else s for s in (a.layer_nbytes, b.layer_nbytes)]
            assert sizes[0] == sizes[1]
            assert a.stats.keys() == b.stats.keys() and all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)
        assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
        assert torch.equal(want[2], got[2])
    assert all(c.kernels(CPU).name == "triton" for c in kernels)
    assert not any(c.kernels(CPU).name == "triton" for c in reference)


def _case_fp16_out() -> None:
    """The mean into an fp16 gradient (the conversion inside the scatter) as the torch ops round it."""
    seg = _segments()
    results = []
    for triton in (False, True):
        comps = _ranks(COMPRESSORS["topk"], 3, triton)
        packets = [c.compress_flat(_gradient(seg.total, 0, r, False).half(), seg) for r, c in enumerate(comps)]
        out = torch.empty(seg.total, dtype=torch.float16)
        results.append(comps[0].decompress_flat_mean_into(packets, out).view(torch.int16))
        results.append(comps[0].sent_flat(torch.empty(0), packets[1]).view(torch.int16))
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])


def _case_selection() -> None:
    """The selection alone, on one layer of ties spanning three tiles: the first ``remaining`` ties by position."""
    from lightning_gradcomp.kernels import triton_topk

    x = torch.ones(3000)
    x[::7] = 2.0
    tables = triton_topk.SelectTables([3000], [1000], CPU)
    mask = triton_topk.select(x, tables).bool()
    above = x == 2.0
    ties = torch.nonzero(~above).reshape(-1)[: 1000 - int(above.sum())]
    want = above.clone()
    want[ties] = True
    assert torch.equal(mask, want)


def _step_ops(name: str, layers: int) -> tuple[int, int, int]:
    seg = _segments([(5, 3) if i % 3 else (4,) for i in range(layers)])
    comps = _ranks(COMPRESSORS[name], 2, True)
    x = torch.randn(seg.total, generator=torch.Generator().manual_seed(layers))

    def step() -> None:
        packets = [c.compress_flat(x, seg) for c in comps]
        comps[0].sent_flat(x, packets[0])
        comps[0].decompress_flat_mean_into(packets, torch.empty(seg.total))

    step()  # layouts and tables are built once per group
    with count_ops() as counted:
        step()
    return counted.total, counted.host_reads, counted.data_dependent


def _case_op_counts(name: str, compress_launches: int, reads: int) -> None:
    """A step of 2 ranks (compress each, sent, the mean) dispatches the same aten ops and launches for 4 and 16
    layers; top-k reads nothing on the host, DGC one number per compress (its selected count, which torch.nonzero
    reads too). Launches per compress: top-k's 4 radix passes and choices, ties, mark, compaction's count and write;
    DGC's level histogram besides; 2 scatters for sent and 2 per rank for the mean."""
    from torch.utils._python_dispatch import _disable_current_modes

    from lightning_gradcomp.kernels import triton_compact, triton_topk

    launches = 0
    originals = (triton_topk.launch, triton_compact.launch)

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal launches
        launches += 1
        with _disable_current_modes():  # what a GPU would run as one kernel
            originals[0](*args, **kwargs)

    triton_topk.launch = triton_compact.launch = counted
    try:
        small, large = _step_ops(name, 4), _step_ops(name, 16)
    finally:
        triton_topk.launch, triton_compact.launch = originals
    assert small == large and small[1:] == (reads, 0), (small, large)
    # two calls of _step_ops, each a warm-up step and a counted one
    assert launches == 2 * 2 * (2 * compress_launches + 2 + 2 * 2), launches


def _case_choice() -> None:
    """Without forcing, the kernels run on CUDA only; the choice lasts until setup."""
    comp = TopK(0.1)
    comp.setup(0, 1, CPU)
    assert comp.kernels(torch.device("cpu")).name != "triton"
    comp.triton = True
    assert comp.kernels(torch.device("cpu")).name != "triton"  # chosen once
    comp.setup(0, 1, CPU)
    assert comp.kernels(torch.device("cpu")).name == "triton"


#: (compressor, ranks) of the group cases (the interpreter is slow: 3 ranks where the mean's rank order matters)
RUNS = [("topk", 1), ("topk", 3), ("topk-fp16", 3), ("topk-sparse-1d", 3), ("topk-all", 1), ("topk-int2", 3),
        ("dgc", 1), ("dgc", 3), ("dgc-fp16-sparse-1d", 3), ("dgc-no-adaptation", 1), ("dgc-int2", 2)]

CASES: dict[str, Callable[[], None]] = {
    **{f"{name}-{r}-rank": partial(_case_group, name, r) for name, r in RUNS},
    "topk-nan-inf": lambda: _case_group("topk-sparse-1d", 3, special=True),
    "dgc-nan-inf": lambda: _case_group("dgc-fp16-sparse-1d", 3, special=True),
    "topk-tiny": lambda: _case_group("topk-sparse-1d", 3, [(0,), (1,), (0,), (3,)]),
    "topk-all-empty": lambda: _case_group("topk", 2, [(0,), (0, 3)]),
    "dgc-all-empty": lambda: _case_group("dgc", 2, [(0,), (0, 3)]),
    "dgc-tiny": lambda: _case_group("dgc-fp16-sparse-1d", 2, [(0,), (1,), (0,), (3,)]),
    "fp16-out": _case_fp16_out,
    "selection-ties": _case_selection,
    "op-counts-topk": lambda: _case_op_counts("topk", 12, 0),
    "op-counts-dgc": lambda: _case_op_counts("dgc", 13, 2),
    "choice": _case_choice,
}


test_triton_kernels_match_the_torch_ops_in_the_interpreter = interpreter_test(__name__, CASES)


# -- on a GPU, when there is one ---------------------------------------------------------------------------------
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run on a GPU: the CUDA torch ops' results)")
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_triton_kernels_match_the_torch_ops_on_cuda(name: str) -> None:
    _case_group(name, 3, special=True, device=torch.device("cuda"))


# -- compiled for a GPU, without one ------------------------------------------------------------------------------
def _compile_all() -> None:
    from lightning_gradcomp.kernels import _triton_topk_jit as jit

    common = {"bits_ptr": "*i32", "tiles_ptr": "*i64", "meta_ptr": "*i64", "state_ptr": "*i64"}
    variants: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {
        **{f"histogram-{p}-{nan}": (jit.histogram_kernel, {**common, "hist_ptr": "*i32", "layers": "i64"},
                                    {"PASS": p, "NAN_FIRST": nan, "BLOCK": 1024})
           for p in range(4) for nan in (True, False)},
        **{f"choose-{p}": (jit.choose_kernel, {"hist_ptr": "*i32", "k_ptr": "*i64", "state_ptr": "*i64",
                                               "layers": "i64"}, {"PASS": p, "ROWS": 16}) for p in range(4)},
        **{f"ties-{b}": (jit.ties_kernel, {**common, "bounds_ptr": "*fp32", "ties_ptr": "*i64"},
                         {"NAN_FIRST": not b, "BOUNDS": b, "BLOCK": 1024}) for b in (True, False)},
        **{f"mark-{b}": (jit.mark_kernel, {**common, "bounds_ptr": "*fp32", "before_ptr": "*i64", "mask_ptr": "*u8"},
                         {"NAN_FIRST": not b, "BOUNDS": b, "BLOCK": 1024}) for b in (True, False)},
        "levels": (jit.levels_kernel, {"bits_ptr": "*i32", "tiles_ptr": "*i64", "meta_ptr": "*i64",
                                       "thresholds_ptr": "*fp32", "steps": "i64", "hist_ptr": "*i32"},
                   {"WIDTH": 16, "BLOCK": 1024}),
    }
    print(json.dumps(compile_for_hopper(variants)))


_compiled = hopper_job(__name__)


@needs_triton
def test_kernels_compile_for_a_hopper_gpu() -> None:
    report, _ = _compiled()
    assert len(report) == 17
    for name, counts in report.items():
        assert counts["cubin"] > 0, name
        assert counts["fma."] == counts["div.full"] == counts["div.approx"] == counts["rcp.approx"] == 0, (name, counts)
