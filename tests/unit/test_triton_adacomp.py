"""AdaComp's Triton kernels (lightning_gradcomp/kernels/triton_adacomp.py, the CUDA path of a group) against the
torch ops they replace, bit for bit, without a GPU.

The cases run in Triton's interpreter in one subprocess (``tests/triton_interpreter.py``); a second subprocess
compiles every kernel for a Hopper GPU (sm_90) down to a cubin (no fused multiply-add: H = G + f dW rounds twice,
as the torch ops' product and sum).
"""

import json
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp
from lightning_gradcomp.flat import FlatPacket, Segments
from tests.triton_interpreter import compile_for_hopper, hopper_job, interpreter_test, needs_triton
from tests.unit.test_flat_graddrop_adacomp import ADACOMP_CASES, SHAPES

CONFIGS: dict[str, dict[str, Any]] = {**ADACOMP_CASES, "factor": dict(scale_factor=2.7, bin_size_fc=64)}
CPU = torch.device("cpu")
#: groups with empty and one-element layers only, and a few tiny ones
TINY: dict[str, list[tuple[int, ...]]] = {"empty": [(0,)], "one": [(1,)], "mixed": [(0,), (3,), (0,), (1,)]}


def _segments(shapes: Sequence[tuple[int, ...]]) -> Segments:
    return Segments([f"layer{i}.weight" for i in range(len(shapes))], [torch.Size(s) for s in shapes])


