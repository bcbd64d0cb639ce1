"""Invalid pipeline-callback configurations."""

from types import SimpleNamespace

from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import SigmaClip, SigmaClipping
from lightning_gradcomp.compressors import TernGrad
from tests.bad_configs import BadConfig


def _on_plain_ddp() -> None:
    SigmaClipping().setup(SimpleNamespace(strategy=DDPStrategy()), None, "fit")  # type: ignore[arg-type]


def _twice() -> None:
    strategy = GradCompStrategy(TernGrad(clip_factor=0))
    strategy.add_transform(SigmaClip(2.5))
    strategy.add_transform(SigmaClip(2.5))


# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig("sigma-clipping-zero", lambda: SigmaClipping(0), "clip_factor", "0"),
    BadConfig("sigma-clipping-negative", lambda: SigmaClipping(-1.0), "clip_factor", "-1.0"),
    BadConfig("sigma-clipping-nan", lambda: SigmaClipping(float("nan")), "clip_factor", "nan"),
    BadConfig("sigma-clipping-inf", lambda: SigmaClipping(float("inf")), "clip_factor", "inf"),
    BadConfig("sigma-clipping-str", lambda: SigmaClipping("2.5"), "clip_factor", "'2.5'"),  # type: ignore[arg-type]
    BadConfig("sigma-clipping-none", lambda: SigmaClipping(None), "clip_factor", "None"),  # type: ignore[arg-type]
    # contradictory: TernGrad already clips at 2.5 sigma
    BadConfig(
        "sigma-clipping-twice-with-terngrad",
        lambda: SigmaClipping().make_transform(GradCompStrategy(TernGrad())),
        "clip_factor",
        "2.5",
    ),
    BadConfig("sigma-clipping-on-plain-ddp", _on_plain_ddp, "strategy", "DDPStrategy"),
    BadConfig("sigma-clipping-attached-twice", _twice, "SigmaClip", "SigmaClip"),
]
