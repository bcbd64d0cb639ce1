"""Test oracle: TernGrad's per-layer kernels (one tensor per call): statistics, ternarize + pack, decode,
decode-and-sum, the bit-for-bit reference of the group kernels the library runs
(:mod:`lightning_gradcomp.compressors.terngrad_group`, ``terngrad_*_flat`` in ``csrc/terngrad.cpp``).

Each function runs the compiled CPU kernel for CPU tensors when it is available and otherwise the same
maths with torch ops. Both give bit-identical ternaries for the same key (the random stream is
:mod:`lightning_gradcomp.kernels.rng`), and decoding is exact: the result equals the reference
``values.float() * scale`` bit for bit.

Chunks: a tensor is cut into chunks of ``bucket`` consecutive elements (the last may be shorter), one scaler
each; ``bucket >= numel`` is one scaler per tensor.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.kernels import rng
from lightning_gradcomp.kernels._build import extension_for
from lightning_gradcomp.kernels.terngrad import terngrad_scaler
from lightning_gradcomp.wire.ternary import pack_ternary, unpack_ternary



def _flat32(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1).to(torch.float32).contiguous()


def _check_numel(numel: int) -> None:
    if numel >= rng.MAX_NUMEL:
        raise ValueError(
            f"Expected a tensor of fewer than 2**32 elements for the fused TernGrad kernels, but got {numel}. "
            "Use `backend='torch'` or a smaller `bucket_size`-chunked parameter."
        )


def _per_element(per_chunk: Tensor, bucket: int, numel: int) -> Tensor:
    return per_chunk.repeat_interleave(bucket)[:numel] if per_chunk.numel() > 1 else per_chunk.expand(numel)


def terngrad_stats(tensor: Tensor, bucket: int) -> tuple[Tensor, Tensor]:
    """One pass: population standard deviation sigma and max|g| of each chunk (float32, one per chunk).

    sigma comes from float64 sums of g and g**2 (one pass instead of torch's two), which agrees with
    ``torch.std(correction=0)`` to about 1e-6 relative unless |mean| exceeds sigma by a factor of ~1e4.
    """
    flat = _flat32(tensor)
    n = flat.numel()
    ext = extension_for(flat)
    if ext is not None:
        out = ext.terngrad_stats(flat, bucket)
        return out[:, 0], out[:, 1]
    chunks = -(-n // bucket)
    padded = torch.cat((flat, flat.new_zeros(chunks * bucket - n))).view(chunks, bucket) if chunks > 1 else flat.view(1, -1)
    counts = torch.full((chunks,), float(min(bucket, n)), dtype=torch.float64, device=flat.device)
    counts[-1] = n - (chunks - 1) * bucket
    d = padded.to(torch.float64)
    mean = d.sum(dim=1) / counts
    var = ((d * d).sum(dim=1) / counts - mean * mean).clamp_min(0.0)
    return var.sqrt().to(torch.float32), padded.abs().amax(dim=1)


def terngrad_scale_clip(
    tensor: Tensor, bucket: int, clip_factor: float, clip_mode: str, sigma_noise: float = 0.0
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`terngrad_stats` then :func:`terngrad_scaler`, in one native call where the kernels are built (the
    same values bit for bit; the torch ops on one-element tensors cost more than the pass over a small tensor)."""
    if clip_mode not in ("paper", "code"):
        raise ValueError(f"Expected `clip_mode` to be 'paper' or 'code', but got {clip_mode!r}.")
    flat = _flat32(tensor)
    ext = extension_for(flat)
    if ext is None:
        return terngrad_scaler(*terngrad_stats(flat, bucket), clip_factor, clip_mode, sigma_noise)
    mode = 0 if clip_factor == 0.0 else {"paper": 1, "code": 2}[clip_mode]
    scale, clip = ext.terngrad_scale_clip(flat, bucket, clip_factor, mode, sigma_noise)
    return scale, clip if mode == 1 else None


def _ternary_torch(flat: Tensor, scale: Tensor, clip: Optional[Tensor], bucket: int, key: tuple[int, int]) -> Tensor:
    n = flat.numel()
    index = torch.arange(n, dtype=torch.int64, device=flat.device)
    u = rng.uniform(index, *key)
    a = flat.abs()
    if clip is not None:
        a = torch.minimum(a, _per_element(clip.to(flat.device, torch.float32), bucket, n))
    keep = u * _per_element(scale.to(flat.device, torch.float32), bucket, n) < a
    return torch.where(keep, torch.sign(flat), torch.zeros_like(flat)).to(torch.int8)


def _args(tensor: Tensor, scale: Tensor, clip: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    flat = _flat32(tensor)
    _check_numel(flat.numel())
    s = scale.reshape(-1).to(flat.device, torch.float32).contiguous()
    c = flat.new_empty(0) if clip is None else clip.reshape(-1).to(flat.device, torch.float32).contiguous()
    return flat, s, c


def ternarize_pack(
    tensor: Tensor, scale: Tensor, clip: Optional[Tensor], bucket: int, key: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Ternarize with the counter-based stream and pack into the 2-bit quarter-split layout of ``wire.py``.

    Args:
        tensor: the gradient (any shape; flattened).
        scale: the scaler s per chunk (shared over ranks or this rank's own).
        clip: per-chunk clip threshold applied to |g| before drawing (``"paper"`` clipping), or ``None``.
        bucket: chunk length.
        key: the stream key from :func:`lightning_gradcomp.kernels.rng.stream_key`.

    Returns:
        ``(packed, nonzero)``: ``ceil(n/4)`` uint8 bytes and the number of nonzero ternaries (int64, 1 element).
    """
    flat, s, c = _args(tensor, scale, clip)
    ext = extension_for(flat)
    if ext is not None:
        packed, nonzero = ext.terngrad_ternarize_pack(flat, s, c, bucket, key[0], key[1])
        return packed, nonzero
    t = _ternary_torch(flat, s, clip, bucket, key)
    return pack_ternary(t, "2bit"), (t != 0).sum().reshape(1)


def ternarize_int8(
    tensor: Tensor, scale: Tensor, clip: Optional[Tensor], bucket: int, key: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Like :func:`ternarize_pack`, but the int8 values in {-1, 0, 1} (the summable all-reduce form)."""
    flat, s, c = _args(tensor, scale, clip)
    ext = extension_for(flat)
    if ext is not None:
        values, nonzero = ext.terngrad_ternarize_int8(flat, s, c, bucket, key[0], key[1])
        return values, nonzero
    t = _ternary_torch(flat, s, clip, bucket, key)
    return t, (t != 0).sum().reshape(1)


def _check_out(out: Optional[Tensor], numel: int, device: torch.device) -> None:
    if out is not None and not (
        out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel and out.device == device
    ):
        raise ValueError(
            f"Expected `out` to be a contiguous float32 tensor of {numel} elements on {device}, but got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}. Pass None to allocate one."
        )


def _no_out(device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def decode(packed: Tensor, numel: int, scale: Tensor, bucket: int, out: Optional[Tensor] = None) -> Tensor:
    """float32 ``values * scale`` of one 2-bit payload (flat, ``numel`` elements), into ``out`` if given."""
    s = scale.reshape(-1).to(packed.device, torch.float32).contiguous()
    _check_out(out, numel, packed.device)
    ext = extension_for(packed)
    if ext is not None:
        return ext.terngrad_decode(packed.contiguous(), numel, s, bucket, _no_out(packed.device) if out is None else out)
    values = unpack_ternary(packed, numel, "2bit")
    return torch.mul(values.float(), _per_element(s, bucket, numel), out=out)


def decode_sum(
    packed: Sequence[Tensor], numel: int, scale: Tensor, bucket: int, out: Optional[Tensor] = None, divisor: int = 1
) -> Tensor:
    """float32 sum of several 2-bit payloads sharing one scaler: integer sum, scaled once (exact).

    ``divisor`` > 1 divides the scaled sum by it in float32 in the same pass (the mean over ranks): the result
    equals ``decode_sum(...).div_(divisor)`` bit for bit.
    """
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"Expected `divisor` to be an integer >= 1 (the number of ranks averaged), but got {divisor!r}.")
    device = packed[0].device
    s = scale.reshape(-1).to(device, torch.float32).contiguous()
    _check_out(out, numel, device)
    ext = extension_for(*packed)
    if ext is not None:
        payloads = [p.contiguous() for p in packed]
        return ext.terngrad_decode_sum(payloads, numel, s, bucket, _no_out(device) if out is None else out, divisor)
    total = unpack_ternary(packed[0], numel, "2bit").to(torch.int32)
    for p in packed[1:]:
        total = total + unpack_ternary(p, numel, "2bit")
    result = torch.mul(total.float(), _per_element(s, bucket, numel), out=out)
    return result.div_(divisor) if divisor != 1 else result
