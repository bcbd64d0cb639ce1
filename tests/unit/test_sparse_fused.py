"""The sparse compressors' fused backend against their torch backend: same survivors, same bytes, same sums.

Both backends run on the same tensors of awkward sizes (1 element, partial last bins, sizes around tile
boundaries), with ties at the threshold, all-zero tensors and every quantizer and wire format; payloads and
thresholds must be bit-identical, and decoded sums of 4 payloads equal; the random sample too (both backends draw
from the same counter-based streams), whose statistical property (threshold near the exact quantile) and
determinism are tested as well.
"""

from collections.abc import Iterator

import pytest
import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.graddrop import select_threshold
from lightning_gradcomp.compressors.backends import fused_enabled
from lightning_gradcomp.compressors.per_tensor import per_tensor

SIZES = (1, 2, 7, 50, 51, 999, 16_385, 40_000)


@pytest.fixture(params=[True, False], ids=["compiled", "torch-ops"])
def compiled(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The fused backend on the compiled kernels, and on their torch-ops path (no compiler, CUDA)."""
    if request.param:
        if not kernels.fused_available():
            pytest.skip("the CPU extension does not compile here")
        yield True
    else:
        with kernels.torch_ops():
            yield False


def _tensors(n: int, seed: int) -> Iterator[torch.Tensor]:
    """Gaussian values; small integers (many ties, at any threshold); zeros with a few spikes; all zeros."""
    gen = torch.Generator().manual_seed(seed)
    yield torch.randn(n, generator=gen) * 3
    yield torch.randint(-3, 4, (n,), generator=gen).float()
    spikes = torch.zeros(n)
    spikes[torch.randint(n, (max(1, n // 100),), generator=gen)] = -2.0
    yield spikes
    yield torch.zeros(n)


def _pair(make: type, **kwargs: object) -> tuple[Compressor, Compressor]:
    ref, fused = make(backend="torch", **kwargs), make(backend="fused", **kwargs)
    for comp in (ref, fused):
        comp.setup(0, 4, torch.device("cpu"))
    return ref, fused


def _assert_same_packets(a: Packet, b: Packet, what: str) -> None:
    assert a.payload.dtype == b.payload.dtype and torch.equal(a.payload, b.payload), f"{what}: payloads differ"
    assert a.stats.keys() == b.stats.keys()
    for key in a.stats:
        assert torch.equal(a.stats[key], b.stats[key]), f"{what}: stat {key} differs"


def _assert_same_sums(ref: Compressor, fused: Compressor, packets: list[Packet], what: str) -> None:
    expected, got = per_tensor(ref).decompress_sum(packets), per_tensor(fused).decompress_sum(packets)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected), f"{what}: decoded sums differ"
    # straight into a view of a larger buffer (the hook's DDP bucket): the same sum, nothing written outside
    n = packets[0].numel
    for comp in (ref, fused):
        bucket = torch.full((n + 3,), float("nan"), dtype=expected.dtype)
        view = bucket[1 : n + 1].view(expected.shape)
        into = per_tensor(comp).decompress_sum_into(packets, view)
        assert into.data_ptr() == view.data_ptr() and torch.equal(into, expected), f"{what}: decompress_sum_into"
        assert bucket[0].isnan() and bucket[n + 1 :].isnan().all(), f"{what}: wrote outside the view"


GRADDROP = [
    {"sample": "exact"},
    {"sample": "strided", "max_sample": 37},
    {"sample": "random", "min_sample": 1_000_000},  # every tensor here is no larger: selected exactly
    {"sample": "random", "min_sample": 20, "sample_fraction": 0.01},  # drawn where larger than 20: the same positions
    {"sample": "exact", "drop_ratio": 0.0},
    {"sample": "exact", "drop_ratio": 0.5, "index_encoding": "delta16", "values": "bf16"},
    {"sample": "strided", "max_sample": 100, "values": "fp16"},
    {"sample": "exact", "quantize": "threshold", "drop_ratio": 0.9},
    {"sample": "strided", "max_sample": 300, "quantize": "column_mean", "index_encoding": "delta16"},
    {"sample": "exact", "quantize": "global_mean", "drop_ratio": 0.7},
    {"sample": "exact", "quantize": "2bit", "drop_ratio": 0.95, "index_encoding": "delta16"},
]


@pytest.mark.parametrize("kwargs", GRADDROP, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_graddrop_fused_sends_the_torch_backends_bytes(compiled: bool, kwargs: dict) -> None:
    ref, fused = _pair(GradientDropping, **kwargs)
    for n in SIZES:
        packets = []
        for j, x in enumerate(_tensors(n, n)):
            x = x.view(-1, 5) if n % 5 == 0 else x  # 2-D: column means per column
            if kwargs.get("values") == "fp16" and j == 0:
                x = x * 1e4  # some survivors beyond fp16's range: the overflow rule must agree
            a, b = per_tensor(ref).compress(x, "w"), per_tensor(fused).compress(x, "w")
            _assert_same_packets(a, b, f"n={n} tensor {j}")
            assert torch.equal(per_tensor(ref).decompress(a), per_tensor(fused).decompress(b))
            packets.append(a)
        _assert_same_sums(ref, fused, packets, f"n={n}")


def test_graddrop_global_scope_is_the_same_on_both_backends(compiled: bool) -> None:
    ref, fused = _pair(GradientDropping, scope="global", sample="strided", max_sample=500, drop_ratio=0.9)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        for name, n in (("a", 1), ("b", 3000), ("c", 40_000)):
            x = torch.randn(n, generator=gen) * (10.0 if name == "c" else 1.0)
            _assert_same_packets(per_tensor(ref).compress(x, name), per_tensor(fused).compress(x, name), f"step {step} {name}")


def test_graddrop_random_sample_is_statistically_the_papers_and_deterministic(compiled: bool) -> None:
    """The random sample's statistical property and its state (the draws both backends share)."""
    x = torch.randn(2_000_000)
    exact = float(select_threshold(x.abs(), 0.99))
    comp = GradientDropping(sample="random", backend="fused")
    comp.setup(1, 4, torch.device("cpu"))
    assert comp.kernels(x.device).name == "fused"
    sample, weight = comp.threshold_sample(x.abs(), "w")
    assert sample.numel() == 2000 and weight == 1000.0  # 0.1%
    comp.setup(1, 4, torch.device("cpu"))  # counters start afresh
    thresholds = []
    for _ in range(20):  # 20 independent samples (the per-name counter moves on)
        packet = per_tensor(comp).compress(x, "w")
        thr = packet.stats["threshold"]
        # the survivors are exactly |x| > threshold, whatever the sample was
        assert int(packet.stats["sent"]) == int((x.abs() > thr).sum())
        thresholds.append(float(thr))
    rel = torch.tensor(thresholds) / exact - 1
    # the 99% quantile of |x| from 2000 draws: relative standard error ~3%, so each within 5 of them, the mean of 20
    # within 4 (and the stream is deterministic: this cannot flake)
    assert rel.abs().max() < 0.15 and abs(float(rel.mean())) < 0.03
    assert len(set(thresholds)) > 10, "the samples did not change between steps"
    # the same seed, rank and counters draw the same samples; another rank draws others
    again = GradientDropping(sample="random", backend="fused")
    again.setup(1, 4, torch.device("cpu"))
    other = GradientDropping(sample="random", backend="fused")
    other.setup(2, 4, torch.device("cpu"))
    first = [float(per_tensor(again).compress(x, "w").stats["threshold"]) for _ in range(3)]
    assert first == thresholds[:3]
    assert [float(per_tensor(other).compress(x, "w").stats["threshold"]) for _ in range(3)] != first
    # the counters are the stream's whole state: they round-trip
    state = comp.state_dict()
    assert state["counters"] == {"w": 20}
    restored = GradientDropping(sample="random", backend="fused")
    restored.setup(1, 4, torch.device("cpu"))
    restored.load_state_dict(state)
    assert torch.equal(per_tensor(restored).compress(x, "w").payload, per_tensor(comp).compress(x, "w").payload)


ADACOMP = [
    {},
    {"quantizer": "ternary"},
    {"wire": "index32"},
    {"quantizer": "ternary", "wire": "index32", "scale_factor": 1.0},
    {"scale_factor": 3.0},
    {"selection": "local", "local_count": 2},  # no kernel: torch ops on both backends
]


@pytest.mark.parametrize("kwargs", ADACOMP, ids=lambda k: "-".join(f"{v}" for v in k.values()) or "default")
@pytest.mark.parametrize("bin_len", [1, 7, 50, 500])
def test_adacomp_fused_sends_the_torch_backends_bytes(compiled: bool, kwargs: dict, bin_len: int) -> None:
    ref, fused = _pair(AdaComp, bin_size_fc=bin_len, **kwargs)
    for n in SIZES:
        packets = []
        for j, (x, dw) in enumerate(zip(_tensors(n, n), _tensors(n, n + 1))):
            for comp in (ref, fused):
                per_tensor(comp).observe_gradient(dw, "w")
            a, b = per_tensor(ref).compress(x, "w"), per_tensor(fused).compress(x, "w")
            _assert_same_packets(a, b, f"n={n} tensor {j}")
            assert a.ctx == b.ctx
            assert torch.equal(per_tensor(ref).decompress(a), per_tensor(fused).decompress(b))
            packets.append(a)
        _assert_same_sums(ref, fused, packets, f"n={n}")


def test_decoded_sums_of_quiet_ranks_and_other_dtypes() -> None:
    ref, fused = _pair(GradientDropping, sample="exact", drop_ratio=0.5)
    x = torch.randn(30, 4)
    loud, quiet = per_tensor(ref).compress(x, "w"), per_tensor(ref).compress(torch.zeros(30, 4), "w")
    assert quiet.nbytes == 0
    for packets in ([quiet, quiet], [quiet, loud, quiet, loud], [loud]):
        _assert_same_sums(ref, fused, packets, f"{len(packets)} packets")
    # a bf16 gradient: the torch backend adds decoded bf16 tensors, so the fused backend does the same
    half = [per_tensor(ref).compress(x.bfloat16(), "w") for _ in range(3)]
    _assert_same_sums(ref, fused, half, "bf16")
    assert per_tensor(fused).decompress_sum(half).dtype == torch.bfloat16


@pytest.mark.parametrize("make", [GradientDropping, AdaComp])
def test_backend_is_validated_and_auto_follows_the_kernels(make: type) -> None:
    with pytest.raises(ValueError, match="`backend`") as info:
        make(backend="cuda")
    assert "Fix" in str(info.value)
    assert make().backend == "auto" and make().describe()["backend"] == "auto"
    cpu = torch.device("cpu")
    assert fused_enabled("auto", cpu) == kernels.fused_available()
    assert fused_enabled("fused", cpu) and not fused_enabled("torch", cpu)


@pytest.mark.parametrize("bin_len", [1, 7, 63, 64, 500, 16384])
def test_bin_words_equal_the_wire_module_with_long_gaps(compiled: bool, bin_len: int) -> None:
    from lightning_gradcomp.wire.sparse import decode_bin_relative, encode_bin_relative

    gen = torch.Generator().manual_seed(bin_len)
    n = 64 * 16384 * 2 + 5  # 16-bit words at bin_len 64: 32768 bins, more than one marker (16383 bins) can skip
    payloads, expected = [], torch.zeros(n)
    for r, count in enumerate((0, 1, 300, 3000)):
        idx = torch.randperm(n, generator=gen)[:count].sort().values
        if count == 1:  # the last element: an advance of (n - 1) // bin_len bins, several markers
            idx = torch.tensor([n - 1])
        if count == 300:  # a tail cluster: a gap across many bins, then adjacent bins and equal offsets
            idx = torch.cat((idx[idx < n // 3], torch.arange(n - 40, n, 2)))
        codes = torch.randint(0, 3, (idx.numel(),), generator=gen)
        words = kernels.bin_words_encode(idx, codes, bin_len)
        assert torch.equal(words, encode_bin_relative(idx, codes, bin_len)), f"payload {r}"
        back, back_codes = decode_bin_relative(words, bin_len)
        assert torch.equal(back, idx) and torch.equal(back_codes, codes)
        scale = torch.rand(1, generator=gen) * 10 ** r
        payloads.append(torch.cat((scale.view(torch.uint8), words)) if count else torch.zeros(0, dtype=torch.uint8))
        expected.index_add_(0, idx, (codes - 1).float() * scale)
    assert torch.equal(kernels.bin_words_decode_sum(n, payloads, bin_len), expected)
    out = torch.full((n,), 3.0)
    assert kernels.bin_words_decode_sum(n, payloads, bin_len, out=out) is out and torch.equal(out, expected)


def test_bin_words_reject_what_they_cannot_encode() -> None:
    if not kernels.fused_available():
        pytest.skip("the CPU extension does not compile here")
    with pytest.raises(RuntimeError, match="ascending"):
        kernels.bin_words_encode(torch.tensor([5, 3]), torch.tensor([0, 2]), 50)
    with pytest.raises(RuntimeError, match="codes"):
        kernels.bin_words_encode(torch.tensor([5]), torch.tensor([3]), 50)
    words = kernels.bin_words_encode(torch.tensor([99]), torch.tensor([2]), 50)
    payload = torch.cat((torch.ones(1).view(torch.uint8), words))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.bin_words_decode_sum(60, [payload], 50)
    with pytest.raises(ValueError, match="bin_size"):
        kernels.bin_words_encode(torch.tensor([5]), torch.tensor([2]), 20000)
