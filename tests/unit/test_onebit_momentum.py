"""OneBit under SGD momentum (issue 21): the encoding is exact on tiny and odd-sized tensors; the divergence with
momentum 0.9 is the method's (error feedback + heavy momentum at fp32's learning rate), so setup warns."""

import math
import warnings

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from benchmarks.onebit_momentum import final_loss
from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import OneBit
from lightning_gradcomp.compressors.per_tensor import per_tensor


@pytest.mark.parametrize("shape", [(1,), (7,), (1_000_003,), (7, 1), (3, 5)], ids=str)
def test_encoding_is_the_two_means_per_group_on_odd_sizes(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    packet = per_tensor(OneBit()).compress(x, "w")
    groups = x.reshape(shape[0], -1) if len(shape) > 1 else x.reshape(1, -1)
    assert packet.nbytes == math.ceil(x.numel() / 8) + 8 * groups.shape[0]
    decoded = per_tensor(OneBit()).decompress(packet.with_payload(packet.payload.clone())).reshape(groups.shape)
    for row, out in zip(groups, decoded):
        pos = row >= 0
        expected = torch.where(pos, row[pos].mean() if pos.any() else 0.0, row[~pos].mean() if (~pos).any() else 0.0)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)  # the bit-packed tail included


def test_heavy_momentum_needs_a_smaller_learning_rate_than_fp32() -> None:
    sizes, steps = [1, 7, 1000], 120
    fp32 = final_loss("fp32", sizes, lr=0.05, momentum=0.9, steps=steps)
    assert final_loss("onebit", sizes, lr=0.05, momentum=0.9, steps=steps) > 5 * fp32  # diverges
    assert final_loss("onebit", sizes, lr=0.05, momentum=0.0, steps=steps) < 1.1 * fp32  # without momentum: fine
    slow = final_loss("fp32", sizes, lr=0.01, momentum=0.9, steps=steps)
    assert final_loss("onebit", sizes, lr=0.01, momentum=0.9, steps=steps) < 1.1 * slow  # a 5x smaller lr: fine


def test_setup_warns_about_heavy_momentum(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.warns(UserWarning, match=r"momentum=0.9.*Fix: divide the learning rate"):
        OneBit().check_optimizers([torch.optim.SGD(params, lr=0.1, momentum=0.9)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OneBit().check_optimizers([torch.optim.SGD(params, lr=0.1, momentum=0.7), torch.optim.Adam(params)])
    # the strategy asks its compressor once the optimizers exist
    strategy = GradCompStrategy(compressor="onebit")
    monkeypatch.setattr(DDPStrategy, "setup_optimizers",
                        lambda self, trainer: setattr(self, "optimizers", [torch.optim.SGD(params, lr=0.1, momentum=0.9)]))
    with pytest.warns(UserWarning, match="OneBit with momentum=0.9"):
        strategy.setup_optimizers(None)  # type: ignore[arg-type]
