import pytest
import torch

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import SigmaClip, SigmaClipping
from lightning_gradcomp.compressors import TernGrad


def test_sigma_clip_clips_at_c_sigma_and_keeps_the_rest() -> None:
    g = torch.randn(10_000)
    g[0] = 100.0
    out = SigmaClip(2.5).before_compress(g, "w")
    threshold = 2.5 * g.std(correction=0)
    assert torch.isclose(out.abs().max(), threshold)
    inside = g.abs() <= threshold
    assert torch.equal(out[inside], g[inside])
    assert torch.equal(out[~inside], torch.sign(g[~inside]) * threshold)


def test_sigma_clipping_refuses_double_clipping_with_terngrad() -> None:
    with pytest.raises(ValueError, match="clip_factor=0"):
        SigmaClipping().make_transform(GradCompStrategy(compressor=TernGrad(clip_factor=2.5)))
    assert isinstance(SigmaClipping().make_transform(GradCompStrategy(TernGrad(clip_factor=0))), SigmaClip)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "2.5"])
def test_sigma_clipping_rejects_bad_factor(bad: object) -> None:
    with pytest.raises(ValueError, match="clip_factor"):
        SigmaClipping(bad)  # type: ignore[arg-type]
