"""Gradient Dropping's Triton kernels (lightning_gradcomp/kernels/triton_graddrop.py, the CUDA path of a group) against
the torch ops they replace, bit for bit, without a GPU.

The cases run in Triton's interpreter in one subprocess (``tests/triton_interpreter.py``); a second subprocess
compiles every kernel for a Hopper GPU (sm_90) down to a cubin.
"""

import json
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

import pytest
import torch
from torch import Tensor

from lightning_gradcomp.compressors import GradientDropping
from lightning_gradcomp.flat import FlatPacket, Segments
from tests.triton_interpreter import compile_for_hopper, hopper_job, interpreter_test, needs_triton
from tests.unit.test_flat_graddrop import GRADDROP_CASES, LAYER_CASES, _gradient, _layout, _ops_per_step

CPU = torch.device("cpu")
#: groups of only empty layers, of one element, and of mixed tiny layers
TINY: dict[str, list[tuple[int, ...]]] = {"empty": [(0,)], "one": [(1,)], "mixed": [(0,), (3,), (0,), (1,)]}


def _ranks(kwargs: dict[str, Any], ranks: int, triton: bool, device: torch.device) -> list[GradientDropping]:
    """Fresh compressors of ``ranks`` ranks, their groups forced onto the Triton kernels (on CPU tensors: the
    interpreter) or onto the torch ops."""
    comps = []
    for rank in range(ranks):
        comp = GradientDropping(backend="torch", seed=7, **kwargs)
        comp.triton = triton  # an option: read when setup chooses the kernels
        comp.setup(rank, ranks, device)
        comps.append(comp)
    return comps


def _bits(t: "Tensor | tuple[int, ...]") -> Tensor:
    """A tensor's bytes, to compare floats bit for bit (the sign of a zero, NaN); host sizes as int64."""
    if isinstance(t, tuple):
        t = torch.tensor(t, dtype=torch.int64)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _gathered(packets: Sequence[FlatPacket]) -> list[FlatPacket]:
    """The packets as an all-gather leaves them: rows of one byte buffer, every other one at an odd byte offset (a
    group after another group's bytes), so the decoder reads some in place and copies the others."""
    longest = max(p.payload.numel() for p in packets)
    rows = packets[0].payload.new_zeros(len(packets), longest + 8)
    received = []
    for r, p in enumerate(packets):
        at = r % 2
        rows[r, at : at + p.payload.numel()] = p.payload
        received.append(p.with_payload(rows[r, at : at + p.payload.numel()], p.layer_nbytes))
    return received


def _exchange(comps: Sequence[GradientDropping], seg: Segments, grads: Sequence[Tensor]) -> dict[str, Any]:
    """One step of every rank: packets, sent, the mean of the gathered packets and of rank 0's alone."""
    packets = [c.compress_flat(g, seg) for c, g in zip(comps, grads)]
    out = torch.full((seg.total,), float("nan"), device=grads[0].device)
    alone = torch.full((seg.total,), float("nan"), device=grads[0].device)
    return {
        "payloads": [p.payload for p in packets],
        "nbytes": [p.layer_nbytes for p in packets],
        "stats": [p.stats for p in packets],
        "sent": [c.sent_flat(g, p) for c, g, p in zip(comps, grads, packets)],
        "decoded": comps[0].decompress_flat(packets[-1]),
        "mean": comps[0].decompress_flat_mean_into(_gathered(packets), out),
        "alone": comps[0].decompress_flat_mean_into(packets[:1], alone),  # world size 1
        "state": [c.state_dict() for c in comps],
    }


def _grad(seg: Segments, seed: int) -> Tensor:
    """A gradient with zeros and a layer of ties (test_flat_graddrop's) for its layout, else a random one."""
    if seg.shapes == _layout().shapes:
        return _gradient(seg, seed)
    return torch.randn(seg.total, generator=torch.Generator().manual_seed(seed))


def _same_bits_nan_as_nan(x: Tensor, y: Tensor) -> bool:
    """Bit for bit, but a NaN as a NaN: on CUDA the torch ops give ``0x7fffffff`` where the kernels give ``0x7fc00000``,
    both "NaN" to every reader (a layer holding a NaN has its step skipped by the guard on every rank)."""
    if not x.is_floating_point():
        return torch.equal(x, y)
    x_finite, y_finite = (torch.where(t.isnan(), torch.zeros_like(t), t) for t in (x, y))
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(_bits(x_finite), _bits(y_finite))


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Counters, the names seen and the global pool and threshold, bit for bit (a pool's NaN samples as NaNs)."""
    assert got["counters"] == want["counters"] and got["seen"] == want["seen"]
    assert got["pool"].keys() == want["pool"].keys()
    for name, (sample, weight) in got["pool"].items():
        assert _same_bits_nan_as_nan(sample, want["pool"][name][0]) and weight == want["pool"][name][1], name
    thresholds = got["global_threshold"], want["global_threshold"]
    assert thresholds == (None, None) or torch.equal(*map(_bits, thresholds))


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("payloads", "nbytes", "sent"):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got[key], want[key])), key
    for key in ("decoded", "mean", "alone"):
        assert torch.equal(_bits(got[key]), _bits(want[key])), key
    for a, b in zip(got["stats"], want["stats"]):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for k in a:  # a layer's NaN statistic carries no payload to agree on
            assert _same_bits_nan_as_nan(a[k], b[k]), (k, a[k], b[k])
    for a, b in zip(got["state"], want["state"]):
        _assert_same_state(a, b)


