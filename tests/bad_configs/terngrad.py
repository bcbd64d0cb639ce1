"""Invalid TernGrad configurations."""

import torch

from lightning_gradcomp.compressors import TernGrad
from tests.bad_configs import BadConfig


def _int8_on(world_size: int) -> None:
    TernGrad(collective="allreduce_int8").setup(0, world_size, torch.device("cpu"))


# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig("terngrad-clip-negative", lambda: TernGrad(clip_factor=-1.0), "clip_factor", "-1.0"),
    BadConfig("terngrad-clip-nan", lambda: TernGrad(clip_factor=float("nan")), "clip_factor", "nan"),
    BadConfig("terngrad-clip-inf", lambda: TernGrad(clip_factor=float("inf")), "clip_factor", "inf"),
    BadConfig("terngrad-clip-str", lambda: TernGrad(clip_factor="2.5"), "clip_factor", "'2.5'"),  # type: ignore[arg-type]
    BadConfig("terngrad-clip-bool", lambda: TernGrad(clip_factor=True), "clip_factor", "True"),
    BadConfig("terngrad-clip-none", lambda: TernGrad(clip_factor=None), "clip_factor", "None"),  # type: ignore[arg-type]
    BadConfig("terngrad-clip-mode-case", lambda: TernGrad(clip_mode="Paper"), "clip_mode", "'Paper'"),  # type: ignore[arg-type]
    BadConfig("terngrad-clip-mode-none", lambda: TernGrad(clip_mode=None), "clip_mode", "None"),  # type: ignore[arg-type]
    BadConfig("terngrad-scaler-share", lambda: TernGrad(scaler_share="mean"), "scaler_share", "'mean'"),  # type: ignore[arg-type]
    BadConfig("terngrad-bucket-zero", lambda: TernGrad(bucket_size=0), "bucket_size", "0"),
    BadConfig("terngrad-bucket-negative", lambda: TernGrad(bucket_size=-5), "bucket_size", "-5"),
    BadConfig("terngrad-bucket-float", lambda: TernGrad(bucket_size=1.5), "bucket_size", "1.5"),  # type: ignore[arg-type]
    BadConfig("terngrad-bucket-bool", lambda: TernGrad(bucket_size=True), "bucket_size", "True"),
    BadConfig("terngrad-packing", lambda: TernGrad(packing="3bit"), "packing", "'3bit'"),  # type: ignore[arg-type]
    BadConfig("terngrad-packing-int", lambda: TernGrad(packing=2), "packing", "2"),  # type: ignore[arg-type]
    BadConfig("terngrad-collective", lambda: TernGrad(collective="allreduce"), "collective", "'allreduce'"),  # type: ignore[arg-type]
    BadConfig("terngrad-collective-nccl", lambda: TernGrad(collective="nccl"), "collective", "'nccl'"),  # type: ignore[arg-type]
    BadConfig("terngrad-seed-negative", lambda: TernGrad(seed=-1), "seed", "-1"),
    BadConfig("terngrad-seed-float", lambda: TernGrad(seed=1.0), "seed", "1.0"),  # type: ignore[arg-type]
    BadConfig("terngrad-seed-str", lambda: TernGrad(seed="0"), "seed", "'0'"),  # type: ignore[arg-type]
    # contradictory: summing ternaries needs one scaler shared by every rank
    BadConfig(
        "terngrad-int8-per-worker",
        lambda: TernGrad(collective="allreduce_int8", scaler_share="per_worker"),
        "scaler_share",
        "'per_worker'",
    ),
    # incompatible compressor and collective for the world size (int8 sums overflow beyond 127 ranks)
    BadConfig("terngrad-int8-200-ranks", lambda: _int8_on(200), "collective", "200"),
]
