"""The baseline compressors as pure tensor code: exact sizes, invariants, and parity with their references."""

import math
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import pytest
import torch

from lightning_gradcomp.wire.bits import pack_bits, packed_bits_nbytes, unpack_bits
from lightning_gradcomp.compressors import BF16, DGC, FP16, QSGD, OneBit, PowerSGD, TopK, dgc_code_warmup
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.onebit import Granularity
from lightning_gradcomp.compressors.powersgd import orthogonalize_
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.registry import compressor_names, make_compressor
from lightning_gradcomp.compressors.per_tensor import per_tensor


C = TypeVar("C", bound=Compressor)


def _ready(compressor: C, rank: int = 0, world_size: int = 1) -> C:
    compressor.setup(rank, world_size, torch.device("cpu"))
    return compressor


def test_baselines_are_registered() -> None:
    assert {"fp32", "fp16", "bf16", "powersgd", "topk", "dgc", "onebit", "qsgd"} <= set(compressor_names())


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 9])
def test_pack_bits_round_trips_with_exact_size(width: int) -> None:
    values = torch.randint(0, 2**width, (1003,))
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bits_nbytes(1003, width) == math.ceil(1003 * width / 8)
    assert torch.equal(unpack_bits(packed, 1003, width), values.int())


@pytest.mark.parametrize("cls,dtype", [(FP16, torch.float16), (BF16, torch.bfloat16)])
def test_cast_sends_two_bytes_per_element_and_sums_to_the_mean(cls: Callable[[], Compressor], dtype: torch.dtype) -> None:
    a, b = torch.randn(7, 9), torch.randn(7, 9)
    ranks = [_ready(cls(), r, 2) for r in range(2)]
    packets = [per_tensor(c).compress(x, "w") for c, x in zip(ranks, (a, b))]
    assert all(p.payload.dtype == dtype and p.nbytes == 2 * 63 for p in packets)
    summed = packets[0].with_payload(packets[0].payload + packets[1].payload)  # what the all-reduce delivers
    mean = per_tensor(ranks[0]).decompress(summed) / 2
    expected = (a / 2).to(dtype) + (b / 2).to(dtype)  # torch's compress hooks: divide, cast, sum in the cast dtype
    torch.testing.assert_close(mean, expected.float(), rtol=0, atol=0)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_onebit_error_feedback_invariant_and_exact_size(granularity: Granularity) -> None:
    compressor = _ready(OneBit(granularity))
    memory = ResidualMemory()
    for _ in range(4):
        grad = torch.randn(12, 10)
        old = memory.residuals.get("w", torch.zeros_like(grad)).clone()
        x = memory.compensate(grad, "w")
        packet = per_tensor(compressor).compress(x, "w")
        sent = per_tensor(compressor).sent(x, packet)
        memory.update("w", x, sent)
        torch.testing.assert_close(grad + old, sent + memory.residuals["w"], rtol=0, atol=1e-6)
        groups = 12 if granularity == "row" else 1
        assert packet.nbytes == math.ceil(120 / 8) + 8 * groups
        # two values per group, the means of each sign: the group's sum is carried exactly
        rows = x.view(groups, -1)
        torch.testing.assert_close(sent.view(groups, -1).sum(1), rows.sum(1), rtol=1e-5, atol=1e-5)
        assert torch.equal(sent >= 0, x >= 0)


def test_qsgd_is_unbiased_and_sized_exactly() -> None:
    compressor = _ready(QSGD(levels=3, bucket_size=16))
    x = torch.randn(10, 10)
    assert per_tensor(compressor).compress(x, "w").nbytes == math.ceil(100 * 3 / 8) + 4 * 7 == compressor.payload_nbytes(100)
    samples = torch.stack([per_tensor(compressor).decompress(per_tensor(compressor).compress(x, "w")) for _ in range(4000)])
    # each element's sample mean is within 5 standard errors of the true value (plus float rounding); the
    # standard error is the exact one of a Bernoulli(frac) step of size norm/s
    norms = torch.nn.functional.pad(x.reshape(-1), (0, 12)).view(-1, 16).norm(dim=1).repeat_interleave(16)[:100]
    r = x.reshape(-1).abs() / norms * 3
    frac = r - r.floor()
    standard_error = norms / 3 * (frac * (1 - frac)).sqrt() / math.sqrt(4000)
    excess = (samples.mean(0).reshape(-1) - x.reshape(-1)).abs() - 5 * standard_error
    assert excess.max() < 1e-5, excess.max()
    # every decoded value is a level of its bucket's norm
    levels = samples[0].reshape(-1).abs() / norms * 3
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)


