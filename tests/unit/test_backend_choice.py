"""The compressors with fused kernels choose their backend once: in ``setup``, or at the first call without it."""

from collections.abc import Callable

import pytest
import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp, GradientDropping, TernGrad
from lightning_gradcomp.compressors.backends import Backend, KernelBacked
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.compressors.per_tensor import per_tensor

MAKERS: dict[str, Callable[[Backend], KernelBacked]] = {
    "terngrad": lambda backend: TernGrad(backend=backend),
    "graddrop": lambda backend: GradientDropping(backend=backend),
    "adacomp": lambda backend: AdaComp(backend=backend),
}
EXPLICIT: tuple[Backend, ...] = ("torch", "fused")


def _round_trip(comp: KernelBacked, x: torch.Tensor) -> None:
    if comp.uses_memory:
        per_tensor(comp).observe_gradient(x, "w")
    shared = per_tensor(comp).local_statistic(x, "w")
    packet = per_tensor(comp).compress(x, "w", shared)
    per_tensor(comp).decompress(packet)
    per_tensor(comp).decompress_sum_into([packet, packet], torch.empty_like(x))
    per_tensor(comp).decompress_mean_into([packet, packet], torch.empty_like(x))


@pytest.mark.parametrize("key", sorted(MAKERS))
def test_auto_asks_for_the_kernels_once_in_setup_and_never_per_call(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def fused_available() -> bool:
        asked.append(1)
        return False

    monkeypatch.setattr(kernels, "fused_available", fused_available)
    comp = MAKERS[key]("auto")
    assert comp.chosen_backend is None and not asked  # constructing compiles nothing
    comp.setup(0, 2, torch.device("cpu"))
    assert comp.chosen_backend == "torch" and len(asked) == 1
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        _round_trip(comp, x)
    assert len(asked) == 1


@pytest.mark.parametrize("key", sorted(MAKERS))
def test_an_explicit_backend_is_what_setup_chooses(key: str) -> None:
    for backend in EXPLICIT:
        comp = MAKERS[key](backend)
        comp.setup(0, 2, torch.device("cpu"))
        assert comp.chosen_backend == backend and comp.describe()["backend"] == backend


def test_without_setup_the_first_call_chooses_for_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "fused_available", lambda: True)
    comp = TernGrad(backend="auto")
    per_tensor(comp).compress(torch.randn(100), "w")
    assert comp.chosen_backend == "fused"
    monkeypatch.setattr(kernels, "fused_available", lambda: False)
    per_tensor(comp).compress(torch.randn(100), "w")
    assert comp.chosen_backend == "fused"  # kept: the compressor does not switch between calls


def test_off_cpu_auto_chooses_torch_ops() -> None:
    comp = TernGrad(backend="auto")
    comp.setup(0, 2, torch.device("meta"))  # any device but the CPU: the compiled kernels are CPU-only
    assert comp.chosen_backend == "torch"


needs_kernels = pytest.mark.skipif(not kernels.fused_available(), reason="the fused CPU kernels cannot be built here")


def _sent(comp: KernelBacked, x: torch.Tensor) -> torch.Tensor:
    if comp.uses_memory:
        per_tensor(comp).observe_gradient(x, "w")
    return per_tensor(comp).decompress(per_tensor(comp).compress(x, "w", per_tensor(comp).local_statistic(x, "w")))


@needs_kernels
def test_a_terngrad_setting_changed_between_steps_reaches_the_fused_path() -> None:
    # CompressionSchedule(attribute=...) sets the compressor's attribute before a step; the fused path must read it
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    x[0] = 50.0  # an outlier the c*sigma clip cuts, so the scaler follows clip_factor
    fused, torch_ops = TernGrad(backend="fused"), TernGrad(backend="torch")
    for comp in (fused, torch_ops):
        comp.setup(0, 1, torch.device("cpu"))
    before = _sent(fused, x).abs().max()
    for comp in (fused, torch_ops):
        comp.clip_factor = 1.0
    after = _sent(fused, x).abs().max()
    assert torch.allclose(after, _sent(torch_ops, x).abs().max(), rtol=1e-5)
    assert after < 0.5 * before


@needs_kernels
def test_gradient_droppings_sample_fraction_changed_between_steps_reaches_the_fused_path() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    comp, built = GradientDropping(sample="random", backend="fused"), GradientDropping(sample="random", sample_fraction=0.01,
                                                                                     backend="fused")
    for c in (comp, built):
        c.setup(0, 1, torch.device("cpu"))
    assert comp.kernels(x.device).name == "fused"
    per_tensor(comp).compress(x, "w")
    per_tensor(built).compress(x, "w")  # the streams move on alike
    comp.sample_fraction = 0.01
    # 1 % of the tensor, not the 0.1 % it was built with: the threshold of a compressor built with 1 %
    assert torch.equal(per_tensor(comp).compress(x, "w").stats["threshold"], per_tensor(built).compress(x, "w").stats["threshold"])
    assert comp._sample_plan(Segments(["w"], [x.shape]), x.device).segments.numels == (2000,)


@needs_kernels
def test_an_adacomp_setting_changed_between_steps_reaches_the_fused_path() -> None:
    x = torch.randn(5_000, generator=torch.Generator().manual_seed(2))
    fused, torch_ops = AdaComp(backend="fused"), AdaComp(backend="torch")
    for comp in (fused, torch_ops):
        comp.setup(0, 1, torch.device("cpu"))
        comp.scale_factor = 4.0
    assert torch.equal(_sent(fused, x), _sent(torch_ops, x))
