"""TernGrad as pure tensor code: unbiasedness, exact levels, packing, byte counts, options, bad input."""

import pytest
import torch

from lightning_gradcomp.compressors import Aggregation, TernGrad
from lightning_gradcomp.compressors.terngrad import ClipMode
from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes, unpack_ternary
from lightning_gradcomp.compressors.per_tensor import per_tensor


def _mean_of_decodes(comp: TernGrad, g: torch.Tensor, trials: int) -> torch.Tensor:
    total = torch.zeros_like(g)
    for _ in range(trials):
        total += per_tensor(comp).decompress(per_tensor(comp).compress(g, "w"))
    return total / trials


@pytest.mark.parametrize("clip_mode", ["paper", "code"])
def test_unbiased_for_the_tensor_it_ternarizes(clip_mode: ClipMode) -> None:
    """E[s * t] equals the clipped gradient (no clipping: the gradient itself), within 5 standard errors."""
    g = torch.randn(2000)
    comp = TernGrad(clip_factor=0.0, clip_mode=clip_mode)
    trials = 400
    mean = _mean_of_decodes(comp, g, trials)
    s = g.abs().max()
    # per-element variance of s*Bernoulli(|g|/s) is |g|(s-|g|); standard error of the mean over trials
    stderr = (g.abs() * (s - g.abs())).sqrt() / trials**0.5
    assert ((mean - g).abs() <= 5 * stderr + 1e-6).float().mean() > 0.999
    # and the bias of the whole tensor is far below one element's noise
    assert (mean - g).mean().abs() < 0.01


def test_paper_clipping_is_unbiased_for_the_clipped_gradient() -> None:
    g = torch.randn(2000)
    g[:10] *= 20  # outliers that get clipped
    comp = TernGrad(clip_factor=2.5, clip_mode="paper")
    threshold = 2.5 * g.std(correction=0)
    clipped = g.clamp(-threshold, threshold)
    mean = _mean_of_decodes(comp, g, 400)
    assert torch.allclose(mean[:10], clipped[:10], atol=float(0.15 * threshold))
    assert (mean - clipped).mean().abs() < 0.01


def test_values_are_exactly_minus_s_zero_plus_s() -> None:
    g = torch.randn(64, 33)
    comp = TernGrad()
    packet = per_tensor(comp).compress(g, "w")
    out = per_tensor(comp).decompress(packet)
    s = packet.ctx["scale"]
    assert set(out.unique().tolist()) <= {-s.item(), 0.0, s.item()}
    assert out.shape == g.shape and out.dtype == g.dtype
    # signs never flip
    assert torch.all(out * g >= 0)


@pytest.mark.parametrize("packing", ["2bit", "base3"])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 7, 1000, 1001])
def test_packing_round_trips_with_exact_sizes(packing: str, n: int) -> None:
    t = torch.randint(-1, 2, (n,), dtype=torch.int8)
    packed = pack_ternary(t, packing)  # type: ignore[arg-type]
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, packing) == -(-n // (4 if packing == "2bit" else 5))  # type: ignore[arg-type]
    assert torch.equal(unpack_ternary(packed, n, packing), t)  # type: ignore[arg-type]


def test_2bit_layout_is_the_original_quarter_split() -> None:
    t = torch.tensor([-1, 0, 1, 1, 0, -1, -1, 1], dtype=torch.int8)  # quarters: [-1,0] [1,1] [0,-1] [-1,1]
    codes = (t + 1).to(torch.int32)
    expected = codes[0:2] + 4 * codes[2:4] + 16 * codes[4:6] + 64 * codes[6:8]
    assert pack_ternary(t, "2bit").tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("kwargs", "world", "nbytes"),
    [
        ({}, 2, 250),  # 1000 values, 4 per byte; the shared scaler travels in the max all-reduce
        ({"packing": "base3"}, 2, 200),
        ({"scaler_share": "per_worker"}, 2, 250 + 4),
        ({"scaler_share": "per_worker", "bucket_size": 300}, 2, 250 + 4 * 4),
        ({"collective": "allreduce_int8"}, 2, 1000),
        ({}, 8, 1000),  # auto: int8 all-reduce sends less than an all-gather from 8 ranks on
        ({"packing": "base3"}, 8, 200),  # ... and from 10 with base-3
    ],
)
def test_byte_count_equals_the_payload(kwargs: dict, world: int, nbytes: int) -> None:
    comp = TernGrad(**kwargs)
    comp.setup(0, world, torch.device("cpu"))
    packet = per_tensor(comp).compress(torch.randn(1000), "w")
    assert packet.nbytes == nbytes == comp.payload_nbytes(1000)
    assert packet.payload.numel() * packet.payload.element_size() == nbytes


