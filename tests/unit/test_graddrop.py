"""Gradient Dropping: thresholds, drop rule, scopes, quantized survivors, wire sizes and argument checks."""

import math

import pytest
import torch

from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.graddrop import GradientDropping, Quantize, select_threshold, select_weighted_threshold
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.wire.sparse import IndexEncoding, delta16_nbytes
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.unit.feedback import feedback_step


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_exact_threshold_drops_the_smallest_ratio_with_marians_rule(backend: Backend) -> None:
    x = torch.arange(1, 1001, dtype=torch.float32) * torch.where(torch.arange(1000) % 2 == 0, 1.0, -1.0)
    comp = GradientDropping(drop_ratio=0.99, sample="exact", backend=backend)
    packet = per_tensor(comp).compress(x, "w")
    sent = per_tensor(comp).decompress(packet)
    # k = floor(0.99 * 1000) = 990: the 990th smallest |x| is 990, dropped (|x| <= thr); 991..1000 survive
    assert float(packet.stats["threshold"]) == 990.0
    assert torch.equal(torch.nonzero(sent).reshape(-1), torch.arange(990, 1000))
    assert torch.equal(sent[990:], x[990:])
    assert packet.nbytes == 10 * 8  # coo32: 32-bit index + 32-bit value


def test_strided_sample_is_marians() -> None:
    comp = GradientDropping(sample="strided", max_sample=1000)
    mags = torch.arange(2500, dtype=torch.float32)
    sample, weight = comp.threshold_sample(mags)
    # sortSize = 1000, stride = 2500 // 1000 = 2, from index 0
    assert torch.equal(sample, torch.arange(0, 2000, 2, dtype=torch.float32)) and weight == 2.5


def test_random_sample_size_and_small_tensors_exact() -> None:
    comp = GradientDropping(sample="random", sample_fraction=0.001, min_sample=1000)
    comp.setup(0, 1, torch.device("cpu"))
    sample, weight = comp.threshold_sample(torch.rand(3_000_000))
    assert sample.numel() == 3000 and weight == 1000.0
    small = torch.rand(500)
    sample, weight = comp.threshold_sample(small)
    assert sample is small and weight == 1.0
    # a 0.1% sample of a large tensor lands near the exact quantile
    x = torch.randn(2_000_000)
    sampled = float(select_threshold(comp.threshold_sample(x.abs())[0], 0.99))
    exact = float(select_threshold(x.abs(), 0.99))
    assert abs(sampled - exact) / exact < 0.05


def test_random_sample_state_is_counters_and_a_generator_checkpoint_is_refused() -> None:
    comp = GradientDropping(sample="random", min_sample=10, backend="torch")
    comp.setup(0, 1, torch.device("cpu"))
    x = torch.randn(5000)
    for _ in range(3):
        per_tensor(comp).compress(x, "w")
    state = comp.state_dict()
    assert state["counters"] == {"w": 3} and "streams" not in state
    resumed = GradientDropping(sample="random", min_sample=10, backend="torch")
    resumed.setup(0, 1, torch.device("cpu"))
    resumed.load_state_dict(state)
    assert torch.equal(per_tensor(resumed).compress(x, "w").payload, per_tensor(comp).compress(x, "w").payload)
    # a checkpoint from when the torch backend drew from a torch.Generator per name: those states are no counters
    legacy = {"counters": {}, "streams": {"w": ("cpu", torch.Generator().get_state())}}
    with pytest.raises(ValueError, match=r"Expected `GradientDropping`'s random-stream state to be per-name counters "
                                         r"but got torch.Generator states for \['w'\].*resume_compression='reset'"):
        resumed.load_state_dict(legacy)
    resumed.load_state_dict({"counters": {"w": 1}, "streams": {}})  # one that never drew on the torch backend loads
    assert resumed.state_dict()["counters"] == {"w": 1}


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_drop_ratio_zero_sends_every_nonzero_value(backend: Backend) -> None:
    x = torch.randn(40, 30)
    x[0, :5] = 0.0
    comp = GradientDropping(drop_ratio=0.0, backend=backend)
    sent = per_tensor(comp).decompress(per_tensor(comp).compress(x, "w"))
    assert torch.equal(sent, x)


