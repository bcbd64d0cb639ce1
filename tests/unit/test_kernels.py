"""Fused kernels: exact parity with wire.py and the torch reference, statistical properties, fallbacks.

The compiled CPU path is compared with the torch-ops path of the same functions (``kernels.torch_ops()``)
and with the reference implementations (``wire.py``, the per-layer oracle ``tests/oracles/terngrad.py``, plain torch selection).
The extension is compiled once per session (module fixture); on a machine where it cannot be built the
comparisons that need it are skipped and the fallback tests still run.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.terngrad import ClipMode
from tests.oracles import terngrad_kernels as layer_kernels
from tests.oracles.terngrad import LayerTernGrad
from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes, unpack_ternary
from lightning_gradcomp.compressors.per_tensor import per_tensor

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> bool:
    """Compile (or load) the CPU kernels once; skip tests that need them where they cannot be built."""
    if not kernels.fused_available():
        pytest.skip(f"CPU kernels unavailable: {kernels._build.unavailable_reason}")
    return True


def _scaler_and_clip(g: torch.Tensor, bucket: int, clip_factor: float = 2.5, mode: str = "paper") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    sigma, absmax = layer_kernels.terngrad_stats(g, bucket)
    return kernels.terngrad_scaler(sigma, absmax, clip_factor, mode)


# -- TernGrad: exact packing and decoding ---------------------------------------------------------------
SHAPES = [(1, None), (3, None), (4, None), (5, None), (7, 3), (1000, None), (1001, 300), (65539, 16384), (70001, 777)]


@pytest.mark.parametrize(("n", "bucket"), SHAPES)
def test_ternarize_pack_equals_wire_packing_and_the_torch_ops_path(compiled: bool, n: int, bucket: "int | None") -> None:
    g = torch.randn(n)
    g[::97] *= 30  # outliers, so paper clipping matters
    b = bucket or n
    for clip_factor in (2.5, 0.0):
        s, clip = _scaler_and_clip(g, b, clip_factor)
        key = kernels.stream_key(7, 1, 3)
        packed, nonzero = layer_kernels.ternarize_pack(g, s, clip, b, key)
        values, nonzero8 = layer_kernels.ternarize_int8(g, s, clip, b, key)
        with kernels.torch_ops():
            packed_t, nonzero_t = layer_kernels.ternarize_pack(g, s, clip, b, key)
            values_t, _ = layer_kernels.ternarize_int8(g, s, clip, b, key)
        assert packed.numel() == packed_nbytes(n, "2bit")
        assert torch.equal(packed, pack_ternary(values, "2bit"))  # the wire layout, byte for byte
        assert torch.equal(unpack_ternary(packed, n, "2bit"), values)
        assert torch.equal(values, values_t) and torch.equal(packed, packed_t)  # same stream on both paths
        assert nonzero.item() == nonzero8.item() == nonzero_t.item() == int((values != 0).sum())
        assert torch.all(values.float() * g >= 0)  # signs never flip


@pytest.mark.parametrize(("n", "bucket"), SHAPES)
def test_decode_and_decode_sum_are_bit_identical_to_the_reference(compiled: bool, n: int, bucket: "int | None") -> None:
    b = bucket or n
    chunks = -(-n // b)
    scale = torch.rand(chunks) + 0.1
    per_elem = scale.repeat_interleave(b)[:n]
    ternaries = [torch.randint(-1, 2, (n,), dtype=torch.int8) for _ in range(3)]
    payloads = [pack_ternary(t, "2bit") for t in ternaries]
    assert torch.equal(layer_kernels.decode(payloads[0], n, scale, b), ternaries[0].float() * per_elem)
    total = sum(t.to(torch.int32) for t in ternaries)
    assert torch.equal(layer_kernels.decode_sum(payloads, n, scale, b), total.float() * per_elem)  # type: ignore[union-attr]
    with kernels.torch_ops():
        assert torch.equal(layer_kernels.decode_sum(payloads, n, scale, b), total.float() * per_elem)  # type: ignore[union-attr]
    out = torch.full((n,), float("nan"))  # decoding into a reused buffer overwrites all of it
    assert layer_kernels.decode(payloads[1], n, scale, b, out=out) is out
    assert torch.equal(out, ternaries[1].float() * per_elem)
    layer_kernels.decode_sum(payloads, n, scale, b, out=out)
    assert torch.equal(out, total.float() * per_elem)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="out"):
        layer_kernels.decode(payloads[0], n, scale, b, out=torch.empty(n + 1))


# payload counts on both summing paths of the kernel (bytes up to 127, int32 beyond) and at their edges, and
# divisors that are and are not powers of two (multiplied by the reciprocal vs divided)
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7, 8, 9, 127, 128])
@pytest.mark.parametrize(("n", "bucket"), [(1, None), (4099, None), (70001, 777), (65539, 16384)])
def test_decode_sum_with_divisor_equals_sum_then_float_division(
    compiled: bool, count: int, n: int, bucket: "int | None"
) -> None:
    b = bucket or n
    gen = torch.Generator().manual_seed(count * 1000 + n)
    scale = torch.rand(-(-n // b), generator=gen) + 0.1
    per_elem = scale.repeat_interleave(b)[:n]
    ternaries = [torch.randint(-1, 2, (n,), dtype=torch.int8, generator=gen) for _ in range(count)]
    ternaries[0][:64] = 1  # the largest sums: every payload +1 (a code of 2) on the same elements
    for t in ternaries[1:]:
        t[:64] = 1
    payloads = [pack_ternary(t, "2bit") for t in ternaries]
    total = torch.stack([t.to(torch.int32) for t in ternaries]).sum(0)
    expected_sum = total.float() * per_elem
    assert torch.equal(layer_kernels.decode_sum(payloads, n, scale, b), expected_sum)
    for divisor in sorted({1, 3, 4, count}):
        expected = expected_sum.clone().div_(divisor)
        out = torch.full((n,), float("nan"))
        assert layer_kernels.decode_sum(payloads, n, scale, b, out=out, divisor=divisor) is out
        assert torch.equal(out, expected), (count, divisor)
        with kernels.torch_ops():
            assert torch.equal(layer_kernels.decode_sum(payloads, n, scale, b, divisor=divisor), expected)


def test_decode_sum_rejects_a_bad_divisor() -> None:
    payload = pack_ternary(torch.ones(4, dtype=torch.int8), "2bit")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="divisor"):
            layer_kernels.decode_sum([payload], 4, torch.ones(1), 4, divisor=bad)  # type: ignore[arg-type]


def test_statistics_match_torch_std_and_max_including_a_partial_tail(compiled: bool) -> None:
    g = torch.randn(10_007) * 3 + 0.5
    for bucket in (g.numel(), 1000, 4096):
        sigma, absmax = layer_kernels.terngrad_stats(g, bucket)
        padded = torch.cat((g, g.new_full((-(-g.numel() // bucket) * bucket - g.numel(),), float("nan"))))
        rows = padded.view(-1, bucket)
        for i, row in enumerate(rows):
            row = row[~row.isnan()]
            assert sigma[i].item() == pytest.approx(row.std(correction=0).item(), rel=1e-5)
            assert absmax[i].item() == row.abs().max().item()
        with kernels.torch_ops():
            sigma_t, absmax_t = layer_kernels.terngrad_stats(g, bucket)
        assert torch.allclose(sigma, sigma_t, rtol=1e-6) and torch.equal(absmax, absmax_t)


@pytest.mark.parametrize("clip_mode", ["paper", "code"])
@pytest.mark.parametrize("clip_factor", [2.5, 2.3, 0.0])
def test_native_scale_and_clip_equal_the_torch_ops_bit_for_bit(compiled: bool, clip_mode: str, clip_factor: float) -> None:
    g = torch.randn(9000) * 0.01
    g[:40] = 3.0  # an outlier chunk: clipped
    g[3000:4000] = 0.25  # a constant chunk: sigma is rounding noise, so no clipping (threshold max|g|)
    g[4000:5000] = 0.0  # an all-zero chunk
    g[7500] = float("nan")  # a non-finite chunk: NaN must come out where the torch ops give NaN
    for bucket in (1000, 9000):
        native = layer_kernels.terngrad_scale_clip(g, bucket, clip_factor, clip_mode, 1e-5)
        composed = kernels.terngrad_scaler(*layer_kernels.terngrad_stats(g, bucket), clip_factor, clip_mode, 1e-5)
        for got, want in zip(native, composed):
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="clip_mode"):
        layer_kernels.terngrad_scale_clip(g, 1000, clip_factor, "sigma", 1e-5)


@pytest.mark.parametrize("clip_mode", ["paper", "code"])
@pytest.mark.parametrize("clip_factor", [2.5, 0.0])
def test_fused_scaler_equals_the_torch_backend(clip_mode: ClipMode, clip_factor: float) -> None:
    g = torch.randn(5000)
    g[:5] = 40.0
    for bucket in (None, 1200):
        ref = LayerTernGrad(clip_factor=clip_factor, clip_mode=clip_mode, bucket_size=bucket, backend="torch")
        fused = TernGrad(clip_factor=clip_factor, clip_mode=clip_mode, bucket_size=bucket, backend="fused")
        assert torch.allclose(per_tensor(fused).local_statistic(g, "w"), per_tensor(ref).local_statistic(g, "w"), rtol=1e-5)  # type: ignore[arg-type]


# -- TernGrad: statistical properties ---------------------------------------------------------------------
def test_bernoulli_probabilities_unbiasedness_and_independent_streams(compiled: bool) -> None:
    """Each element is kept with probability min(|g|, clip)/s (z-test per level), E[s*t] = clip(g), and
    streams of different counters / ranks are independent (keep masks uncorrelated)."""
    levels = torch.tensor([0.0, 0.01, 0.1, 0.25, 0.5, 0.77, 0.9, 0.999, 1.0, 1.5, 3.0])  # |g| / s, > 1 is clipped
    copies = 40_000
    g = (levels.repeat_interleave(copies) * torch.where(torch.rand(levels.numel() * copies) < 0.5, -1.0, 1.0))
    s, clip = torch.tensor([1.0]), torch.tensor([1.2])  # paper mode: clip at 1.2 > s is still always kept
    n = g.numel()
    masks = []
    for seed, rank, counter in ((0, 0, 0), (0, 0, 1), (0, 1, 0), (5, 0, 0)):
        t, _ = layer_kernels.ternarize_int8(g, s, clip, n, kernels.stream_key(seed, rank, counter))
        kept = (t != 0).view(levels.numel(), copies).double()
        p = levels.clamp(max=1.0).double()
        freq = kept.mean(dim=1)
        stderr = (p * (1 - p) / copies).sqrt()
        assert torch.all((freq - p).abs() <= 5 * stderr + 1e-12), (freq, p)
        # unbiased: E[s * t] = g for |g| <= s (values above s are clipped to s, then always sent)
        decoded = (t.double() * s.double()).view(levels.numel(), copies)
        expect = (g.double().clamp(-1.0, 1.0)).view(levels.numel(), copies)
        err = (decoded - expect).mean(dim=1)
        assert torch.all(err.abs() <= 5 * stderr + 1e-12)
        masks.append((t != 0).double())
    # independence between streams: for a level p, P(both kept) = p**2
    mid = slice(4 * copies, 5 * copies)  # level 0.5
    for other in masks[1:]:
        both = (masks[0][mid] * other[mid]).mean().item()
        assert abs(both - 0.25) < 5 * (0.25 * 0.75 / copies) ** 0.5


def test_fused_compressor_is_unbiased_like_the_reference() -> None:
    g = torch.randn(2000)
    trials = 300
    for backend in ("fused", "torch"):
        comp = TernGrad(clip_factor=0.0, backend=backend)
        mean = sum(per_tensor(comp).decompress(per_tensor(comp).compress(g, "w")) for _ in range(trials)) / trials
        s = g.abs().max()
        stderr = (g.abs() * (s - g.abs())).sqrt() / trials**0.5
        assert ((mean - g).abs() <= 5 * stderr + 1e-6).float().mean() > 0.999, backend


# -- TernGrad compressor with backend="fused" --------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"bucket_size": 300}, {"scaler_share": "per_worker", "bucket_size": 300}, {"packing": "base3"},
     {"collective": "allreduce_int8"}, {"clip_mode": "code"}],
)
def test_fused_backend_keeps_the_compressor_contract(kwargs: dict) -> None:
    g0, g1 = torch.randn(1001), torch.randn(1001) * 2
    ranks = [TernGrad(seed=2, backend="fused", **kwargs), TernGrad(seed=2, backend="fused", **kwargs)]
    refs = [LayerTernGrad(seed=2, backend="torch", **kwargs), LayerTernGrad(seed=2, backend="torch", **kwargs)]
    for r, comp in enumerate([*ranks, *refs]):
        comp.setup(r % 2, 2, torch.device("cpu"))
    stats = [per_tensor(c).local_statistic(g, "w") for c, g in zip(ranks, (g0, g1))]
    shared = None if stats[0] is None else torch.maximum(stats[0], stats[1])  # type: ignore[arg-type]
    packets = [per_tensor(c).compress(g, "w", shared) for c, g in zip(ranks, (g0, g1))]
    for comp, ref, packet in zip(ranks, refs, packets):
        assert packet.nbytes == ref.payload_nbytes(1001)  # same wire size as the per-layer oracle
        # decoding is exact and the same as the oracle's per-layer torch ops
        assert torch.equal(per_tensor(comp).decompress(packet), per_tensor(ref).decompress(packet))
    total = per_tensor(ranks[0]).decompress_sum(packets)
    assert torch.equal(total, per_tensor(refs[1]).decompress_sum(packets))
    # decoding straight into a (bucket-view-like) destination gives the same bits as the oracle
    for comp in (ranks[0], refs[0]):
        bucket = torch.full((2003,), float("nan"))
        into = per_tensor(comp).decompress_sum_into(packets, bucket[1:1002])
        assert into.data_ptr() == bucket[1:].data_ptr() and torch.equal(into, total)
        assert bucket[0].isnan() and bucket[1002:].isnan().all()  # nothing written outside the view
    assert torch.equal(total, per_tensor(ranks[0]).decompress(packets[0]) + per_tensor(ranks[0]).decompress(packets[1]))
    assert 0.0 <= packets[0].stats["sparsity"].item() <= 1.0
    assert packets[0].stats["sparsity"].item() == pytest.approx((per_tensor(ranks[0]).decompress(packets[0]) == 0).float().mean().item())


def test_fused_backend_state_is_seed_and_counters_and_round_trips() -> None:
    g = torch.randn(4000)
    a = TernGrad(seed=3, backend="fused")
    a.setup(0, 2, torch.device("cpu"))
    per_tensor(a).compress(g, "w")
    state = a.state_dict()
    assert state["counters"] == {"w": 1}
    first = per_tensor(a).compress(g, "w").payload.clone()
    assert not torch.equal(per_tensor(a).compress(g, "w").payload, first)  # the counter moved on
    a.load_state_dict(state)
    assert torch.equal(per_tensor(a).compress(g, "w").payload, first)
    b = TernGrad(seed=3, backend="fused")
    b.setup(0, 2, torch.device("cpu"))
    b.load_state_dict(state)
    assert torch.equal(per_tensor(b).compress(g, "w").payload, first)
    other_rank = TernGrad(seed=3, backend="fused")
    other_rank.setup(1, 2, torch.device("cpu"))
    other_rank.load_state_dict(state)
    assert not torch.equal(per_tensor(other_rank).compress(g, "w").payload, first)


def test_statistic_reused_only_for_the_same_unmodified_tensor() -> None:
    comp = TernGrad(backend="fused", clip_factor=0.0)
    g = torch.randn(100)
    per_tensor(comp).local_statistic(g, "w")
    g.mul_(100)  # modified after the statistic: compress must not reuse the stale scaler
    packet = per_tensor(comp).compress(g, "w")
    assert packet.ctx["scale"].item() == pytest.approx(g.abs().max().item())


def test_backend_is_validated() -> None:
    with pytest.raises(ValueError, match="backend"):
        TernGrad(backend="cuda")  # type: ignore[arg-type]


# -- selection kernels -------------------------------------------------------------------------------------
def test_sample_threshold_and_select_equal_the_torch_reference(compiled: bool) -> None:
    x = torch.randn(100_003)
    x[::11] = 0.5  # ties at a likely threshold
    for mode in ("strided", "random"):
        key = kernels.stream_key(1, 0, 4)
        sample = kernels.sample_abs(x, 1000, mode, key)
        with kernels.torch_ops():
            sample_t = kernels.sample_abs(x, 1000, mode, key)
        assert torch.equal(sample, sample_t)
        for drop in (0.0, 0.5, 0.99, 0.999):
            thr = kernels.sample_threshold(sample, drop)
            k = kernels.quantile_rank(sample.numel(), drop)
            assert thr.item() == sample.sort().values[k].item()  # the exact order statistic
            with kernels.torch_ops():
                assert kernels.sample_threshold(sample, drop).item() == thr.item()
            index, values = kernels.select_above(x, thr)
            mask = x.abs() > thr
            assert index.dtype == torch.int32 and values.dtype == torch.float32
            assert torch.equal(index.long(), mask.nonzero().reshape(-1)) and torch.equal(values, x[mask])
    strided = kernels.sample_abs(x, 1000, "strided")
    assert torch.equal(strided, x[:: x.numel() // 1000][:1000].abs())


@pytest.mark.parametrize(("n", "bin_len"), [(1, 64), (64, 64), (1000, 64), (100_003, 50), (70_000, 5000)])
def test_adacomp_bin_max_and_selection_equal_the_reference(compiled: bool, n: int, bin_len: int) -> None:
    G = torch.randn(n)
    H = G + torch.randn(n)
    bins = -(-n // bin_len)
    padded = torch.cat((G.abs(), G.new_zeros(bins * bin_len - n))).view(bins, bin_len)
    gmax = padded.amax(dim=1)
    assert torch.equal(kernels.bin_absmax(G, bin_len), gmax)
    sel = kernels.adacomp_select(G, H, bin_len)
    mask = H.abs() >= gmax.repeat_interleave(bin_len)[:n]
    expected = mask.nonzero().reshape(-1)
    assert torch.equal(sel.gmax, gmax)
    assert torch.equal(sel.index.long(), expected) and torch.equal(sel.values, G[expected])
    assert torch.equal(sel.bin_index.long(), expected % bin_len)
    assert torch.equal(sel.counts.long(), torch.bincount(expected // bin_len, minlength=bins))
    with kernels.torch_ops():
        ref = kernels.adacomp_select(G, H, bin_len)
    for a, b in zip(sel, ref):
        assert torch.equal(a, b)


def test_sparse_decode_sums_in_rank_order_bit_identically(compiled: bool) -> None:
    n = 50_000
    indices, values = [], []
    for r in range(4):
        idx = torch.randperm(n)[:3000].sort().values.to(torch.int32)
        indices.append(idx)
        values.append(torch.randn(3000) * 10**r)  # magnitudes where summation order changes the bits
    expected = torch.zeros(n)
    for idx, val in zip(indices, values):
        expected.index_add_(0, idx.long(), val)
    assert torch.equal(kernels.sparse_decode_sum(n, indices, values), expected)
    with kernels.torch_ops():
        assert torch.equal(kernels.sparse_decode_sum(n, indices, values), expected)
    out = torch.full((n,), 7.0)
    assert kernels.sparse_decode_sum(n, indices, values, out=out) is out and torch.equal(out, expected)
    # repeated and unsorted indices within one payload add up in payload order
    idx = torch.tensor([5, 3, 5, 5], dtype=torch.int64)
    val = torch.tensor([1.0, 2.0, 1e8, -1e8])
    assert torch.equal(kernels.sparse_decode_sum(8, [idx], [val]), torch.zeros(8).index_add_(0, idx, val))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.sparse_decode_sum(4, [torch.tensor([4], dtype=torch.int32)], [torch.ones(1)])


def test_selection_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="drop_ratio"):
        kernels.sample_threshold(torch.rand(10), 1.0)
    with pytest.raises(ValueError, match="mode"):
        kernels.sample_abs(torch.rand(10), 5, "every")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bin_len"):
        kernels.bin_absmax(torch.rand(10), 0)
    with pytest.raises(ValueError, match="H"):
        kernels.adacomp_select(torch.rand(10), torch.rand(9), 4)


# -- fallback and devices ----------------------------------------------------------------------------------
def test_without_the_extension_one_warning_and_the_same_results() -> None:
    code = (
        "import torch\n"
        "from lightning_gradcomp import kernels\n"
        "from lightning_gradcomp.compressors import TernGrad\n"
        "from lightning_gradcomp.compressors.per_tensor import per_tensor\n"
        "assert not kernels.fused_available()\n"
        "c = TernGrad(backend='auto'); c.setup(0, 1, torch.device('cpu')); assert c.chosen_backend == 'torch'\n"
        "f = TernGrad(backend='fused'); g = torch.randn(999)\n"
        "p = per_tensor(f).compress(g, 'w'); kernels.select_above(g, 1.0); kernels.fused_available()\n"
        "print(p.payload.sum().item())\n"
    )
    env = {**os.environ, "LIGHTNING_GRADCOMP_NO_EXT": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("fused CPU kernels unavailable") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_path_equals_the_cpu_path() -> None:  # pragma: no cover - no GPU on CI
    g = torch.randn(100_003)
    s, clip = _scaler_and_clip(g, 4096)
    key = kernels.stream_key(1, 2, 3)
    cpu = layer_kernels.ternarize_pack(g, s, clip, 4096, key)[0]
    gpu = layer_kernels.ternarize_pack(g.cuda(), s.cuda(), clip.cuda(), 4096, key)[0]  # type: ignore[union-attr]
    assert torch.equal(cpu, gpu.cpu())
    assert torch.equal(layer_kernels.decode(cpu, g.numel(), s, 4096), layer_kernels.decode(gpu, g.numel(), s.cuda(), 4096).cpu())
    thr = torch.tensor(1.5)
    assert torch.equal(kernels.select_above(g, thr)[0], kernels.select_above(g.cuda(), thr)[0].cpu())


def test_extension_name_is_keyed_by_the_environment_not_only_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two venvs with the same torch and source differ in the paths torch writes into its ninja file; one shared
    # name made each environment's first use recompile over the other's build.
    import torch.utils.cpp_extension as cpp

    from lightning_gradcomp.kernels._build import build_inputs, cpu_source, extension_name

    CPU_SOURCE = cpu_source()

    here = extension_name(CPU_SOURCE, build_inputs())
    assert here == extension_name(CPU_SOURCE, build_inputs())  # stable: the cache is found again
    monkeypatch.setattr(cpp, "include_paths", lambda *a, **k: ["/other/venv/site-packages/torch/include"])
    assert extension_name(CPU_SOURCE, build_inputs()) != here
    monkeypatch.undo()
    monkeypatch.setattr(cpp, "library_paths", lambda *a, **k: ["/other/venv/site-packages/torch/lib"])
    assert extension_name(CPU_SOURCE, build_inputs()) != here
    monkeypatch.undo()
    monkeypatch.setattr("torch.__version__", "0.0.0")
    assert extension_name(CPU_SOURCE, build_inputs()) != here
    monkeypatch.undo()
    assert extension_name(CPU_SOURCE + " ", build_inputs()) != here


def test_the_translation_unit_includes_no_file_of_the_checkout() -> None:
    # a quoted include makes ninja track that file's modification time: a fresh checkout of the same source (same
    # extension name, newer files) would then recompile inside the first step, after is_compiled() said it need not
    import re

    from lightning_gradcomp.kernels._build import _source_texts, translation_unit

    unit = translation_unit()
    assert re.findall(r'^\s*#include\s+"', unit, flags=re.M) == []
    assert all(line in unit for text in _source_texts() for line in text.splitlines() if '#include "' not in line)


# -- counter-based uniforms of a group (QSGD, Int8) ------------------------------------------------------------
def test_compiled_group_uniforms_equal_the_torch_ops_draws(compiled: bool) -> None:
    """The compiled draw of a group's uniforms gives the torch ops' bits for every layer (empty ones draw nothing),
    and moves the same counters."""
    from lightning_gradcomp.compressors.streams import CounterStreams
    from lightning_gradcomp.flat import Segments

    shapes = [(5, 3), (0,), (1,), (70001,), (0, 2), (77,)]
    segments = Segments([f"l{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes])
    fast, reference = CounterStreams(3), CounterStreams(3)
    fast.reset(2)
    reference.reset(2)
    for _ in range(2):
        drawn = fast.uniform_flat(segments, torch.device("cpu"))
        with kernels.torch_ops():
            expected = reference.uniform_flat(segments, torch.device("cpu"))
        assert torch.equal(drawn, expected)
        assert fast.counters == reference.counters
    assert 0.0 <= float(drawn.min()) and float(drawn.max()) < 1.0 and drawn.unique().numel() > 0.99 * drawn.numel()