def _gradient(seg: Segments, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seg.total, generator=gen) * torch.rand(seg.total, generator=gen) ** 4
    x[: min(7, seg.total)] = 0.0  # an all-zero start: bins that send nothing
    x[seg.total // 2 : seg.total // 2 + 30] = 0.25  # ties: every element at its bin's maximum
    return x


def _pair(config: dict[str, Any], rank: int, ranks: int, device: torch.device = CPU) -> tuple[AdaComp, AdaComp]:
    """(the Triton kernels, the torch ops) for one rank."""
    comps = AdaComp(backend="torch", **config), AdaComp(backend="torch", **config)
    for comp, on in zip(comps, (True, False)):
        comp.triton = on  # an option: read when setup chooses the kernels
        comp.setup(rank, ranks, device)
    return comps


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _same_packets(a: FlatPacket, b: FlatPacket) -> None:
    assert torch.equal(a.payload, b.payload)
    assert isinstance(a.layer_nbytes, Tensor) and torch.equal(a.layer_nbytes, torch.as_tensor(b.layer_nbytes))
    assert set(a.stats) == set(b.stats) and all(_equal(a.stats[k], b.stats[k]) for k in b.stats), a.stats


def _case_exchange(
    config: str, shapes: Sequence[tuple[int, ...]] = SHAPES, ranks: int = 3, steps: int = 2,
    poison: Callable[[Tensor, Segments], None] = lambda x, seg: None, device: torch.device = CPU,
) -> None:
    """``steps`` steps of ``ranks`` ranks, residuals fed back (so the compensated tensor differs from dW): payloads,
    sizes, stats, sent and the gathered mean equal the torch ops'."""
    seg = _segments(shapes)
    with kernels.torch_ops():  # the compiled CPU kernels off: the torch ops are the reference
        pairs = [_pair(CONFIGS[config], r, ranks, device) for r in range(ranks)]
        packets: list[tuple[FlatPacket, FlatPacket]] = []
        for rank, (fast, ref) in enumerate(pairs):
            residual = torch.zeros(seg.total, device=device)
            for step in range(steps):
                grad = _gradient(seg, 10 * rank + step)
                if step:  # dW = 0 on a third: there H = G, whose bin maximum ties |H| >= gmax exactly
                    grad[: seg.total // 3] = 0.0
                poison(grad, seg)
                grad = grad.to(device)
                x = grad + residual
                got = []
                for comp in (fast, ref):
                    comp.observe_gradient_flat(grad, seg)
                    packet = comp.compress_flat(x, seg)
                    got.append((packet, comp.sent_flat(x, packet)))
                (a, sent_a), (b, sent_b) = got
                _same_packets(a, b)
                assert _equal(sent_a, sent_b)
                residual = x - sent_b
            packets.append((a, b))
        # the kernels did run, on one side only
        assert all(fast.kernels(CPU).name == "triton" and ref.kernels(CPU).name == "torch" for fast, ref in pairs)
        means = []
        for side in range(2):
            out = torch.full((seg.total,), float("nan"), device=device)
            pairs[0][side].decompress_flat_mean_into([p[side] for p in packets], out)
            means.append(out)
    assert _equal(means[0], means[1])


def _nonfinite(x: Tensor, seg: Segments) -> None:
    x[seg.offsets[3] + 5] = float("nan")
    x[seg.offsets[0] + 100] = float("inf")
    x[seg.offsets[4] + 7] = -float("inf")


def _case_decode_blocks() -> None:
    """Layers' payloads decoded in many tiles (the running bin carried from the tiles before): 256-byte tiles."""
    from lightning_gradcomp.kernels import triton_adacomp

    blocks = triton_adacomp.BYTES
    triton_adacomp.BYTES = 256
    try:
        _case_exchange("small_bins", steps=1)
    finally:
        triton_adacomp.BYTES = blocks


def _case_op_counts(config: str) -> None:
    """A step (compress, sent, decode of 3 ranks) dispatches the same aten ops for 5 and 11 layers, fewer than the
    torch ops, reads the host once (the payload's size), runs no data-dependent op, and launches 12 kernels: bin
    maxima, selection, the compaction's count and copy, a decode (two launches) for ``sent`` and one per rank for
    the mean. The
    interpreter's own tensor handling inside a launch is not counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    from gradcomp_lab.opcount import count_ops
    from lightning_gradcomp.kernels import triton_adacomp, triton_compact

    launches = 0
    launch = triton_adacomp.launch

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal launches
        launches += 1
        with _disable_current_modes():  # what a GPU would run as one kernel
            launch(*args, **kwargs)

    def step_ops(layers: int, on: bool = True) -> tuple[int, int, int]:
        seg = _segments([(12, 10), (7,), (3, 2, 2, 2)] * (layers // 3) + [(1,)] * (layers % 3))
        comp = _pair(CONFIGS[config], 0, 3)[0 if on else 1]
        grad = _gradient(seg, 0)

        def step() -> None:
            comp.observe_gradient_flat(grad, seg)
            packet = comp.compress_flat(grad * 2, seg)
            comp.sent_flat(grad * 2, packet)
            comp.decompress_flat_mean_into([packet] * 3, torch.empty(seg.total))

        step()  # the first step builds the group's tables
        with count_ops() as ops:
            step()
        return ops.total, ops.host_reads, ops.data_dependent

    triton_adacomp.launch = counted
    triton_compact.launch = counted
    try:
        with kernels.torch_ops():
            torch_ops = step_ops(5, on=False)
            small = step_ops(5)
            before = launches
            large = step_ops(11)
    finally:
        triton_adacomp.launch = triton_compact.launch = launch
    assert small == large and small[1:] == (1, 0), (small, large)
    assert launches - before == before == 2 * 12  # a warm-up step and a counted one
    assert small[0] < torch_ops[0] and torch_ops[1:] == (0, 1), (small, torch_ops)


def _case_choice() -> None:
    """Without forcing, the Triton kernels run on CUDA only; the choice is made again at ``setup``."""
    from lightning_gradcomp.kernels import triton_launch

    assert triton_launch.usable(torch.device("cuda")) and not triton_launch.usable(torch.device("cpu"))
    comp = AdaComp(backend="torch")
    seg = _segments(SHAPES)
    x = _gradient(seg, 0)
    comp.observe_gradient_flat(x, seg)
    comp.compress_flat(x, seg)
    assert comp.kernels(x.device).name == "torch"
    comp.triton = True
    comp.setup(0, 2, torch.device("cpu"))
    assert comp.kernels(x.device).name == "triton"


INTERPRETED: dict[str, Callable[[], None]] = {
    **{f"exchange-{c}": partial(_case_exchange, c, steps=2 if c == "binary" else 1) for c in CONFIGS},
    "one-rank": lambda: _case_exchange("binary", ranks=1, steps=3),
    **{f"tiny-{name}": partial(_case_exchange, "small_bins", s) for name, s in TINY.items()},
    "long-gaps": lambda: _case_exchange("binary", [(3000,), (3,), (900,)], ranks=1, steps=1),
    "decode-blocks": _case_decode_blocks,
    **{f"nonfinite-{q}": partial(_case_exchange, q, poison=_nonfinite) for q in ("binary", "ternary")},
    **{f"op-counts-{c}": partial(_case_op_counts, c) for c in ("binary", "ternary")},
    "choice": _case_choice,
}


test_triton_kernels_match_the_torch_ops_in_the_interpreter = interpreter_test(__name__, INTERPRETED, "INTERPRETED")


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run on a GPU: the CUDA torch ops' rounding)")
@pytest.mark.parametrize("config", CONFIGS)
def test_triton_kernels_match_the_torch_ops_on_cuda(config: str) -> None:
    # the kernels against the torch ops both on CUDA (the interpreter cases compare them on CPU tensors)
    _case_exchange(config, device=torch.device("cuda"))
    _case_exchange(config, device=torch.device("cuda"), poison=_nonfinite)


def _compile_all() -> None:
    """Compile each kernel for sm_90 (in the subprocess, without ``TRITON_INTERPRET``)."""
    from lightning_gradcomp.kernels import _triton_adacomp_jit as jit
    from lightning_gradcomp.kernels import _triton_compact_jit

    common = {"g_ptr": "*fp32", "meta_ptr": "*i64", "tiles_ptr": "*i64", "gmax_ptr": "*fp32"}
    select = {**common, "dw_ptr": "*fp32", "factor": "fp32", "scale_ptr": "*fp32", "counts_ptr": "*i64",
              "first_ptr": "*i64", "last_ptr": "*i64", "words_ptr": "*u8", "used_ptr": "*u8"}
    words = {"payload_ptr": "*u8", "starts_ptr": "*i64", "nbytes_ptr": "*i64", "meta_ptr": "*i64", "tiles_ptr": "*i64"}
    variants: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {
        "bin-max-500": (jit.bin_max_kernel, common, {"BINS": 4, "LPAD": 512}),
        "bin-max-50": (jit.bin_max_kernel, common, {"BINS": 32, "LPAD": 64}),
        "select-binary": (jit.select_kernel, select, {"TERNARY": False, "BINS": 4, "LPAD": 512}),
        "select-ternary": (jit.select_kernel, select, {"TERNARY": True, "BINS": 128, "LPAD": 16}),
        "advance": (jit.advance_kernel, {**words, "sums_ptr": "*i64"}, {"BLOCK": 1024}),
        "decode-add": (jit.decode_add_kernel, {**words, "carry_ptr": "*i64", "out_ptr": "*fp32"}, {"BLOCK": 1024}),
        # the shared compaction as the encode runs it: word bytes kept into the uint8 payload
        "compact-bytes": (_triton_compact_jit.compact_kernel, {"mask_ptr": "*u8", "n": "i64", "starts_ptr": "*i64",
                                                               "x_ptr": "*u8", "index_ptr": "*i32",
                                                               "values_ptr": "*u8"}, {"BLOCK": 1024}),
    }
    print(json.dumps(compile_for_hopper(variants)))


_compiled = hopper_job(__name__)


@needs_triton
def test_kernels_compile_for_a_hopper_gpu_without_fused_multiply_add() -> None:
    report, _ = _compiled()
    assert set(report) == {
        "bin-max-500", "bin-max-50", "select-binary", "select-ternary", "advance", "decode-add", "compact-bytes",
    }
    for name, counts in report.items():
        assert counts["cubin"] > 0, name
        assert counts["fma."] == counts["div.full"] == counts["div.approx"] == counts["rcp.approx"] == 0, (name, counts)
