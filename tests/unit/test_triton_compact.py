"""Stream compaction in Triton (lightning_gradcomp/kernels/triton_compact.py) against torch.nonzero and
index_select (and its inverse against index_add_), in Triton's interpreter (tests/triton_interpreter.py), and compiled for an sm_90 GPU."""

import json
from collections.abc import Callable
from functools import partial

import torch

from tests.triton_interpreter import compile_for_hopper, hopper_job, interpreter_test, needs_triton


def _case(n: int, density: float, dtype: torch.dtype, known_counts: bool) -> None:
    from lightning_gradcomp.kernels import triton_compact

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n + 1)) < density
    counts = triton_compact.tile_counts(mask)
    assert counts.dtype == torch.int64 and counts.numel() == -(-n // triton_compact.BLOCK)
    positions = torch.nonzero(mask).reshape(-1)
    assert int(counts.sum()) == positions.numel()
    # longer outputs than the count: the kernels write only the kept slots
    index = torch.full((positions.numel() + 3,), -7, dtype=torch.int32)
    values = torch.full((positions.numel() + 3,), 9.0, dtype=dtype)
    triton_compact.compact(mask, x, index, values, counts if known_counts else None)
    assert torch.equal(index[: positions.numel()].long(), positions)
    assert torch.equal(values[: positions.numel()], x.index_select(0, positions).to(dtype))
    assert index[positions.numel():].eq(-7).all() and values[positions.numel():].eq(9.0).all()


def _uint8_mask() -> None:
    from lightning_gradcomp.kernels import triton_compact

    x = torch.arange(3000, dtype=torch.float32)
    mask = (torch.arange(3000) % 7 == 0).to(torch.uint8)
    index = torch.empty(429, dtype=torch.int32)
    values = torch.empty(429)
    triton_compact.compact(mask, x, index, values)
    assert torch.equal(index.long(), torch.arange(0, 3000, 7)) and torch.equal(values, x[::7])


def _scatter(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    from lightning_gradcomp.kernels import triton_compact

    gen = torch.Generator().manual_seed(5)
    out = torch.randn(3000, generator=gen)
    expected = out.clone()
    for _ in range(3):  # rank after rank, as a decoder adds them; indices distinct within a rank
        index = torch.randperm(3000, generator=gen)[:1100].to(index_dtype)
        values = torch.randn(1100, generator=gen).to(dtype)
        expected.index_add_(0, index.long(), values.to(torch.float32))
        assert triton_compact.scatter_add(index, values, out) is out
    assert torch.equal(out, expected)
    empty = torch.zeros(0, dtype=index_dtype)
    assert torch.equal(triton_compact.scatter_add(empty, torch.zeros(0, dtype=dtype), out), expected)


def _scatter_store(dtype: torch.dtype) -> None:
    from lightning_gradcomp.kernels import triton_compact

    gen = torch.Generator().manual_seed(6)
    out = torch.randn(3000, generator=gen)
    index = torch.randperm(3000, generator=gen)[:1100].to(torch.int32)
    values = torch.randn(1100, generator=gen).to(dtype)
    values[:5] = -0.0  # stored as -0.0: an add into zeros would give 0.0
    expected = out.clone().index_put_((index.long(),), values.float())
    assert triton_compact.scatter(index, values, out) is out and torch.equal(out.view(torch.int32), expected.view(torch.int32))


CASES: dict[str, Callable[[], None]] = {
    **{f"n{n}-d{d}-{str(t)[6:]}-{'known' if k else 'counted'}": partial(_case, n, d, t, k)
       for n in (0, 1, 1023, 1024, 5000) for d in (0.0, 0.01, 0.5, 1.0)
       for t in (torch.float32, torch.float16) for k in (False, True)},
    "uint8-mask": _uint8_mask,
    **{f"scatter-add-{str(t)[6:]}-{str(i)[6:]}": partial(_scatter, t, i)
       for t in (torch.float32, torch.float16) for i in (torch.int32, torch.int64)},
    **{f"scatter-{str(t)[6:]}": partial(_scatter_store, t) for t in (torch.float32, torch.float16)},
}


test_compaction_matches_nonzero_and_index_select = interpreter_test(__name__, CASES)


def _compile_all() -> None:
    from lightning_gradcomp.kernels import _triton_compact_jit as jit

    print(json.dumps(compile_for_hopper({
        "count": (jit.count_kernel, {"mask_ptr": "*u8", "n": "i64", "counts_ptr": "*i64"}, {"BLOCK": 1024}),
        "compact": (jit.compact_kernel, {"mask_ptr": "*u8", "n": "i64", "starts_ptr": "*i64", "x_ptr": "*fp32",
                                         "index_ptr": "*i32", "values_ptr": "*fp16"}, {"BLOCK": 1024}),
        **{name: (jit.scatter_add_kernel, {"index_ptr": "*i32", "values_ptr": "*fp16", "count": "i64",
                                           "out_ptr": "*fp32"}, {"ACCUMULATE": accumulate, "BLOCK": 1024})
           for name, accumulate in (("scatter-add", True), ("scatter", False))},
    })))


_compiled = hopper_job(__name__)


@needs_triton
def test_compaction_kernels_compile_for_a_hopper_gpu() -> None:
    report, _ = _compiled()
    assert set(report) == {"count", "compact", "scatter-add", "scatter"} and all(r["cubin"] > 0 for r in report.values())
    assert all(r["fma."] == 0 for r in report.values())
