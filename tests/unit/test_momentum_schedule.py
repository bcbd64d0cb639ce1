"""Momentum correction, local gradient clipping and compression schedules, in one process."""

import pytest
import torch

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import (
    CompressionSchedule,
    LocalGradientClipping,
    MomentumCorrect,
    MomentumCorrection,
    NormClip,
    SigmaClipping,
)
from lightning_gradcomp.compressors import DGC_PAPER_WARMUP, Identity, TopK
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.compressors.per_tensor import per_tensor


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_without_compression_is_sgd_momentum(nesterov: bool) -> None:
    """MC (masking on) + fp32 + SGD(momentum=0) follows SGD(momentum=m, weight_decay=wd) to float tolerance."""
    torch.manual_seed(0)
    target = torch.randn(8, 5)
    reference = torch.nn.Parameter(torch.randn(8, 5))
    ours = torch.nn.Parameter(reference.detach().clone())
    sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    plain = torch.optim.SGD([ours], lr=0.1)
    callback = MomentumCorrection(momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    transform = callback.make_transform(GradCompStrategy(compressor="fp32"))
    identity = Identity()
    for _ in range(6):
        for p, opt in ((reference, sgd), (ours, plain)):
            opt.zero_grad()
            ((p - target) ** 2).sum().backward()
        assert ours.grad is not None
        x = transform.before_compress(ours.grad, "w")
        sent = per_tensor(identity).sent(x, per_tensor(identity).compress(x, "w"))
        transform.after_compress("w", x, sent)
        ours.grad.copy_(sent)  # what the hook writes back (one rank: the mean is its own)
        callback.on_before_optimizer_step(None, None, plain)  # type: ignore[arg-type]
        sgd.step()
        plain.step()
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_momentum_factor_masking_clears_only_what_a_sparsifier_sent() -> None:
    transform = MomentumCorrect(0.9)
    topk = TopK(ratio=0.25)
    memory = ResidualMemory()
    grad = torch.arange(1.0, 9.0)
    topk.dense_1d = False
    x = memory.compensate(transform.before_compress(grad, "w"), "w")
    sent = per_tensor(topk).decompress(per_tensor(topk).compress(x, "w"))
    memory.update("w", x, sent)
    transform.after_compress("w", x, sent)
    sent_mask = sent != 0
    assert sent_mask.sum() == 2
    assert torch.equal(transform.u["w"][sent_mask], torch.zeros(2))
    assert torch.equal(transform.u["w"][~sent_mask], grad[~sent_mask])
    assert torch.equal(memory.residuals["w"][sent_mask], torch.zeros(2))  # v cleared where sent, too


def test_momentum_correction_refuses_optimizer_momentum_and_weight_decay() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"momentum=0\)` and `MomentumCorrection\(momentum=0.9\)"):
        MomentumCorrection.check_optimizers([torch.optim.SGD(p, lr=0.1, momentum=0.9)], 0.9)
    with pytest.raises(ValueError, match="betas"):
        MomentumCorrection.check_optimizers([torch.optim.Adam(p)], 0.9)
    with pytest.raises(ValueError, match=r"MomentumCorrection\(weight_decay=0.0001\)"):
        MomentumCorrection.check_optimizers([torch.optim.SGD(p, lr=0.1, weight_decay=1e-4)], 0.9)
    MomentumCorrection.check_optimizers([torch.optim.SGD(p, lr=0.1)], 0.9)
    with pytest.raises(ValueError, match="momentum"):
        MomentumCorrection(momentum=1.0)


def test_local_gradient_clipping_scales_the_threshold_by_inverse_sqrt_world() -> None:
    clip = LocalGradientClipping(max_norm=2.0).make_transform(GradCompStrategy(compressor="fp32"))
    assert isinstance(clip, NormClip)
    clip.setup(["w"], 0, 4)
    big, small = torch.full((16,), 1.0), torch.full((16,), 0.01)
    torch.testing.assert_close(clip.before_compress(big, "w").norm(), torch.tensor(1.0))  # 2 / sqrt(4)
    assert clip.clipped_fraction["w"] == 1.0
    assert torch.equal(clip.before_compress(small, "w"), small)
    assert clip.clipped_fraction["w"] == 0.0


def test_clipping_must_come_before_momentum_correction() -> None:
    strategy = GradCompStrategy(compressor="fp32")
    strategy.add_transform(MomentumCorrection().make_transform(strategy))
    for callback in (LocalGradientClipping(1.0), SigmaClipping(2.5)):
        with pytest.raises(ValueError, match="before MomentumCorrection"):
            callback.make_transform(strategy)


def test_schedule_values_over_epochs_and_steps() -> None:
    warmup = CompressionSchedule.dgc_warmup()
    assert [warmup.value_at(e, 0) for e in range(7)] == list(DGC_PAPER_WARMUP) + [0.001, 0.001]
    steps = CompressionSchedule("ratio", [0.5, 0.1], unit="step", period=3, dense_steps=2)
    assert [steps.value_at(0, s) for s in range(8)] == [0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1]
    assert CompressionSchedule(dense_steps=3).value_at(5, 5) is None


class _FakeTrainer:
    def __init__(self, strategy: GradCompStrategy) -> None:
        self.strategy = strategy


def test_schedule_fails_before_training_on_a_bad_attribute_or_value() -> None:
    strategy = GradCompStrategy(compressor="dgc")
    with pytest.raises(ValueError, match="'ratio'"):
        CompressionSchedule("sparsity", [0.9]).setup(_FakeTrainer(strategy), None, "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ratio"):
        CompressionSchedule("ratio", [0.25, 2.0]).setup(_FakeTrainer(strategy), None, "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="values"):
        CompressionSchedule("ratio", [])
    CompressionSchedule("ratio", [0.25, 0.001]).setup(_FakeTrainer(strategy), None, "fit")  # type: ignore[arg-type]
    assert isinstance(strategy.compressor, TopK) and strategy.compressor.ratio == 0.25  # the first value holds from the start


def test_weight_decay_buffers_round_trip_through_the_callback_state() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    first = MomentumCorrection(momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        p.grad = torch.zeros(3)
        first.on_before_optimizer_step(None, None, opt)  # type: ignore[arg-type]
    state = first.state_dict()
    resumed = MomentumCorrection(momentum=0.9, weight_decay=0.1)
    resumed.load_state_dict(state)
    p.grad = torch.zeros(3)
    first.on_before_optimizer_step(None, None, opt)  # type: ignore[arg-type]
    expected = p.grad.clone()
    p.grad = torch.zeros(3)
    resumed.on_before_optimizer_step(None, None, opt)  # type: ignore[arg-type]
    assert torch.equal(p.grad, expected) and expected[0] > 0.1  # momentum of the decay carried over