def test_auto_collective_choice() -> None:
    comp = TernGrad()
    assert comp.travels(2) is Aggregation.GATHER
    assert comp.travels(7) is Aggregation.GATHER
    assert comp.travels(8) is Aggregation.SUM
    assert TernGrad(scaler_share="per_worker").travels(64) is Aggregation.GATHER


def test_code_mode_scaler_is_c_sigma_and_clips_implicitly() -> None:
    g = torch.randn(5000)
    g[0] = 50.0
    comp = TernGrad(clip_factor=2.5, clip_mode="code")
    s = per_tensor(comp).local_statistic(g, "w")
    assert s is not None
    assert torch.allclose(s, 2.5 * g.std(correction=0).reshape(1))
    out = per_tensor(comp).decompress(per_tensor(comp).compress(g, "w"))
    assert out[0] == s  # |g| >= s is always sent as +s


def test_paper_mode_scaler_is_max_of_clipped() -> None:
    g = torch.randn(5000)
    comp = TernGrad(clip_factor=2.5, clip_mode="paper")
    s = per_tensor(comp).local_statistic(g, "w")
    assert s is not None
    assert torch.allclose(s, torch.minimum(g.abs().max(), 2.5 * g.std(correction=0)).reshape(1))
    assert torch.allclose(per_tensor(TernGrad(clip_factor=0)).local_statistic(g, "w"), g.abs().max().reshape(1))  # type: ignore[arg-type]


def test_bucketed_scalers_one_per_chunk_including_a_partial_tail() -> None:
    g = torch.cat((torch.full((100,), 0.01), torch.full((100,), 10.0), torch.full((50,), 3.0)))
    comp = TernGrad(clip_factor=0.0, bucket_size=100)
    s = per_tensor(comp).local_statistic(g, "w")
    assert s is not None and s.tolist() == pytest.approx([0.01, 10.0, 3.0])
    out = per_tensor(comp).decompress(per_tensor(comp).compress(g, "w"))
    assert set(out[200:].unique().tolist()) <= {0.0, 3.0}


def test_shared_scaler_is_used_and_decode_sum_is_exact() -> None:
    g0, g1 = torch.randn(300), torch.randn(300) * 3
    a, b = TernGrad(seed=1), TernGrad(seed=1)
    a.setup(0, 2, torch.device("cpu"))
    b.setup(1, 2, torch.device("cpu"))
    shared = torch.maximum(per_tensor(a).local_statistic(g0, "w"), per_tensor(b).local_statistic(g1, "w"))  # type: ignore[arg-type]
    p0, p1 = per_tensor(a).compress(g0, "w", shared), per_tensor(b).compress(g1, "w", shared)
    assert torch.equal(p0.ctx["scale"], shared) and torch.equal(p1.ctx["scale"], shared)
    fast = per_tensor(a).decompress_sum([p0, p1])
    slow = per_tensor(a).decompress(p0) + per_tensor(a).decompress(p1)
    assert torch.equal(fast, slow)
    # ranks draw different random streams from the same seed
    half = torch.rand(1000) + 0.5
    two = torch.full((1,), 2.0)
    assert not torch.equal(per_tensor(a).compress(half, "v", two).payload, per_tensor(b).compress(half, "v", two).payload)


