"""TernGrad's Triton kernels (lightning_gradcomp/kernels/triton_terngrad.py, the CUDA path of a group) against the
torch ops they replace, bit for bit, without a GPU.

The cases run in Triton's interpreter in one subprocess (``tests/triton_interpreter.py``); a second subprocess
compiles every kernel for a Hopper GPU (sm_90) down to a cubin: what the interpreter cannot show, that the kernels
compile for CUDA and round as the torch ops do (true division only as ``div.rn``, no fused multiply-add).
"""

import json
from functools import partial
from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

import pytest
import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import FlatPacket
from lightning_gradcomp.kernels import rng
from tests.triton_interpreter import compile_for_hopper, hopper_job, interpreter_test, needs_triton, run_subprocess
from tests.unit.test_flat_terngrad import (
    CASES, CONFIGS, _assert_same, _exchange, _grads, _ranks, _segments, _step_ops,
)

CPU = torch.device("cpu")
#: groups of layers of mixed sizes with empty and one-element layers (the default: test_flat_terngrad's SHAPES)
TINY = {"empty": [(0,)], "one": [(1,)], "mixed": [(0,), (3,), (0,), (1,)]}


def _both(run: Callable[[Sequence[Compressor]], Any], kwargs: dict[str, Any], variant: str) -> tuple[Any, Any]:
    """``run`` on RANKS fresh compressors through the torch ops, then through the Triton kernels."""
    with kernels.torch_ops():  # the compiled CPU kernels off: the torch ops are the reference on both sides
        references = _ranks(kwargs, variant, triton=False)
        reference = run(references)
        comps = _ranks(kwargs, variant, triton=True)
        got = run(comps)
    # the kernels did run, and only on one side
    assert all(cast(TernGrad, c).kernels(CPU).name == "triton" for c in comps)
    assert not any(cast(TernGrad, c).kernels(CPU).name == "triton" for c in references)
    return got, reference


# -- the cases, run in the interpreter subprocess ------------------------------------------------------------------
def _case_exchange(
    config: str, variant: str, shapes: Optional[Sequence[tuple[int, ...]]] = None, steps: int = 1,
    device: torch.device = CPU,
) -> None:
    """``steps`` simulated steps of RANKS ranks (from the second on, the counters have advanced): payloads, sent,
    decoded, per-layer bytes, stats and counters equal the torch ops'."""
    seg = _segments() if shapes is None else _segments(shapes)
    grads = [g.to(device) for g in _grads(seg)]

    def run(comps: Sequence[Compressor]) -> list[dict[str, Any]]:
        return [_exchange(comps, seg, grads) for _ in range(steps)]

    got, reference = _both(run, CONFIGS[config], variant)
    for a, b in zip(got, reference):
        _assert_same(a, b)


def _gathered(packets: Sequence[FlatPacket]) -> list[FlatPacket]:
    """The packets as the hook's all-gather leaves them: rows of one ``[ranks, longest]`` buffer."""
    n = packets[0].payload.numel()
    rows = packets[0].payload.new_zeros(len(packets), n + 3)  # longer rows, as when another group follows
    for r, p in enumerate(packets):
        rows[r, :n] = p.payload
    return [packets[0].with_payload(rows[r, :n], p.layer_nbytes) for r, p in enumerate(packets)]