def _compare(
    kwargs: dict[str, Any], seg: Segments, steps: int, ranks: int = 3, device: torch.device = CPU,
    corrupt: Optional[Callable[[Tensor, Segments], None]] = None,
) -> None:
    """``steps`` steps of ``ranks`` ranks through the torch ops and through the Triton kernels: everything equal."""
    runs = []
    for triton in (False, True):
        comps = _ranks(kwargs, ranks, triton, device)
        records = []
        for step in range(steps):
            grads = [_grad(seg, 10 * r + step) for r in range(ranks)]
            if corrupt is not None:
                for g in grads:
                    corrupt(g, seg)
            records.append(_exchange(comps, seg, [g.to(device) for g in grads]))
        assert all((c.kernels(CPU).name == "triton") is triton for c in comps)  # the kernels ran, and only on one side
        runs.append(records)
    for want, got in zip(*runs):
        _assert_same(got, want)


# -- the cases, run in the interpreter subprocess ------------------------------------------------------------------
def _nonfinite(x: Tensor, seg: Segments, nan: bool = True) -> None:
    """inf here and there, values beyond fp16, -0.0; with ``nan`` NaN too, and a layer mostly NaN (its threshold
    NaN: it sends every value, -0.0 among them, kept as -0.0)."""
    x[6], x[seg.offsets[4] + 9] = float("inf"), float("-inf")
    x[seg.offsets[4] + 100 : seg.offsets[4] + 104] = torch.tensor([1e6, -7e4, 65504.0, 65520.0])
    x[seg.offsets[3] + 200 : seg.offsets[4]] = -0.0
    if nan:
        x[5] = float("nan")
        x[seg.offsets[3] : seg.offsets[3] + 200] = float("nan")


def _in_bf16(x: Tensor, seg: Segments) -> None:
    """Values bf16 represents. The interpreter converts float32 to bf16 by truncation where the GPU rounds to
    nearest even, as torch does (``cvt.rn.bf16.f32``, which the compile test finds), so the bf16 cases compare
    values whose conversion is exact; and no NaN, whose bf16 bits torch's CPU conversion chooses otherwise."""
    x.copy_(x.bfloat16().float())


def _nonfinite_bf16(x: Tensor, seg: Segments) -> None:
    _nonfinite(x, seg, nan=False)
    _in_bf16(x, seg)


def _tile_edges() -> None:
    """Layers of 1023, 1024 and 1025 elements and tiny ones between: layer tiles overlapping two compaction tiles,
    ties in a layer across tile edges."""
    seg = _layout([(1023,), (1,), (1024,), (2,), (1025,), (40, 3)])

    def ties(x: Tensor, s: Segments) -> None:
        x[s.offsets[2] : s.offsets[3]] = 0.5
        x[s.offsets[4] : s.offsets[4] + 700] = -0.5

    _compare({"drop_ratio": 0.7, "sample": "exact"}, seg, 1, corrupt=ties)


def _sample_positions() -> None:
    """The sample kernel against ``gather_samples`` on |x| = each element's position: the drawn positions
    themselves, for keys whose index + k0 wraps modulo 2**32."""
    from lightning_gradcomp.compressors.graddrop_group import gather_samples
    from lightning_gradcomp.compressors.graddrop_kernels import triton_tables
    from lightning_gradcomp.kernels import rng, triton_graddrop

    seg = _layout([(3000,), (1,), (0,), (2500,), (300,)])
    comp = GradientDropping(backend="torch", sample="random", sample_fraction=0.05, min_sample=40)
    plan = comp._sample_plan(seg, CPU)
    keys = [(2**32 - 5, 2**32 - 1), (0, 0), (0, 0), (123, 2**31), (2**32 - 1, 7)]
    table = torch.tensor([[(k0 - o) & rng.MASK32, k1] for (k0, k1), o in zip(keys, plan.draws.offsets)])
    bits = rng.hash_index(torch.arange(plan.draws.total), *plan.draws.expand(table).unbind(1))
    position = torch.arange(seg.total, dtype=torch.float32)
    tables = triton_tables(seg, plan, CPU)
    assert torch.equal(triton_graddrop.sample(position, tables, triton_graddrop.keys_on(keys, CPU)),
                       gather_samples(position, plan, bits))


