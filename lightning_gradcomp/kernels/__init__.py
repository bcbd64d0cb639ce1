"""Fused compress/decompress kernels: a compiled CPU path and a torch-ops path (fallback and CUDA).

The CPU kernels are C++ compiled on first use (:mod:`lightning_gradcomp.kernels._build`, cached in torch's
extension directory). Where compilation is unavailable the same functions run as torch ops with the same
results, after one logged warning. On CUDA tensors the torch-ops path runs (unmeasured so far), except TernGrad's
group path, which runs Triton kernels when Triton imports (:mod:`lightning_gradcomp.kernels.triton_terngrad`).
"""

from lightning_gradcomp.kernels._build import cpu_extension, extension_for, torch_ops
from lightning_gradcomp.kernels.binwords import (
    adacomp_group_decode_sum,
    adacomp_group_encode,
    bin_words_decode_sum,
    bin_words_encode,
)
from lightning_gradcomp.kernels.rng import stream_key
from lightning_gradcomp.kernels.selection import (
    AdaCompSelection,
    adacomp_select,
    bin_absmax,
    graddrop_group_kth,
    graddrop_group_sample,
    graddrop_group_select,
    kth_smallest,
    quantile_rank,
    sample_abs,
    sample_threshold,
    select_above,
    sparse_decode_sum,
)
from lightning_gradcomp.kernels.terngrad import terngrad_scaler


def fused_available() -> bool:
    """Whether the compiled CPU kernels load on this machine (compiles them on the first call)."""
    return cpu_extension() is not None


__all__ = [
    "AdaCompSelection",
    "adacomp_group_decode_sum",
    "adacomp_group_encode",
    "adacomp_select",
    "bin_absmax",
    "bin_words_decode_sum",
    "bin_words_encode",
    "cpu_extension",
    "extension_for",
    "fused_available",
    "graddrop_group_kth",
    "graddrop_group_sample",
    "graddrop_group_select",
    "kth_smallest",
    "quantile_rank",
    "sample_abs",
    "sample_threshold",
    "select_above",
    "sparse_decode_sum",
    "stream_key",
    "terngrad_scaler",
    "torch_ops",
]