def test_qsgd_levels_can_be_scheduled() -> None:
    compressor = QSGD(levels=7)
    assert compressor.width == 4
    compressor.levels = 1
    assert compressor.width == 2
    with pytest.raises(ValueError, match="levels"):
        compressor.levels = 0


def test_topk_sends_the_largest_and_keeps_the_rest() -> None:
    compressor = _ready(TopK(ratio=0.05))
    memory = ResidualMemory()
    grad = torch.randn(40, 20)
    x = memory.compensate(grad, "w")
    packet = per_tensor(compressor).compress(x, "w")
    sent = per_tensor(compressor).decompress(packet)
    memory.update("w", x, sent)
    k = math.ceil(800 * 0.05)
    assert packet.nbytes == 8 * k
    assert torch.equal(sent.reshape(-1).abs().topk(k).values, x.reshape(-1).abs().topk(k).values)
    assert torch.equal(sent + memory.residuals["w"], x)
    # sum over ranks = sum of decodes
    other = per_tensor(compressor).compress(torch.randn(40, 20), "w")
    torch.testing.assert_close(per_tensor(compressor).decompress_sum([packet, other]), sent + per_tensor(compressor).decompress(other))
    # 1-D tensors travel dense, as DGC's code does
    bias = torch.randn(20)
    assert torch.equal(per_tensor(compressor).decompress(per_tensor(compressor).compress(bias, "b")), bias)


def test_dgc_sampled_threshold_selects_about_k_large_elements() -> None:
    compressor = _ready(DGC(ratio=0.001))
    x = torch.randn(400, 500)  # 2-D: 1-D tensors are sent dense
    sent = per_tensor(compressor).sent(x, per_tensor(compressor).compress(x, "w")).reshape(-1)
    x = x.reshape(-1)
    indices = torch.nonzero(sent).reshape(-1)
    k = 200
    assert 0.8 * k <= indices.numel() <= k
    assert torch.equal(sent[indices], x[indices])  # sent exactly
    assert x.abs()[indices].min() >= x.abs().topk(3 * k).values[-1]  # near the top, not arbitrary
    assert compressor.sampling(200_000)[0] > 1  # sampled, not exact


def test_dgc_code_warmup_is_not_the_paper_schedule() -> None:
    values = dgc_code_warmup(0.001, 5)
    torch.testing.assert_close(torch.tensor(values), torch.tensor([0.316228, 0.1, 0.0316228, 0.01, 0.00316228, 0.001]))


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_matches_torch(rank: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    m = torch.randn(30, rank)
    reference = m.clone().unsqueeze(0)
    _orthogonalize(reference)
    torch.testing.assert_close(orthogonalize_(m.clone()), reference[0], rtol=1e-5, atol=1e-6)


def test_powersgd_full_rank_is_exact_and_small_tensors_go_dense() -> None:
    compressor = _ready(PowerSGD(rank=6, min_compression_rate=0.0))
    x = torch.randn(6, 10)
    packet = per_tensor(compressor).compress(x, "w")
    assert packet.nbytes == 4 * (6 + 10) * 6
    torch.testing.assert_close(per_tensor(compressor).decompress(packet), x, rtol=1e-4, atol=1e-5)
    assert PowerSGD(rank=1).plan(torch.Size([3, 3])) is None  # (3+3)*1*2 >= 9: not worth compressing
    assert PowerSGD(rank=1).plan(torch.Size([64])) is None
    assert PowerSGD(rank=1).plan(torch.Size([64, 20])) == (64, 20, 1)


@pytest.mark.parametrize("name", ["topk", "dgc", "onebit", "qsgd", "powersgd", "fp16"])
def test_bad_arguments_name_the_argument(name: str) -> None:
    cls = type(make_compressor(name))
    cases: dict[str, Optional[dict[str, Any]]] = {
        "topk": {"ratio": 0.0}, "dgc": {"sample_ratio": 2.0}, "onebit": {"granularity": "col"},
        "qsgd": {"bucket_size": 0}, "powersgd": {"rank": 0}, "fp16": None,
    }  # fmt: skip
    bad = cases[name]
    if bad is None:
        from lightning_gradcomp.compressors import Cast

        with pytest.raises(ValueError, match="dtype"):
            Cast(torch.float32)
        return
    with pytest.raises(ValueError, match=next(iter(bad))):
        cls(**bad)


def test_powersgd_survives_a_layer_without_gradient() -> None:
    compressor = _ready(PowerSGD(rank=1))
    zero = torch.zeros(32, 16)
    assert torch.equal(per_tensor(compressor).decompress(per_tensor(compressor).compress(zero, "w")), zero)  # torch's maths would give NaN
