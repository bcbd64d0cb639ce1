"""AdaComp: Algorithm 2 against a literal loop, layer types, the paper's wire format, and residual growth vs LS."""

import math
import re
from typing import cast

import pytest
import torch
from torch import Tensor, nn

from lightning_gradcomp.compressors.adacomp import AdaComp, Quantizer, Selection, layer_kind
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.unit.feedback import feedback_step


def _algorithm2(residue: torch.Tensor, dw: torch.Tensor, size: int, quantizer: str = "binary") -> torch.Tensor:
    """Algorithm 2 of the paper, element by element (our documented choices for the last bin and G = 0)."""
    g = residue + dw
    h = g + dw
    n = g.numel()
    bins = [range(start, min(start + size, n)) for start in range(0, n, size)]
    gmax = [max(abs(float(g[j])) for j in b) for b in bins]
    scale = torch.tensor(gmax, dtype=torch.float32).mean()
    sent = torch.zeros(n)
    for i, b in enumerate(bins):
        for j in b:
            if abs(float(h[j])) >= gmax[i] and float(g[j]) != 0.0:
                if quantizer == "ternary" and 2 * abs(float(g[j])) < float(scale):
                    continue
                sent[j] = math.copysign(float(scale), float(g[j]))
    return sent


@pytest.mark.parametrize("quantizer", ["binary", "ternary"])
@pytest.mark.parametrize("n, size", [(1000, 50), (1037, 50), (777, 500), (5, 50)])
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_matches_algorithm2(n: int, size: int, quantizer: Quantizer, backend: Backend) -> None:
    gen = torch.Generator().manual_seed(n)
    residue = torch.randn(n, generator=gen) * 3
    dw = torch.randn(n, generator=gen)
    comp = AdaComp(bin_size_fc=size, quantizer=quantizer, backend=backend)
    memory = ResidualMemory()
    memory.residuals["w"] = residue
    _, x, packet, sent = feedback_step(comp, memory, dw, "w")
    assert torch.equal(sent, _algorithm2(residue, dw, size, quantizer))
    # the last partial bin (n % size elements) is a bin of its own
    assert int(packet.stats["bin_size"]) == size


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_the_largest_entry_is_not_always_sent(backend: Backend) -> None:
    # paper ambiguity: gmax is taken on G, the test on H = G + dW; a max whose fresh gradient points back misses
    comp = AdaComp(bin_size_fc=4, backend=backend)
    residue = torch.tensor([5.0, 0.1, 0.1, 4.9])
    dw = torch.tensor([-1.0, 0.0, 0.0, 1.0])  # G = [4, .1, .1, 5.9]; H = [3, .1, .1, 6.9]
    per_tensor(comp).observe_gradient(dw, "w")
    sent = per_tensor(comp).decompress(per_tensor(comp).compress(residue + dw, "w"))
    assert torch.equal(sent != 0, torch.tensor([False, False, False, True]))


def test_local_selection_sends_a_fixed_count_per_bin() -> None:
    comp = AdaComp(bin_size_fc=100, selection="local", local_count=3)
    x = torch.randn(1050)
    per_tensor(comp).observe_gradient(x, "w")
    sent = per_tensor(comp).decompress(per_tensor(comp).compress(x, "w"))
    counts = [(sent[i : i + 100] != 0).sum().item() for i in range(0, 1050, 100)]
    assert counts == [3] * 11
    top = torch.topk(x[:100].abs(), 3).indices
    assert torch.equal(torch.nonzero(sent[:100]).reshape(-1), top.sort().values)


def test_layer_types_and_overrides() -> None:
    assert layer_kind("features.0.weight", torch.Size([20, 1, 5, 5])) == "conv"
    assert layer_kind("conv1d.weight", torch.Size([8, 4, 3])) == "conv"
    assert layer_kind("classifier.weight", torch.Size([10, 500])) == "fc"
    assert layer_kind("lstm.weight_hh_l0", torch.Size([2048, 512])) == "recurrent"
    assert layer_kind("features.0.bias", torch.Size([20])) == "fc"
    comp = AdaComp(bin_sizes={"features.*.bias": 50, "classifier.*": 800})
    assert comp.bin_size("features.0.weight", torch.Size([20, 1, 5, 5])) == 50
    assert comp.bin_size("fc1.weight", torch.Size([500, 800])) == 500
    assert comp.bin_size("lstm.weight_hh_l0", torch.Size([2048, 512])) == 500
    assert comp.bin_size("features.0.bias", torch.Size([20])) == 50
    assert comp.bin_size("classifier.weight", torch.Size([10, 500])) == 800