def _case_mean_into(config: str, out_kind: str, device: torch.device = CPU) -> None:
    """Decode-and-average of gathered rows into a float32 ``out``, or an fp16 strided one (of fp16 gradients:
    "fp16-strided", or float32 ones: "fp16-out")."""
    seg = _segments()
    half = out_kind != "fp32"
    grads = [(g.half() if out_kind == "fp16-strided" else g).to(device) for g in _grads(seg)]

    def run(comps: Sequence[Compressor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        shared = None
        stats = [c.flat_statistic(g, seg) for c, g in zip(comps, grads)]
        if stats[0] is not None:
            shared = stats[0].with_values(torch.stack([s.values for s in stats if s is not None]).amax(0))
        packets = [c.compress_flat(g, seg, shared) for c, g in zip(comps, grads)]
        out = torch.full((seg.total, 2), float("nan"), device=device)
        out = out.half()[:, 0] if half else out[:, 0].contiguous()
        alone = comps[0].decompress_flat_mean_into(packets[:1], out.clone())  # world size 1: the mean of one
        return [p.payload for p in packets], comps[0].decompress_flat_mean_into(_gathered(packets), out), alone

    (payloads, out, alone), (ref_payloads, ref_out, ref_alone) = _both(run, CONFIGS[config], "allgather")
    assert all(torch.equal(a, b) for a, b in zip(payloads, ref_payloads))
    assert out.dtype == ref_out.dtype and torch.equal(out, ref_out)
    assert alone.dtype == ref_alone.dtype and torch.equal(alone, ref_alone)


def _case_nonfinite(variant: str) -> None:
    """Gradients with inf and NaN: the same ternaries on the wire (NaN clips and scalers never keep an element)."""
    seg = _segments()
    grads = _grads(seg)
    for g in grads:
        g[3], g[40], g[41] = float("inf"), float("nan"), float("-inf")

    def run(comps: Sequence[Compressor]) -> list[torch.Tensor]:
        return [c.compress_flat(g, seg, c.flat_statistic(g, seg)).payload for c, g in zip(comps, grads)]

    got, reference = _both(run, {"bucket_size": 7}, variant)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


def _case_keys_wrap() -> None:
    """Keys next to 2**32: index + k0 wraps modulo 2**32 as rng.uniform's does, element by element; and a clip of
    NaN (a chunk with a NaN) under a finite scaler clips to NaN, as torch.minimum does (nothing is kept)."""
    from lightning_gradcomp.kernels import triton_terngrad

    numels = [3000, 1, 0, 70]
    tables = triton_terngrad.GroupTables(numels, [1, 1, 0, 1], [0] * 4, [0] * 4, torch.device("cpu"))
    keys = torch.tensor([[2**32 - 1000, 2**32 - 1], [5, 2**31], [0, 0], [2**32 - 1, 12345]], dtype=torch.int64)
    x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(3))
    scale = torch.tensor([1.0, 0.5, 2.0])
    layer = torch.repeat_interleave(torch.arange(4), torch.tensor(numels))
    chunk = torch.tensor([0, 1, 1, 2])[layer]
    within = torch.cat([torch.arange(n) for n in numels])
    u = rng.uniform(within, keys[layer, 0], keys[layer, 1])
    for clip in (None, torch.tensor([0.8, 0.3, float("nan")])):
        ternary, nonzero = triton_terngrad.ternarize(x, tables, keys, scale, clip, None)
        a = x.abs() if clip is None else torch.minimum(x.abs(), clip[chunk])
        expected = torch.where(u * scale[chunk] < a, torch.sign(x), 0.0).to(torch.int8)
        assert torch.equal(ternary, expected)
        starts, ends = [0, 3000, 3001, 3001], [3000, 3001, 3001, 3071]
        assert nonzero.tolist() == [int((expected[a:b] != 0).sum()) for a, b in zip(starts, ends)]
        assert (clip is None) == bool(expected[3001:].any())  # the NaN clip keeps nothing


def _case_division_modes() -> None:
    """The mean's division as ``Tensor.div_`` by an int rounds: true division (CPU), or times the float32
    reciprocal (CUDA); the two differ on some elements for 3 ranks, so each mode is checked against its own."""
    from lightning_gradcomp.kernels import triton_terngrad

    n, ranks = 4096, 3
    tables = triton_terngrad.GroupTables([n], [n], [n // 4], [0], torch.device("cpu"))  # a scaler per element
    codes = torch.randint(0, 3, (ranks, 4, n // 4), generator=torch.Generator().manual_seed(4))
    payloads = (codes * torch.tensor([1, 4, 16, 64])[:, None]).sum(1).to(torch.uint8)  # 2-bit codes 0..2
    scale = torch.rand(n, generator=torch.Generator().manual_seed(5))
    summed = torch.empty(n)
    triton_terngrad.decode(payloads, n // 4, ranks, tables, scale, True, 1, 4, 4, summed, divide=False)
    assert torch.equal(summed, (codes - 1).sum(0).reshape(-1).float() * scale)
    results = {}
    original = triton_terngrad.reciprocal_division
    try:
        for reciprocal in (False, True):

            def forced(device: torch.device, r: bool = reciprocal) -> bool:
                return r

            triton_terngrad.reciprocal_division = forced
            out = torch.empty(n)
            results[reciprocal] = triton_terngrad.decode(
                payloads, n // 4, ranks, tables, scale, True, 1, 4, 4, out, divide=True
            )
    finally:
        triton_terngrad.reciprocal_division = original
    assert torch.equal(results[False], summed / ranks)
    assert torch.equal(results[True], summed * (torch.tensor(1.0) / ranks))  # the float32 reciprocal: CUDA's div_
    assert not torch.equal(results[True], results[False])


def _case_op_counts(config: str, variant: str) -> None:
    """A step (statistic, compress, sent, decode) dispatches the same aten ops for 8 and 32 layers, reads nothing on
    the host, and launches 3 kernels (ternarize or ternarize + pack, decode for ``sent``, decode of the received);
    fewer aten ops than the torch ops. The interpreter's own tensor handling inside a launch is not counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    from lightning_gradcomp.kernels import triton_terngrad

    launches = 0
    launch = triton_terngrad.launch

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal launches
        launches += 1
        with _disable_current_modes():  # what a GPU would run as one kernel
            launch(*args, **kwargs)

    comps = _ranks(CONFIGS[config], variant, triton=False)
    triton_terngrad.launch = counted
    try:
        with kernels.torch_ops():
            torch_ops = _step_ops(comps[0], 8)
            comps = _ranks(CONFIGS[config], variant, triton=True)
            small, large = _step_ops(comps[0], 8), _step_ops(comps[0], 32)
    finally:
        triton_terngrad.launch = launch
    assert small == large and small[1:] == (0, 0), (small, large)
    assert launches == 2 * 2 * 3  # two calls of _step_ops, each a warm-up step and a counted one
    assert small[0] < torch_ops[0], (small, torch_ops)


def _case_choice() -> None:
    """Without forcing, the Triton kernels run on CUDA only; the choice is kept until ``setup``."""
    from lightning_gradcomp.kernels import triton_launch

    assert triton_launch.available() and triton_launch.usable(torch.device("cuda"))
    assert not triton_launch.usable(torch.device("cpu"))
    comp = TernGrad(backend="fused")
    comp.setup(0, 2, torch.device("cpu"))
    seg = _segments()
    x = _grads(seg)[0]
    with kernels.torch_ops():
        comp.compress_flat(x, seg, comp.flat_statistic(x, seg))
    assert comp.kernels(x.device).name == "fused"


INTERPRETED: dict[str, Callable[[], None]] = {
    **{f"exchange-{c}-{v}": partial(_case_exchange, c, v, steps=2 if c == "paper" else 1) for c, v in CASES},
    **{f"tiny-{name}-{v}": partial(_case_exchange, "paper", v, s) for name, s in TINY.items()
       for v in ("allgather", "allreduce_int8")},
    **{f"mean-into-{c}-{o}": partial(_case_mean_into, c, o) for c in ("paper", "per_worker", "base3")
       for o in ("fp32", "fp16-strided", "fp16-out")},
    **{f"nonfinite-{v}": partial(_case_nonfinite, v) for v in ("allgather", "allreduce_int8")},
    "ternarize-keys-wrap-nan-clip": _case_keys_wrap,
    "division-modes": _case_division_modes,
    **{f"op-counts-{c}-{v}": partial(_case_op_counts, c, v)
       for c, v in (("paper", "allgather"), ("paper", "allreduce_int8"), ("per_worker", "allgather"))},
    "choice": _case_choice,
}


test_triton_kernels_match_the_torch_ops_in_the_interpreter = interpreter_test(__name__, INTERPRETED, "INTERPRETED")


# -- on a GPU, when there is one ---------------------------------------------------------------------------------
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run on a GPU: the CUDA torch ops' rounding)")
@pytest.mark.parametrize(("config", "variant"), CASES)
def test_triton_kernels_match_the_torch_ops_on_cuda(config: str, variant: str) -> None:
    _case_exchange(config, variant, steps=2, device=torch.device("cuda"))
    if variant == "allgather":
        for out_kind in ("fp32", "fp16-strided", "fp16-out"):
            _case_mean_into(config, out_kind, torch.device("cuda"))


# -- compiled for a GPU, without one ------------------------------------------------------------------------------
def _compile_all() -> None:
    """Compile each kernel for sm_90 (in the subprocess, without ``TRITON_INTERPRET``); print, per kernel variant,
    the counts of PTX instructions that decide the rounding."""
    from lightning_gradcomp.kernels import _triton_terngrad_jit as jit

    common = {"meta_ptr": "*i64", "tiles_ptr": "*i64", "scale_ptr": "*fp32", "bucket": "i64"}
    encode = {**common, "x_ptr": "*fp32", "keys_ptr": "*i64", "clip_ptr": "*fp32", "nonzero_ptr": "*i32"}
    decode = {**common, "payload_ptr": "*u8", "rank_stride": "i64", "ranks": "i32", "scale_stride": "i32",
              "out_ptr": "*fp32", "divisor": "fp32"}
    base3 = {"PER": 5, "PER_P2": 8, "RADIX": 3}
    variants: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {
        "ternarize": (jit.ternarize_kernel, {**encode, "out_ptr": "*i8"}, {"HAS_CLIP": True, "CHUNKED": True, "BLOCK": 1024}),
        "pack": (jit.ternarize_pack_kernel, {**encode, "out_ptr": "*u8"},
                 {"HAS_CLIP": True, "CHUNKED": True, "BLOCK": 256, **base3}),
        "decode-shared-true-div": (jit.decode_kernel, decode,
                                   {"SHARED": True, "DIVIDE": 1, "CHUNKED": True, "BLOCK": 256, **base3}),
        "decode-per-worker-reciprocal": (jit.decode_kernel, decode,
                                         {"SHARED": False, "DIVIDE": 2, "CHUNKED": False, "BLOCK": 256,
                                          "PER": 4, "PER_P2": 4, "RADIX": 4}),
        # one rank (the hook's world size 1): Triton makes an int argument of 1 a compile-time constant
        "decode-one-rank": (jit.decode_kernel, {k: v for k, v in decode.items() if k != "ranks"},
                            {"ranks": 1, "SHARED": True, "DIVIDE": 2, "CHUNKED": False, "BLOCK": 256,
                             "PER": 4, "PER_P2": 4, "RADIX": 4}),
        "scale-int8": (jit.scale_int8_kernel, {**common, "values_ptr": "*i8", "out_ptr": "*fp32"},
                       {"CHUNKED": True, "BLOCK": 1024}),
    }
    print(json.dumps(compile_for_hopper(variants)))


_compiled = hopper_job(__name__)


@needs_triton
def test_kernels_compile_for_a_hopper_gpu_and_round_as_the_torch_ops() -> None:
    report, _ = _compiled()
    assert set(report) == {
        "ternarize", "pack", "decode-shared-true-div", "decode-per-worker-reciprocal", "decode-one-rank", "scale-int8",
    }
    for name, counts in report.items():
        assert counts["cubin"] > 0, name
        # no fused multiply-add, no approximate division or reciprocal anywhere
        assert counts["fma."] == counts["div.full"] == counts["div.approx"] == counts["rcp.approx"] == 0, (name, counts)
    assert report["decode-shared-true-div"]["div.rn.f32"] > 0  # the CPU's Tensor.div_: a correctly rounded division
    assert report["decode-per-worker-reciprocal"]["div.rn.f32"] == 0  # CUDA's: a multiplication by 1/ranks


def test_the_library_imports_and_chooses_torch_ops_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` raises ImportError
        "import torch, lightning_gradcomp\n"
        "from lightning_gradcomp.kernels import triton_launch\n"
        "assert not triton_launch.available() and not triton_launch.usable(torch.device('cuda'))\n"
        "import json; print(json.dumps({'ok': True}))\n"
    )
    assert run_subprocess(code, {})["ok"]

