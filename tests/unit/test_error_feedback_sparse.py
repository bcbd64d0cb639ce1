"""Error feedback of every sparse compressor with memory: grad + old residual == sent + new residual.

Exact (``torch.equal``) wherever the compressor sends the survivors' own values (or their fp16/bf16
roundings, whose difference to x is representable). Where a shared level is sent instead (AdaComp's
+-scale, Gradient Dropping's 1-/2-bit levels) x - level is not always a float32 (x = 1e-9, level 1), so no
float32 residual can make the identity exact: there unsent entries are exact and each sent entry is off by
at most half an ulp (of the larger of |x| and the level), the rounding of the residual itself (see docs/compressors.md).
"""

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from lightning_gradcomp.compressors import AdaComp, GradientDropping
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.unit.feedback import feedback_step

_SHAPES = {"conv.weight": (16, 8, 5, 5), "fc.weight": (64, 300), "fc.bias": (64,)}

EXACT: dict[str, Callable[[], GradientDropping]] = {
    "graddrop": lambda: GradientDropping(),
    "graddrop-strided": lambda: GradientDropping(sample="strided", max_sample=500),
    "graddrop-exact-delta16-bf16": lambda: GradientDropping(sample="exact", index_encoding="delta16", values="bf16"),
    "graddrop-fp16": lambda: GradientDropping(drop_ratio=0.9, values="fp16"),
    "graddrop-global": lambda: GradientDropping(scope="global"),
    "graddrop-ratio0": lambda: GradientDropping(drop_ratio=0.0),
}
LEVELS: dict[str, Callable[[], GradientDropping | AdaComp]] = {
    "graddrop-threshold": lambda: GradientDropping(quantize="threshold"),
    "graddrop-column-mean": lambda: GradientDropping(quantize="column_mean", drop_ratio=0.9),
    "graddrop-global-mean": lambda: GradientDropping(quantize="global_mean", scope="global"),
    "graddrop-2bit": lambda: GradientDropping(quantize="2bit", index_encoding="delta16"),
    "adacomp": lambda: AdaComp(),
    "adacomp-ternary": lambda: AdaComp(quantizer="ternary"),
    "adacomp-ls": lambda: AdaComp(selection="local", local_count=2),
    "adacomp-index32": lambda: AdaComp(wire="index32"),
}


def _steps(comp: Compressor, steps: int = 4) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor, Packet]]:
    comp.setup(0, 1, torch.device("cpu"))
    memory = ResidualMemory()
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for name, shape in _SHAPES.items():
            grad = torch.randn(shape, generator=gen) * torch.rand((), generator=gen) * 10
            old, x, packet, sent = feedback_step(comp, memory, grad, name)
            before = grad.clone() if old is None else grad + old  # what compensate computed
            yield before, sent, memory.residuals[name], x, packet


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("key", sorted(EXACT))
def test_sent_plus_residual_is_exact(key: str, backend: Backend) -> None:
    comp = EXACT[key]()
    comp.backend = backend
    assert comp.uses_memory
    for before, sent, residual, x, packet in _steps(comp):
        assert torch.equal(before, x)
        assert torch.equal(before, sent + residual)
        assert torch.equal(sent, per_tensor(comp).decompress(packet.with_payload(packet.payload.clone())))


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("key", sorted(LEVELS))
def test_sent_plus_residual_within_the_residuals_rounding(key: str, backend: Backend) -> None:
    comp = LEVELS[key]()
    comp.backend = backend
    assert comp.uses_memory
    for before, sent, residual, x, _packet in _steps(comp):
        assert torch.equal(residual, x - sent)  # the residual is x - sent, rounded once
        off = (before.double() - (sent + residual).double()).abs()
        unsent = sent == 0
        assert torch.all(off[unsent] == 0)
        # fl(x - level) is off by at most half an ulp of the larger of |x| and |level| (same signs)
        big = torch.maximum(sent[~unsent].abs(), x[~unsent].abs())
        half_ulp = (torch.nextafter(big, torch.full_like(big, float("inf"))) - big).double() / 2
        assert torch.all(off[~unsent] <= half_ulp)
