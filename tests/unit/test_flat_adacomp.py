"""AdaComp's group code against its per-layer oracle (:mod:`tests.oracles.adacomp`), bit for bit, for every setting:
both selections, both wires, both quantizers, float32, bf16 and fp16 gradients, both backends; and its per-layer API
as the group of one."""

import itertools
from typing import Any, cast

import pytest
import torch
from torch import Tensor

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.per_tensor import PerTensor, per_tensor
from tests.oracles.adacomp import LayerAdaComp
from tests.unit.test_flat_graddrop_adacomp import RANKS, _assert_same_stats, _gradient, _layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: every selection x wire x quantizer
SETTINGS: dict[str, dict[str, Any]] = {
    f"{selection}-{wire}-{quantizer}": dict(selection=selection, wire=wire, quantizer=quantizer)
    for selection, wire, quantizer in itertools.product(("adaptive", "local"), ("paper", "index32"), ("binary", "ternary"))
}
#: bin lengths with 8-bit words and many markers, 16-bit words for convolutions, more than one entry per LS bin
SETTINGS["small_bins-local2"] = dict(bin_size_fc=7, bin_size_conv=3, scale_factor=3.0, selection="local", local_count=2)
SETTINGS["long_bins-index32"] = dict(bin_sizes={"layer4.*": 2000}, bin_size_conv=70, wire="index32")
SETTINGS["huge_bins-index32"] = dict(bin_size_fc=20000, wire="index32")  # beyond the paper wire's 14-bit offsets


def _pair(backend: Backend, rank: int, **kwargs: Any) -> tuple[AdaComp, LayerAdaComp]:
    group, oracle = AdaComp(backend=backend, **kwargs), LayerAdaComp(backend=backend, **kwargs)
    for comp in (group, oracle):
        comp.setup(rank, RANKS, torch.device("cpu"))
    if backend == "fused" and not kernels.fused_available():
        pytest.skip("the compiled kernels do not load here")
    return group, oracle


def _same_packets(a: FlatPacket, b: FlatPacket) -> None:
    assert a.layers is None and a.payload.dtype == torch.uint8
    assert torch.equal(a.payload, b.payload)
    assert torch.as_tensor(a.layer_nbytes).tolist() == list(b.layer_nbytes)
    _assert_same_stats(a, b)


def _compare(backend: Backend, dtype: torch.dtype, seg: Segments, **kwargs: Any) -> None:
    """Three ranks' two steps, group code and oracle: packets, sizes, stats, sent and the gathered mean, bit for bit."""
    groups, oracles = [], []
    for rank in range(RANKS):
        group, oracle = _pair(backend, rank, **kwargs)
        for step in range(2):
            grad = _gradient(seg, 10 * rank + step).to(dtype)
            x = grad * 1.5  # a compensated tensor differs from the fresh gradient
            group.observe_gradient_flat(grad, seg)
            oracle.observe_gradient_flat(grad, seg)
            a, b = group.compress_flat(x, seg), oracle.compress_flat(x, seg)
            _same_packets(a, b)
            assert torch.equal(group.sent_flat(x, a), oracle.sent_flat(x, b))
            assert torch.equal(group.decompress_flat(a), oracle.decompress_flat(b))
            assert group.decompress_flat(a).dtype == dtype
        groups.append((group, a))
        oracles.append((oracle, b))
    # the hook hands remote sizes back as it exchanged them: a device tensor, or host integers
    received = [p.with_payload(p.payload.clone(), tuple(cast(Tensor, p.layer_nbytes).tolist()) if r == 1 else p.layer_nbytes)
                for r, (_, p) in enumerate(groups)]
    out = torch.full((seg.total,), float("nan"), dtype=dtype)
    groups[0][0].decompress_flat_mean_into(received, out)
    expected = torch.empty(seg.total, dtype=dtype)
    oracles[0][0].decompress_flat_mean_into([p for _, p in oracles], expected)
    assert torch.equal(out, expected) and out.abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_group_code_equals_the_oracle_bit_for_bit(setting: str, dtype: str, backend: Backend) -> None:
    _compare(backend, DTYPES[dtype], _layout(), **SETTINGS[setting])


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_per_layer_api_is_the_group_of_one(setting: str, backend: Backend) -> None:
    # every layer of the group alone, by name (bin_sizes' patterns match names): compress, decompress, sent, sums
    seg = _layout()
    group, oracle = _pair(backend, 1, **SETTINGS[setting])
    x, dw = _gradient(seg, 3), _gradient(seg, 4)
    for name, view, fresh in zip(seg.names, seg.views(x), seg.views(dw)):
        for comp in (group, oracle):
            per_tensor(comp).observe_gradient(fresh, name)
        a, b = per_tensor(group).compress(view, name), per_tensor(oracle).compress(view, name)
        assert torch.equal(a.payload, b.payload) and a.shape == b.shape and a.dtype == b.dtype
        assert a.stats.keys() == b.stats.keys() and all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)
        assert torch.equal(per_tensor(group).decompress(a), per_tensor(oracle).decompress(b))
        assert torch.equal(per_tensor(group).sent(view, a), per_tensor(oracle).sent(view, b))
        assert torch.equal(per_tensor(group).decompress_sum([a, a]), per_tensor(oracle).decompress_sum([b, b]))
    assert group.layer_bin_sizes == oracle.layer_bin_sizes


@pytest.mark.parametrize("setting", ["adaptive-paper-binary", "local-index32-ternary"])
def test_a_group_of_empty_layers_sends_nothing(setting: str) -> None:
    seg = _layout([(0,), (0, 3)])
    group, oracle = _pair("torch", 0, **SETTINGS[setting])
    x = torch.zeros(0)
    for comp in (group, oracle):
        comp.observe_gradient_flat(x, seg)
    a, b = group.compress_flat(x, seg), oracle.compress_flat(x, seg)
    _same_packets(a, b)
    assert a.nbytes == 0 and group.decompress_flat(a).numel() == 0


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("setting", ["local-paper-binary", "adaptive-index32-ternary", "local-index32-binary"])
def test_nan_is_sent_as_the_oracle_sends_it(setting: str, backend: Backend) -> None:
    # a NaN makes its bin's maximum and its layer's scale NaN: binary sends NaN values, ternary nothing of the layer
    seg = _layout()
    group, oracle = _pair(backend, 0, **SETTINGS[setting])
    x = _gradient(seg, 6)
    x[seg.offsets[3] + 5] = float("nan")
    for comp in (group, oracle):
        comp.observe_gradient_flat(x, seg)
    a, b = group.compress_flat(x, seg), oracle.compress_flat(x, seg)
    assert torch.equal(a.payload, b.payload)
    assert torch.as_tensor(a.layer_nbytes).tolist() == list(b.layer_nbytes)
    sent = group.sent_flat(x, a)
    torch.testing.assert_close(sent, PerTensor(oracle).sent_flat(x, b), rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(sent).any()) == (SETTINGS[setting]["quantizer"] == "binary")


@pytest.mark.parametrize("setting", ["adaptive-index32-binary", "local-paper-binary"])
def test_settings_without_a_batched_form_make_one_group_packet(setting: str) -> None:
    comp = AdaComp(backend="torch", **SETTINGS[setting])
    comp.setup(0, 1, torch.device("cpu"))
    seg = _layout()
    comp.observe_gradient_flat(_gradient(seg, 1), seg)
    packet = comp.compress_flat(_gradient(seg, 0), seg)
    assert not comp.batched and packet.layers is None and isinstance(packet.layer_nbytes, Tensor)
