"""The pieces of the outer-sync strategy that need no process group: fragments and their schedule, token counting,
the outer optimizer's resolution, and the two pseudo-gradient encodings added for it (Int8, TopK's 2-bit values)."""

import math

import pytest
import torch
from torch import nn

from lightning_gradcomp.compressors import Int8, TopK
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.outer.fragments import due, layers_of, strided_fragments, sync_offset
from lightning_gradcomp.outer.strategy import resolve_optimizer, tokens_in
from lightning_gradcomp.compressors.per_tensor import per_tensor


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def test_fragments_are_strided_groups_of_whole_layers() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)], nn.LayerNorm(2))
    names = _names(model)
    assert [len(layer) for layer in layers_of(names)] == [2] * 6
    fragments = strided_fragments(names, 4)
    assert fragments[0] == ["0.weight", "0.bias", "4.weight", "4.bias"]
    assert fragments[1] == ["1.weight", "1.bias", "5.weight", "5.bias"]
    assert fragments[3] == ["3.weight", "3.bias"]
    assert sorted(sum(fragments, [])) == sorted(names)  # every parameter exactly once
    assert strided_fragments(names, 1) == [names]


def test_fragments_sync_every_h_steps_staggered_by_h_over_p() -> None:
    h, p = 12, 4
    offsets = [sync_offset(f, p, h) for f in range(p)]
    assert offsets == [3, 6, 9, 12]
    for f, offset in enumerate(offsets):
        steps = [s for s in range(1, 40) if due(s, offset, h)]
        assert steps == list(range(offset, 40, h)), f"fragment {f}"
    assert [s for s in range(1, 11) if due(s, sync_offset(0, 1, 5), 5)] == [5, 10]  # DiLoCo: H, 2H, ...


def test_tokens_are_the_first_integer_tensor_else_samples() -> None:
    ids = torch.zeros(8, 64, dtype=torch.long)
    assert tokens_in((ids, ids)) == 512
    assert tokens_in({"x": torch.zeros(5, 3), "y": torch.zeros(5, dtype=torch.long)}) == 5
    assert tokens_in([torch.zeros(7, 3)]) == 7


def test_outer_optimizer_from_a_path_a_short_name_or_a_class() -> None:
    assert resolve_optimizer("torch.optim.SGD") is torch.optim.SGD
    assert resolve_optimizer("adamw") is torch.optim.AdamW
    assert resolve_optimizer(torch.optim.Adam) is torch.optim.Adam
    with pytest.raises(ValueError, match="outer_optimizer"):
        resolve_optimizer("torch.optim.NoSuchThing")


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_int8_codes_fit_the_int8_sum_and_are_unbiased(world_size: int) -> None:
    c = Int8()
    c.setup(0, world_size, torch.device("cpu"))
    assert c.levels == 127 // world_size
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    local = per_tensor(c).local_statistic(x, "w")
    assert local is not None
    shared = local * 1.5  # another rank's larger max
    packets = [per_tensor(c).compress(x, "w", shared) for _ in range(400)]
    codes = torch.stack([p.payload for p in packets])
    # within -L..L, so the world's codes summed stay inside int8
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= c.levels
    estimate = torch.stack([per_tensor(c).decompress(p) for p in packets]).mean(0)
    step = float(shared) / c.levels
    assert (estimate - x).abs().max() < 5 * step / math.sqrt(400) * 2  # unbiased: the mean converges to x
    assert (per_tensor(c).decompress(packets[0]) - x).abs().max() <= step + 1e-6  # one code step at most


def test_int8_all_zero_tensor_sends_zeros() -> None:
    c = Int8()
    c.setup(0, 4, torch.device("cpu"))
    packet = per_tensor(c).compress(torch.zeros(10), "w", torch.zeros(1))
    assert torch.equal(per_tensor(c).decompress(packet), torch.zeros(10))


@pytest.mark.parametrize("numel", [0, 1, 3, 100, 5003])
def test_topk_int2_values_sizes_and_error_feedback(numel: int) -> None:
    c = TopK(ratio=0.03, value_dtype="int2", dense_1d=False)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    memory = ResidualMemory()
    memory.residuals["w"] = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    compensated = memory.compensate(x, "w")
    packet = per_tensor(c).compress(compensated, "w")
    k = min(c.num_selects(numel), numel)
    assert packet.nbytes == 4 + 4 * k + math.ceil(2 * k / 8)  # scale, int32 indices, 2-bit codes
    sent = per_tensor(c).sent(compensated, packet)
    if k:
        scale = compensated.abs()[sent != 0].max() / 1.5 if bool((sent != 0).any()) else torch.tensor(1.0)
        levels = set((sent[sent != 0] / scale).tolist())
        assert levels <= {-1.5, -0.5, 0.5, 1.5}
        assert int((sent != 0).sum()) <= k
    old = memory.residuals["w"].clone()
    memory.update("w", compensated, sent)
    # grad + old residual == sent + new residual
    torch.testing.assert_close(x + old, sent + memory.residuals["w"], rtol=0, atol=1e-6)


def test_residual_decay_invariant() -> None:
    memory = ResidualMemory(decay=0.5)
    x = torch.randn(50, generator=torch.Generator().manual_seed(3))
    memory.residuals["w"] = torch.randn(50, generator=torch.Generator().manual_seed(4))
    old = memory.residuals["w"].clone()
    compensated = memory.compensate(x, "w")
    sent = torch.where(compensated.abs() > 1, compensated, torch.zeros_like(compensated))
    memory.update("w", compensated, sent)
    # grad + decay * old residual == sent + new residual
    torch.testing.assert_close(x + 0.5 * old, sent + memory.residuals["w"], rtol=0, atol=1e-6)