@pytest.mark.parametrize("backend", ["fused", "torch"])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("packing", ["2bit", "base3"])
def test_mean_into_equals_sum_into_then_division(backend: str, world: int, packing: str) -> None:
    """The hook's averaging (decode and divide in one pass where fused) rounds exactly like dividing afterwards."""
    comps = [TernGrad(seed=1, backend=backend, packing=packing) for _ in range(world)]  # type: ignore[arg-type]
    grads = [torch.randn(3001) * (r + 1) for r in range(world)]
    for r, comp in enumerate(comps):
        comp.setup(r, world, torch.device("cpu"))
    shared = torch.stack([per_tensor(c).local_statistic(g, "w") for c, g in zip(comps, grads)]).amax(0)  # type: ignore[misc]
    packets = [per_tensor(c).compress(g, "w", shared) for c, g in zip(comps, grads)]
    expected = per_tensor(comps[0]).decompress_sum_into(packets, torch.empty(3001)).div_(world)
    out = torch.full((3001,), float("nan"))
    assert per_tensor(comps[0]).decompress_mean_into(packets, out) is out
    assert torch.equal(out, expected)
    strided = torch.full((3001, 2), float("nan"))[:, 0]  # not contiguous: the fused kernel cannot write it
    assert torch.equal(per_tensor(comps[0]).decompress_mean_into(packets, strided), expected)


def test_constant_and_one_element_tensors_still_learn() -> None:
    """sigma = 0 must not clip to zero: the expected decode equals the gradient."""
    for mode in ("paper", "code"):
        comp = TernGrad(clip_factor=2.5, clip_mode=mode)
        for g in (torch.tensor([0.3]), torch.full((50,), -0.2)):
            assert torch.allclose(_mean_of_decodes(comp, g, 50), g)


def test_seeded_and_reproducible_and_state_round_trips() -> None:
    g = torch.randn(1000)
    a = TernGrad(seed=3)
    a.setup(0, 2, torch.device("cpu"))
    state = a.state_dict()
    first = per_tensor(a).compress(g, "w").payload.clone()
    a.load_state_dict(state)
    assert torch.equal(per_tensor(a).compress(g, "w").payload, first)
    b = TernGrad(seed=3)
    b.setup(0, 2, torch.device("cpu"))
    assert torch.equal(per_tensor(b).compress(g, "w").payload, first)


def test_zero_gradient_sends_zeros() -> None:
    comp = TernGrad()
    out = per_tensor(comp).decompress(per_tensor(comp).compress(torch.zeros(10), "w"))
    assert torch.equal(out, torch.zeros(10))


def test_low_precision_gradients_decode_to_their_dtype() -> None:
    comp = TernGrad()
    for dtype in (torch.float16, torch.bfloat16):
        out = per_tensor(comp).decompress(per_tensor(comp).compress(torch.randn(100).to(dtype), "w"))
        assert out.dtype == dtype


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"clip_factor": -1.0}, "clip_factor"),
        ({"clip_factor": float("inf")}, "clip_factor"),
        ({"clip_mode": "tf"}, "clip_mode"),
        ({"scaler_share": "mean"}, "scaler_share"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"bucket_size": 2.5}, "bucket_size"),
        ({"packing": "3bit"}, "packing"),
        ({"collective": "nccl"}, "collective"),
        ({"seed": -1}, "seed"),
        ({"collective": "allreduce_int8", "scaler_share": "per_worker"}, "scaler_share"),
    ],
)
def test_bad_configuration_names_argument_value_and_fix(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument) as info:
        TernGrad(**kwargs)
    message = str(info.value)
    assert repr(next(iter(kwargs.values()))) in message or "Use" in message or "Fix" in message


def test_int8_allreduce_refuses_more_than_127_ranks() -> None:
    with pytest.raises(ValueError, match="world size"):
        TernGrad(collective="allreduce_int8").setup(0, 128, torch.device("cpu"))


def test_a_checkpoint_of_per_layer_generator_streams_is_refused_and_an_empty_one_loads() -> None:
    """Per-name ``torch.Generator`` states (``"streams"``) cannot continue as counters: resuming from them would draw
    other bits than the uninterrupted run, so they are refused; an empty ``"streams"`` (nothing drawn) loads."""
    comp = TernGrad(seed=1, backend="torch")
    comp.setup(0, 2, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="resume_compression='reset'"):
        comp.load_state_dict({"streams": {"w": ("cpu", generator.get_state())}, "counters": {}})
    comp.load_state_dict({"streams": {}, "counters": {"w": 2}})
    assert comp.state_dict() == {"counters": {"w": 2}}
