"""Loss-aware ternarization (LAT, Hou, Yao & Kwok, ICLR 2018), WeightGrad's quantizer between sites.

Hou et al. ternarize a tensor ``x`` as ``alpha * b`` with ``b in {-1, 0, 1}`` minimising the second-order
approximation of the loss, ``||x - alpha * b||^2_D``, for a diagonal ``D = sqrt(v) + eps`` built from the
optimizer's second-moment estimate ``v`` (Adam's ``exp_avg_sq``). Their approximate solver (the LAQ code's
``ternarize``) alternates ``b = sign(x) * [|x| > alpha / 2]`` and ``alpha = sum|b * D * x| / sum|b * D|`` from
the TWN start ``b = sign(x) * [|x| > 0.7 mean|x|]``. Without a second moment ``D = 1``: plain (TWN-style)
ternarization. Deterministic: no random draws.

WeightGrad (Akter & Adnan, KDD 2020) sends a site's significant weight updates between sites this way
(:class:`~lightning_gradcomp.weightgrad.synchronizer.GradientSynchronizer`, ``wan_quantization="loss_aware"``), with the
optimizer's second moment as the metric: its WAN message's compressor
(:class:`~lightning_gradcomp.weightgrad.quantize.WanMessage`) encodes :meth:`LossAwareTernary.ternarize`'s values in a
sparse or dense body per layer. As a compressor on its own, a packet is the 2-bit packed ``b`` followed by the fp32 ``alpha``;
every rank has its own ``alpha``, so packets are all-gathered.
"""

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.compressors.per_tensor import LayerLoop
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.validation import check_int, check_number
from lightning_gradcomp.wire.ternary import pack_ternary, packed_nbytes, unpack_ternary

#: the LAQ code's solver: stop when alpha moves less than this (relative)
_LAQ_TOL = 1e-6
#: the LAQ code's D = sqrt(v) + 1e-8
_LAQ_EPS = 1e-8

SecondMoment = Callable[[str], Optional[Tensor]]


class LossAwareTernary(LayerLoop):
    """Loss-aware ternary ``alpha * b`` per tensor under the optimizer's second moment (Hou et al.'s LAT).

    Written per tensor (:class:`~lightning_gradcomp.compressors.per_tensor.LayerLoop`): its iterative solver runs per
    layer, with host reads that decide when to stop, so a group is its layers one by one.

    Args:
        second_moment: parameter name -> the optimizer's second-moment estimate of that parameter (same shape as
            the tensor compressed under that name), or ``None`` where it has none; ``None`` (the default) for plain
            ternarization with ``D = 1``.
        iterations: the most alternations of ``(b, alpha)`` (the LAQ code: 10).
        eps: the ``eps`` of ``D = sqrt(v) + eps``.
    """

    aggregation = Aggregation.GATHER

    def __init__(self, second_moment: Optional[SecondMoment] = None, iterations: int = 10,
                 eps: float = _LAQ_EPS) -> None:
        super().__init__()
        check_int("iterations", iterations, minimum=1, fix="use 10 (the LAQ code)")
        check_number("eps", eps, minimum=0.0, fix="use 1e-8 (the LAQ code)")
        self.second_moment = second_moment
        self.iterations = iterations
        self.eps = float(eps)

    def metric(self, name: str) -> Optional[Tensor]:
        """``D = sqrt(v) + eps`` of parameter ``name`` (float32), or ``None`` for ``D = 1``."""
        v = None if self.second_moment is None else self.second_moment(name)
        return None if v is None else v.detach().float().sqrt().add_(self.eps)

    def ternarize(self, tensor: Tensor, name: str = "") -> tuple[Tensor, Tensor]:
        """``b`` (int8, ``tensor``'s flat length, values in {-1, 0, 1}) and ``alpha`` (a 0-d float32 scale).

        Args:
            tensor: the tensor (any shape, float).
            name: the parameter's name, which selects its second moment.
        """
        x = tensor.detach().float().reshape(-1)
        ax = x.abs()
        nonzero = ax > 0
        if not bool(nonzero.any()):
            return torch.zeros_like(x, dtype=torch.int8), x.new_zeros(())
        d = self.metric(name)
        w = torch.ones_like(x) if d is None else d.reshape(-1)
        mask = ax > 0.7 * ax[nonzero].mean()
        alpha = x.new_zeros(())
        for _ in range(self.iterations):
            wm = w * mask
            new_alpha = (wm * ax).sum() / wm.sum().clamp_min(torch.finfo(torch.float32).tiny)
            converged = bool((new_alpha - alpha).abs() <= _LAQ_TOL * new_alpha.clamp_min(1e-30))
            alpha = new_alpha
            new_mask = ax > 0.5 * alpha
            # stop before a step that would drop every element: the last non-empty b and its alpha stand
            if converged or not bool(new_mask.any()):
                break
            mask = new_mask
        b = torch.where(mask, torch.sign(x), torch.zeros_like(x)).to(torch.int8)
        return b, alpha

    @override
    def compress(self, tensor: Tensor, name: str = "", shared: Optional[Tensor] = None) -> Packet:
        b, alpha = self.ternarize(tensor, name)
        payload = torch.cat((pack_ternary(b, "2bit"), alpha.reshape(1).view(torch.uint8)))
        stats = {"sparsity": (b == 0).float().mean().nan_to_num(0.0), "scaler": alpha}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    @override
    def decompress(self, packet: Packet) -> Tensor:
        codes_end = packed_nbytes(packet.numel, "2bit")  # where alpha starts in the payload
        alpha = packet.payload[codes_end:].clone().view(torch.float32)  # a byte slice may be misaligned for fp32
        b = unpack_ternary(packet.payload[:codes_end], packet.numel, "2bit")
        return (b.float() * alpha).to(packet.dtype).view(packet.shape)

    @override
    def describe(self) -> dict[str, Any]:
        return {"compressor": "LossAwareTernary", "iterations": self.iterations, "eps": self.eps,
                "second_moment": self.second_moment is not None}