def _op_counts(kwargs: dict[str, Any]) -> None:
    """A step (compress, sent, the mean of 3 ranks) dispatches the same aten ops for 8 and 32 layers, reads one
    number (the survivors' count, as ``nonzero``), and launches 9 kernels (sample, the two selection passes,
    compaction, statistics, the decode of ``sent``, one decode per rank); fewer aten ops than the torch ops. The interpreter's own
    tensor handling inside a launch is not counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    from lightning_gradcomp.kernels import triton_compact, triton_graddrop

    launches = 0
    launch = triton_graddrop.launch

    def counted(*args: Any, **kw: Any) -> None:
        nonlocal launches
        launches += 1
        with _disable_current_modes():  # what a GPU would run as one kernel
            launch(*args, **kw)

    def make(triton: bool) -> GradientDropping:
        comp = GradientDropping(backend="torch", **kwargs)
        comp.triton = triton
        return comp

    torch_ops = _ops_per_step(lambda: make(False), 8)
    triton_graddrop.launch = triton_compact.launch = counted
    try:
        few, many = _ops_per_step(lambda: make(True), 8), _ops_per_step(lambda: make(True), 32)
    finally:
        triton_graddrop.launch = triton_compact.launch = launch
    assert few == many and many[1:] == (1, 0), (few, many)
    per_step = 9 if kwargs.get("sample") == "random" else 8  # whole layers: |x| is the sample, no sample kernel
    assert launches == 2 * 3 * per_step  # two calls of _ops_per_step, each two warm-up steps and a counted one
    assert many[0] < torch_ops[0], (many, torch_ops)


def _choice() -> None:
    """Without forcing, the Triton kernels run on CUDA only; the choice is kept until ``setup``."""
    from lightning_gradcomp.kernels import triton_launch

    assert triton_launch.usable(torch.device("cuda")) and not triton_launch.usable(CPU)
    comp = GradientDropping(backend="torch")
    comp.setup(0, 2, CPU)
    seg = _layout()
    comp.compress_flat(_gradient(seg, 0), seg)
    assert comp.kernels(CPU).name == "torch"
    comp.triton = True  # read at the next setup
    comp.compress_flat(_gradient(seg, 1), seg)
    assert comp.kernels(CPU).name == "torch"
    comp.setup(0, 2, CPU)
    assert comp.kernels(CPU).name == "triton"


def _global_restart() -> None:
    """Global scope with groups that change between steps: the thresholds restart where the torch path restarts."""
    layers = [f"layer{i}.weight" for i in range(6)]
    shapes = {name: torch.Size(s) for name, s in zip(layers, [(30, 40), (1,), (0,), (2500,), (17,), (300,)])}
    steps = [[layers[:4], layers[4:]], [layers[5:], layers[:5]], [layers[2:4], layers[4:], layers[:2]]]
    kwargs = dict(scope="global", drop_ratio=0.95, min_sample=40, sample_fraction=0.05)
    (ref,), (fast,) = _ranks(kwargs, 1, False, CPU), _ranks(kwargs, 1, True, CPU)
    for step, groups in enumerate(steps):
        for names in groups:
            seg = Segments(names, [shapes[n] for n in names])
            x = torch.randn(seg.total, generator=torch.Generator().manual_seed(step)) * (1 + step)
            a, b = fast.compress_flat(x, seg), ref.compress_flat(x, seg)
            assert torch.equal(a.payload, b.payload) and torch.equal(a.stats["threshold"], b.stats["threshold"])
    _assert_same_state(fast.state_dict(), ref.state_dict())


INTERPRETED: dict[str, Callable[[], None]] = {
    **{f"exchange-{c}": partial(_compare, GRADDROP_CASES[c], _layout(), 2, corrupt=_in_bf16 if c == "bf16" else None)
       for c in GRADDROP_CASES},
    # the other wire forms: the thresholds in the kernels, each layer's own encoding with torch ops
    **{f"layers-{c}": partial(_compare, LAYER_CASES[c], _layout(), 2) for c in ("2bit-delta16-global", "delta16-fp16")},
    **{f"one-rank-{c}": partial(_compare, GRADDROP_CASES[c], _layout(), steps=1, ranks=1)
       for c in ("random", "fp16")},
    **{f"tiny-{name}": partial(_compare, GRADDROP_CASES["random"], _layout(s), steps=2) for name, s in TINY.items()},
    **{f"nonfinite-{c}": partial(_compare, GRADDROP_CASES[c], _layout(), steps=1, corrupt=_nonfinite)
       for c in ("exact", "fp16", "random", "global_exact")},
    "nonfinite-bf16": lambda: _compare(GRADDROP_CASES["bf16"], _layout(), steps=1, corrupt=_nonfinite_bf16),
    "tile-edges": _tile_edges,
    "sample-positions": _sample_positions,
    "global-restart": _global_restart,
    **{f"op-counts-{s}": partial(_op_counts, {"sample": s, "min_sample": 40, "values": "fp16"})
       for s in ("random", "exact")},
    "choice": _choice,
}


test_triton_kernels_match_the_torch_ops_in_the_interpreter = interpreter_test(__name__, INTERPRETED, "INTERPRETED")


# -- on a GPU, when there is one ---------------------------------------------------------------------------------
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run on a GPU: the CUDA torch ops' rounding)")
@pytest.mark.parametrize(
    "case", [*sorted(GRADDROP_CASES), "2bit-delta16-global", "delta16-fp16"]
)
def test_triton_kernels_match_the_torch_ops_on_cuda(case: str) -> None:
    kwargs = GRADDROP_CASES.get(case) or LAYER_CASES[case]
    _compare(kwargs, _layout(), steps=2, device=torch.device("cuda"))
    _compare(kwargs, _layout(), steps=1, device=torch.device("cuda"), corrupt=_nonfinite)


# -- compiled for a GPU, without one ------------------------------------------------------------------------------
def _compile_all() -> None:
    """Compile each kernel variant for sm_90 (in the subprocess, without ``TRITON_INTERPRET``); print, per variant,
    the counts of PTX instructions that decide the rounding."""
    from lightning_gradcomp.kernels import _triton_compact_jit as compact
    from lightning_gradcomp.kernels import _triton_graddrop_jit as jit

    tables = {"x_ptr": "*fp32", "meta_ptr": "*i64", "tiles_ptr": "*i64"}
    select = {**tables, "thresholds_ptr": "*fp32", "any_ptr": "*i64", "mask_ptr": "*u8", "counts_ptr": "*i64",
              "overflow_ptr": "*i64", "tile_counts_ptr": "*i64"}
    variants: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {
        "sample": (jit.sample_kernel, {**tables, "keys_ptr": "*i64", "out_ptr": "*fp32"}, {"BLOCK": 1024}),
        "above": (jit.above_kernel, {**tables, "thresholds_ptr": "*fp32", "any_ptr": "*i64"}, {"BLOCK": 1024}),
        **{f"select-{'fp16' if fp16 else 'fp32'}": (jit.select_kernel, select, {"FP16": fp16, "BLOCK": 1024})
           for fp16 in (True, False)},
        "statistics": (jit.statistics_kernel, {"counts_ptr": "*i64", "overflow_ptr": "*i64", "numels_ptr": "*fp64",
                                               "layers": "i64", "nbytes_ptr": "*i64", "out_ptr": "*fp32"},
                       {"VALUE_BYTES": 2, "BLOCK": 128}),
        # the compaction (triton_compact's) with the 16-bit values this compressor sends: its conversion
        **{f"compact-{t}": (compact.compact_kernel, {"mask_ptr": "*u8", "n": "i64", "starts_ptr": "*i64",
                                                     "x_ptr": "*fp32", "index_ptr": "*i32", "values_ptr": f"*{t}"},
                            {"BLOCK": 1024}) for t in ("bf16", "fp16")},
    }
    print(json.dumps(compile_for_hopper(variants)))


_compiled = hopper_job(__name__)


@needs_triton
def test_kernels_compile_for_a_hopper_gpu_without_fused_or_approximate_arithmetic() -> None:
    report, tmp_path = _compiled()
    assert set(report) == {
        "sample", "above", "select-fp16", "select-fp32", "statistics", "compact-bf16", "compact-fp16",
    }
    for name, counts in report.items():
        assert counts["cubin"] > 0, name
        assert all(counts[op] == 0 for op in ("fma.", "div.rn.f32", "div.full", "div.approx", "rcp.approx")), (
            name, counts,
        )
    # float32 to 16 bits rounds to nearest even, as torch's conversion (the interpreter truncates to bf16: _in_bf16)
    conversions = [set(re.findall(r"cvt\.r[a-z]*\.(?:bf16|f16)\.f32", ptx.read_text()))
                   for ptx in tmp_path.rglob("compact_kernel.ptx")]
    assert sorted(map(sorted, conversions)) == [["cvt.rn.bf16.f32"], ["cvt.rn.f16.f32"]], conversions
    # the statistics divide in float64 as torch does: IEEE division, float64 rounded once to float32
    (statistics,) = [ptx.read_text() for ptx in tmp_path.rglob("statistics_kernel.ptx")]
    assert "div.rn.f64" in statistics and "cvt.rn.f32.f64" in statistics
