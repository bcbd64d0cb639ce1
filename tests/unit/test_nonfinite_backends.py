"""Non-finite input reaches a compressor only under ``nonfinite="ignore"`` or standalone use; then the fused and
torch backends follow one rule (docs/kernels.md, "Non-finite input"):

* TernGrad: a NaN or Inf makes its chunk's scaler NaN, so the whole chunk decodes to NaN; under a finite scaler
  imposed from outside (``shared``), a NaN element is sent as 0.
* AdaComp: a NaN makes its bin's maximum, hence the layer scale, NaN: every sent value decodes to NaN
  (``quantizer="ternary"`` then sends nothing: no 2|G| compares >= a NaN scale).
* Gradient Dropping: NaN sorts above every number when the threshold is selected (``torch.kthvalue``'s order),
  and a NaN is never "at or below" the threshold, so it is sent (NaN in, NaN out); a quantized survivor's level
  is NaN when a NaN survives.

Each backend is run three ways: ``"torch"``, ``"fused"`` with the compiled kernels, and ``"fused"`` on the
kernels' torch-ops path (``kernels.torch_ops()``, the CUDA and no-compiler path).
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

from lightning_gradcomp import kernels
from lightning_gradcomp.compressors import AdaComp, GradientDropping, TernGrad
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.per_tensor import per_tensor

BACKENDS: list[tuple[str, Callable[[], AbstractContextManager[None]]]] = [("torch", nullcontext), ("fused", nullcontext), ("fused", kernels.torch_ops)]
NAN, INF = float("nan"), float("inf")


def _decoded(make: Callable[[], Compressor], x: torch.Tensor, shared: "torch.Tensor | None" = None) -> list[torch.Tensor]:
    """The decoded packet of ``x`` on each backend variant."""
    out = []
    for backend, context in BACKENDS:
        comp = make()
        comp.backend = backend  # type: ignore[attr-defined]
        comp.setup(0, 1, torch.device("cpu"))
        with context():
            if comp.uses_memory:
                per_tensor(comp).observe_gradient(x, "w")
            out.append(per_tensor(comp).decompress(per_tensor(comp).compress(x, "w", shared)))
    return out


def _input(bad: float) -> torch.Tensor:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    x[1234] = bad
    return x


TERNGRAD = {
    "paper": lambda: TernGrad(),
    "code": lambda: TernGrad(clip_mode="code"),
    "noclip": lambda: TernGrad(clip_factor=0.0),
    "per_worker-buckets": lambda: TernGrad(scaler_share="per_worker", bucket_size=1000),
}


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", sorted(TERNGRAD))
def test_terngrad_backends_decode_a_non_finite_chunk_as_nan(key: str, bad: float) -> None:
    x = _input(bad)
    chunk = slice(1000, 2000) if "buckets" in key else slice(None)
    for decoded in _decoded(TERNGRAD[key], x):
        nan = torch.isnan(decoded)
        assert nan[chunk].all()
        assert nan.sum() == nan[chunk].numel()  # only the chunk that held it


def test_terngrad_backends_send_nan_as_zero_under_a_finite_shared_scaler() -> None:
    x = _input(NAN)
    for decoded in _decoded(lambda: TernGrad(clip_factor=0.0), x, shared=torch.tensor([10.0])):
        assert decoded[1234] == 0 and torch.isfinite(decoded).all()


ADACOMP = {
    "binary": lambda: AdaComp(),
    "ternary": lambda: AdaComp(quantizer="ternary"),
    "index32": lambda: AdaComp(wire="index32"),
}


@pytest.mark.parametrize("key", sorted(ADACOMP))
def test_adacomp_backends_agree_on_nan(key: str) -> None:
    reference, *others = _decoded(ADACOMP[key], _input(NAN))
    sent = reference != 0
    if key == "ternary":
        assert sent.sum() == 0
    else:
        assert sent.sum() > 0 and torch.isnan(reference[sent]).all()  # the layer scale is NaN
    for decoded in others:
        torch.testing.assert_close(decoded, reference, rtol=0, atol=0, equal_nan=True)


GRADDROP = {
    "exact": lambda: GradientDropping(sample="exact"),
    "strided": lambda: GradientDropping(sample="strided", max_sample=500),
    "fp16": lambda: GradientDropping(sample="exact", values="fp16"),
    "threshold": lambda: GradientDropping(sample="exact", quantize="threshold"),
    "global_mean": lambda: GradientDropping(sample="exact", quantize="global_mean"),
    "2bit": lambda: GradientDropping(sample="exact", quantize="2bit"),
}


@pytest.mark.parametrize("key", sorted(GRADDROP))
def test_graddrop_backends_agree_on_nan(key: str) -> None:
    x = _input(NAN)
    x[:40] = NAN  # more NaN than the 1% that survive: the threshold must rank them as the torch backend does
    reference, *others = _decoded(GRADDROP[key], x)
    assert torch.isnan(reference[:40]).all() and torch.isnan(reference[1234])  # NaN in, NaN out
    for decoded in others:
        torch.testing.assert_close(decoded, reference, rtol=0, atol=0, equal_nan=True)