def _words(idx: torch.Tensor, size: int, max_field: int) -> int:
    """Words the bin-relative format needs, counted the slow way: entries plus bin-advance markers."""
    words, cur, prev = 0, 0, -1
    for j in idx.tolist():
        b, off = divmod(j, size)
        if b == cur + 1 and off <= prev:
            cur = b
        elif b != cur:
            words += math.ceil((b - cur) / max_field)
            cur, prev = b, -1
        words += 1
        prev = off
    return words


@pytest.mark.parametrize("shape, size, width", [((32, 16, 5, 5), 50, 1), ((100, 800), 500, 2), ((300,), 20000, 0)])
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_paper_wire_bytes_and_round_trip(shape: tuple, size: int, width: int, backend: Backend) -> None:
    x = torch.randn(shape)
    if width == 0:  # L_T beyond 16K does not fit 14-bit offsets: the MXNet layout instead
        comp = AdaComp(bin_size_fc=size, wire="index32", backend=backend)
    else:
        comp = AdaComp(backend=backend)
    per_tensor(comp).observe_gradient(x * 0.5, "w")
    packet = per_tensor(comp).compress(x, "w")
    sent = per_tensor(comp).decompress(packet)
    idx = torch.nonzero(sent.reshape(-1)).reshape(-1)
    k = idx.numel()
    if width == 0:
        assert packet.nbytes == 4 + 4 + 4 * k + math.ceil(k / 8)
    else:
        assert comp.layer_bin_sizes["w"] == size
        assert packet.nbytes == 4 + width * _words(idx, size, 63 if width == 1 else 16383)
    assert float(packet.stats["compression_rate"]) == pytest.approx(4 * x.numel() / packet.nbytes)
    # every sent value is +-scale, with G's sign
    scale = float(packet.stats["scale"])
    assert torch.all(sent.reshape(-1)[idx].abs() == scale)


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_nothing_to_send_is_zero_bytes(backend: Backend) -> None:
    comp = AdaComp(backend=backend)
    per_tensor(comp).observe_gradient(torch.zeros(10, 10), "w")
    packet = per_tensor(comp).compress(torch.zeros(10, 10), "w")
    assert packet.nbytes == 0 and torch.equal(per_tensor(comp).decompress(packet), torch.zeros(10, 10))


def test_compress_without_the_gradient_explains_the_fix() -> None:
    with pytest.raises(RuntimeError, match="observe_gradient"):
        per_tensor(AdaComp()).compress(torch.randn(10), "w")


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"bin_size_conv": 0}, "bin_size_conv"),
        ({"bin_size_fc": -5}, "bin_size_fc"),
        ({"bin_sizes": {"fc.*": 0}}, "bin_sizes['fc.*']"),
        ({"bin_size_fc": 20000}, "bin_size"),
        ({"scale_factor": 0.5}, "scale_factor"),
        ({"quantizer": "sign"}, "quantizer"),
        ({"selection": "topk"}, "selection"),
        ({"local_count": 0}, "local_count"),
        ({"wire": "mxnet"}, "wire"),
    ],
)
def test_bad_arguments_name_argument_and_fix(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"`{argument}`")) as info:
        AdaComp(**kwargs)
    assert "Fix" in str(info.value)


def _residual_norms(selection: Selection, steps: int = 300) -> tuple[list[float], float]:
    """Train a tiny MLP on digits with every gradient through the compressor and residual memory."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = torch.tensor(digits.data, dtype=torch.float32) / 16
    target = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comp = AdaComp(bin_size_fc=500, selection=selection)
    memory = ResidualMemory()
    gen = torch.Generator().manual_seed(1)
    norms = []
    loss = torch.zeros(())
    for _ in range(steps):
        batch = torch.randint(0, len(data), (32,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data[batch]), target[batch])
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            _, _, _, sent = feedback_step(comp, memory, p.grad, name)
            p.grad.copy_(sent)
        opt.step()
        norms.append(float(torch.sqrt(cast(Tensor, sum(r.square().sum() for r in memory.residuals.values())))))
    return norms, float(loss.detach())


def test_adacomp_residuals_stay_bounded_where_local_selection_grows() -> None:
    """Paper Fig. 5: with one entry per bin of 500 (LS), the residue outgrows what is sent; AdaComp adapts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a busy CI machine
    try:
        ada, ada_loss = _residual_norms("adaptive")
        ls, ls_loss = _residual_norms("local")
    finally:
        torch.set_num_threads(threads)
    assert ada[-1] <= 1.5 * max(ada[:100]), "AdaComp's residual kept growing"
    assert ls[-1] >= 2 * ls[50], "LS's residual did not grow"
    assert ls[-1] >= 5 * ada[-1]
    assert ada_loss < ls_loss