def test_weighted_threshold_matches_exact_on_the_concatenation() -> None:
    parts = [torch.rand(1000) * s for s in (1.0, 10.0, 0.1)]
    together = select_threshold(torch.cat(parts), 0.9)
    assert torch.equal(select_weighted_threshold(parts, [1.0, 1.0, 1.0], 0.9), together)


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_global_scope_uses_the_previous_steps_whole_model_threshold(backend: Backend) -> None:
    comp = GradientDropping(drop_ratio=0.9, sample="exact", scope="global", backend=backend)
    small, large = torch.rand(1000), torch.rand(1000) * 100
    p0a = per_tensor(comp).compress(small, "a")
    per_tensor(comp).compress(large, "b")
    # step 0: per-layer thresholds (no pool yet)
    assert torch.equal(p0a.stats["threshold"], select_threshold(small.abs(), 0.9))
    p1a = per_tensor(comp).compress(small, "a")  # "a" again: step 1 uses the pool of step 0
    expected = select_threshold(torch.cat((small, large)).abs(), 0.9)
    assert torch.equal(p1a.stats["threshold"], expected)
    # a global threshold sends nothing of the small-scale layer and 20% of the large one
    assert int(p1a.stats["sent"]) == 0
    assert int(per_tensor(comp).compress(large, "b").stats["sent"]) == 200


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_global_state_round_trips(backend: Backend) -> None:
    comp = GradientDropping(scope="global", seed=3, backend=backend)
    comp.setup(0, 1, torch.device("cpu"))
    for name in ("a", "b", "a"):
        per_tensor(comp).compress(torch.randn(5000), name)
    state = comp.state_dict()
    clone = GradientDropping(scope="global", seed=3, backend=backend)
    clone.setup(0, 1, torch.device("cpu"))
    clone.load_state_dict(state)
    x = torch.randn(5000)
    assert torch.equal(per_tensor(comp).compress(x, "b").payload, per_tensor(clone).compress(x, "b").payload)


