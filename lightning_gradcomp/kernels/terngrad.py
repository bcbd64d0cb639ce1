"""TernGrad's scaler rule, shared by the group code (:mod:`lightning_gradcomp.compressors.terngrad_group`) and the
compiled kernels (which apply the same rule in C++, bit for bit).

The compiled group kernels (``terngrad_*_flat`` in ``csrc/terngrad.cpp``) are called by the group code directly; the
per-layer kernels in the same file share their tile code and are the per-layer oracle's
(``tests/oracles/terngrad_kernels.py``).
"""

from typing import Optional

import torch
from torch import Tensor


def terngrad_scaler(
    sigma: Tensor, absmax: Tensor, clip_factor: float, clip_mode: str, sigma_noise: float = 0.0
) -> tuple[Tensor, Optional[Tensor]]:
    """This rank's scaler per chunk and the clip threshold to apply while ternarizing (``None``: no clip).

    ``clip_factor == 0``: scaler max|g|, no clipping. ``"paper"``: clip at c*sigma, and since
    max|clip(g, c*sigma)| = min(max|g|, c*sigma) the scaler needs no second pass. ``"code"``: scaler c*sigma,
    clipping implicit (|g| >= s is always sent). A chunk with sigma <= ``sigma_noise`` * max|g| counts as
    constant and is not clipped (threshold max|g|), as in :class:`~lightning_gradcomp.compressors.TernGrad`.
    """
    if clip_factor == 0.0:
        return absmax, None
    threshold = torch.where(sigma <= sigma_noise * absmax, absmax, sigma * clip_factor)
    if clip_mode == "code":
        return threshold, None
    return torch.minimum(absmax, threshold), threshold


__all__ = ["terngrad_scaler"]