@pytest.mark.parametrize("quantize", ["threshold", "column_mean", "global_mean", "2bit"])
@pytest.mark.parametrize("index_encoding", ["coo32", "delta16"])
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_quantized_survivors(quantize: Quantize, index_encoding: IndexEncoding, backend: Backend) -> None:
    x = torch.randn(64, 100) * torch.linspace(0.1, 3.0, 100)  # columns on different scales
    comp = GradientDropping(drop_ratio=0.9, sample="exact", quantize=quantize, index_encoding=index_encoding, backend=backend)
    packet = per_tensor(comp).compress(x, "w")
    sent = per_tensor(comp).decompress(packet)
    keep = x.abs() > packet.stats["threshold"]
    assert torch.equal(sent != 0, keep) and torch.equal(torch.sign(sent[keep]), torch.sign(x[keep]))
    k = int(keep.sum())
    idx = torch.nonzero(keep.reshape(-1)).reshape(-1)
    levels = {"threshold": 1, "global_mean": 2, "2bit": 4, "column_mean": 200}[quantize]
    bits = 2 if quantize == "2bit" else 1
    index_bytes = 4 * k if index_encoding == "coo32" else delta16_nbytes(idx, "fp32") - 4 - 4 * k
    assert packet.nbytes == 4 + 4 * levels + math.ceil(k * bits / 8) + index_bytes
    if quantize == "threshold":
        assert torch.all(sent[keep].abs() == packet.stats["threshold"])
    if quantize == "global_mean":
        pos = x[keep & (x > 0)]
        torch.testing.assert_close(sent[keep & (x > 0)], torch.full_like(pos, float(pos.mean())))
    if quantize == "column_mean":
        col = 7
        members = x[:, col][keep[:, col] & (x[:, col] < 0)]
        torch.testing.assert_close(sent[:, col][keep[:, col] & (x[:, col] < 0)], torch.full_like(members, float(members.mean())))
    if quantize == "2bit":
        assert sent[keep & (x > 0)].unique().numel() == 2  # small and large movers apart


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_narrow_values_and_fp16_overflow_stays_in_residual(backend: Backend) -> None:
    x = torch.randn(1000) * 10
    x[5] = 1e6  # beyond fp16
    comp = GradientDropping(drop_ratio=0.9, sample="exact", values="fp16", backend=backend)
    memory = ResidualMemory()
    old, xc, packet, sent = feedback_step(comp, memory, x, "w")
    assert sent[5] == 0 and memory.residuals["w"][5] == 1e6 and float(packet.stats["overflow"]) == 1.0
    keep = (x.abs() > packet.stats["threshold"]) & (x.abs() < 65504)
    assert torch.equal(sent[keep], x[keep].half().float())
    bf = GradientDropping(drop_ratio=0.9, sample="exact", values="bf16", index_encoding="delta16", backend=backend)
    p = per_tensor(bf).compress(x, "w")
    assert p.nbytes == 4 + 100 * 2 + 2 * 100  # count, bf16 values, one gap code each (gaps < 65536)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"drop_ratio": 1.0}, "drop_ratio"),
        ({"drop_ratio": -0.1}, "drop_ratio"),
        ({"drop_ratio": float("nan")}, "drop_ratio"),
        ({"scope": "bucket"}, "scope"),
        ({"sample": "median"}, "sample"),
        ({"sample_fraction": 0.0}, "sample_fraction"),
        ({"min_sample": 0}, "min_sample"),
        ({"max_sample": 0}, "max_sample"),
        ({"quantize": "1bit"}, "quantize"),
        ({"index_encoding": "varint"}, "index_encoding"),
        ({"values": "int8"}, "values"),
        ({"quantize": "2bit", "values": "bf16"}, "values"),
        ({"quantize": "threshold", "drop_ratio": 0.0}, "drop_ratio"),
    ],
)
def test_bad_arguments_name_argument_and_fix(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        GradientDropping(**kwargs)
    assert "Fix" in str(info.value)


def test_registered_names_make_fresh_compressors() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_gradcomp  # noqa: F401  (registers the strategy names)
    from lightning_gradcomp import registry
    from lightning_gradcomp.compressors import AdaComp

    assert isinstance(registry.make_compressor("graddrop"), GradientDropping)
    assert isinstance(registry.make_compressor("AdaComp"), AdaComp)
    assert registry.make_compressor("graddrop") is not registry.make_compressor("graddrop")
    assert "graddrop" in StrategyRegistry and "adacomp" in StrategyRegistry


def _feedback_run(comp: GradientDropping, grads: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Error feedback over ``grads`` (one per step); per step (sent, new residual, stats["sent"]), after checking
    grad + old residual == sent + new residual exactly."""
    memory = ResidualMemory()
    out = []
    for grad in grads:
        old, x, packet, sent = feedback_step(comp, memory, grad, "w")
        residual = memory.residuals["w"]
        assert torch.equal(grad + (0 if old is None else old), sent + residual)
        assert float(packet.stats["sent"]) == int((sent != 0).sum())  # what it counts is what it sends
        out.append((sent, residual, float(packet.stats["sent"])))
    return out


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_threshold_quantizer_sends_the_survivors_when_the_threshold_is_zero(backend: Backend) -> None:
    # the audit's case: 1000 values, 3 non-zero, R = 0.99: the 990th smallest |x| is 0, so the threshold is 0
    grad = torch.zeros(1000)
    grad[[10, 500, 999]] = torch.tensor([2.0, -2.0, 2.0])
    comp = GradientDropping(drop_ratio=0.99, quantize="threshold", backend=backend)
    for sent, residual, _ in _feedback_run(comp, [grad] * 4):
        assert torch.equal(sent, grad)  # +-(smallest surviving |x|) = +-2: everything arrives
        assert torch.equal(residual, torch.zeros(1000))  # was 2, 4, 6, 8: nothing was ever sent
    # distinct magnitudes once, then nothing: the residual drains instead of waiting forever
    first = torch.zeros(1000)
    first[[3, 4, 5]] = torch.tensor([1.0, -2.0, 3.0])
    runs = _feedback_run(GradientDropping(drop_ratio=0.99, quantize="threshold", backend=backend), [first] + [torch.zeros(1000)] * 3)
    assert [float(r.abs().max()) for _, r, _ in runs] == [2.0, 1.0, 0.0, 0.0]
    assert [count for _, _, count in runs] == [3, 2, 1, 0]


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_threshold_quantizer_sends_a_one_element_tensor(backend: Backend) -> None:
    comp = GradientDropping(drop_ratio=0.99, quantize="threshold", backend=backend)
    grad = torch.tensor([0.3])
    for sent, residual, count in _feedback_run(comp, [grad] * 4):  # floor(0.99 * 1) = 0: threshold 0
        assert torch.equal(sent, grad) and torch.equal(residual, torch.zeros(1)) and count == 1


@pytest.mark.parametrize("quantize", ["none", "threshold"])
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_ties_at_the_threshold_are_sent_when_nothing_exceeds_it(backend: Backend, quantize: Quantize) -> None:
    # a two-class classifier's bias: its gradients are g and -g, so the threshold (the smallest |x|) ties with
    # every value; Marian's |x| <= threshold would drop both forever
    bias = torch.tensor([0.25, -0.25])
    comp = GradientDropping(drop_ratio=0.99, sample="exact", quantize=quantize, backend=backend)
    for sent, _residual, count in _feedback_run(comp, [bias] * 3):
        assert torch.equal(sent, bias) and count == 2
    # ties are sent only when nothing exceeds the threshold: here 0.5 does, so the tied 0.25s are dropped
    x = torch.tensor([0.25, -0.25, 0.25, 0.5])
    packet = per_tensor(GradientDropping(drop_ratio=0.5, sample="exact", backend=backend)).compress(x, "w")
    assert float(packet.stats["threshold"]) == 0.25 and float(packet.stats["sent"]) == 1
