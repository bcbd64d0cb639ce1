"""The Gradient Synchronizer's significance filter with the dynamic threshold G_thresh (WeightGrad App. A.2).

Per layer (interpretations, see ``docs/weightgrad.md``):

* G_thresh starts at ``||g||_2 / ||g||_inf`` of the first site-averaged gradient of the layer.
* Eq. 13, ``G <- delta_eta * Delta_nu * G``, with both "changes" read as ratios between consecutive steps:
  ``delta_eta = lr_t / lr_{t-1}`` and ``Delta_nu = ||nu_t|| / ||nu_{t-1}||``, where ``nu`` is the
  momentum-correction velocity ``u <- m*u + g`` of the site gradient, bias-corrected (divided by its gain
  ``(1 - m^t) / (1 - m)``) so that the accumulator's warm-up does not raise the threshold. Ratios telescope,
  so ``G_t = G_0 * (lr_t / lr_0) * (||nu_t|| / ||nu_0||)`` whether it is applied per step or per epoch.
  The paper says the threshold *decreases* with the loss; the literal ratio rises whenever the gradient norm
  rises, and then locks layers out of the WAN while the site's momentum keeps growing (a run with T = 1
  diverged, ``docs/weightgrad.md``). So by default (``rule="capped"``) G never rises above its start
  ``G_0``, the level at which one fresh step is significant: ``G_t = G_0 * min(1, lr ratio * nu ratio)``.
* Significance compares the site's accumulated update ``g_u`` with the largest element of the current update
  (Alg. 4's ``g_u / g_max``), both in weight units so that any optimizer fits (for plain SGD ``step = -lr*g``
  and the ratios are exactly the paper's gradient ratios). ``scope="layer"`` (default) sends the whole layer
  when ``||g_u||_2 / max|step| >= G``: the only reading whose units match the initial value
  ``||g||_2 / ||g||_inf`` (at the first step ``g_u`` is the step and the ratio *is* that value).
  ``scope="element"`` is the literal per-element reading ``|g_u[k]| / max|step| >= G``; with
  ``G ~ ||g||_2/||g||_inf`` it asks each element to accumulate about the whole layer's L2 norm, so very little
  is ever sent (measured in ``docs/weightgrad.md``).
* ``scope="relative"`` is Gaia's significance function instead: element k is significant when
  ``|g_u[k]| >= G * |w[k]|`` (the update changes the weight by at least the fraction G); G starts at
  ``relative_start`` (0.01, Gaia's 1%: an assumption, the Gaia paper was not read) and follows Eq. 13.
* A fixed ``threshold`` replaces the dynamic rule; ``threshold=0`` makes everything significant.
"""

from typing import Any, Literal, Optional

import torch
from torch import Tensor

Scope = Literal["layer", "element", "relative"]
Rule = Literal["capped", "eq13"]

#: Gaia's significance threshold, 1% relative change (assumed, see NOTES 4.5)
RELATIVE_START = 0.01


class SignificanceFilter:
    """Per-layer G_thresh and the significance mask of accumulated updates.

    Args:
        threshold: a fixed G_thresh, or ``None`` for the dynamic rule (initial ``||g||_2/||g||_inf``, Eq. 13).
        scope: ``"layer"`` (all or nothing per layer), ``"element"`` (per element) or ``"relative"`` (per element,
            relative to the weight, Gaia's filter).
        momentum: m of the momentum-correction velocity whose change drives Eq. 13.
        rule: ``"capped"`` (default): Eq. 13, but G never rises above its start; ``"eq13"``: the literal ratio,
            which rises whenever the gradient norm rises.
    """

    def __init__(
        self, threshold: Optional[float] = None, scope: Scope = "layer", momentum: float = 0.9, rule: Rule = "capped"
    ) -> None:
        self.threshold = threshold
        self.rule = rule
        self.scope = scope
        self.momentum = momentum
        self.g_thresh: dict[str, Tensor] = {}
        self._velocity: dict[str, Tensor] = {}
        self._start: dict[str, tuple[Tensor, float, Tensor]] = {}
        self._steps: dict[str, int] = {}

    def observe(self, name: str, grad: Tensor, lr: float) -> None:
        """Feed the layer's site-averaged gradient of this step and the learning rate it was applied with."""
        if self.threshold is not None:
            self.g_thresh[name] = torch.tensor(float(self.threshold))
            return
        g = grad.detach().float()
        m = self.momentum
        velocity = self._velocity.get(name)
        velocity = g.clone() if velocity is None else velocity.mul_(m).add_(g)
        self._velocity[name] = velocity
        steps = self._steps.get(name, 0) + 1
        self._steps[name] = steps
        gain = float(steps) if m == 1.0 else (1.0 - m**steps) / (1.0 - m)
        nu_norm = velocity.norm() / gain
        if name not in self._start:
            gmax = g.abs().max()
            if bool(gmax > 0):  # an all-zero first gradient says nothing; start at the next one
                start = torch.tensor(RELATIVE_START) if self.scope == "relative" else g.norm() / gmax
                self._start[name] = (start, lr, nu_norm)
                self.g_thresh[name] = start
            return
        # Eq. 13 with ratios telescopes to the change since the start
        start, lr0, nu0 = self._start[name]
        factor = (lr / lr0 if lr0 > 0 else 1.0) * (nu_norm / nu0 if bool(nu0 > 0) else torch.ones(()))
        if self.rule == "capped":  # follows the LR and the gradients down, never above where it started
            factor = torch.clamp(torch.as_tensor(factor), max=1.0)
        self.g_thresh[name] = start * factor

    def threshold_of(self, name: str) -> Tensor:
        """The layer's current G_thresh (0 before the first non-zero gradient: everything is significant)."""
        if self.threshold is not None:
            return torch.tensor(float(self.threshold))
        return self.g_thresh.get(name, torch.zeros(()))

    def mask(self, name: str, pending: Tensor, step: Tensor, weight: Optional[Tensor] = None) -> Tensor:
        """Boolean mask of the significant part of ``pending`` (the accumulated update).

        Args:
            name: the layer.
            pending: the site's accumulated update ``g_u``.
            step: this step's local update (the reference of ``"layer"`` and ``"element"``).
            weight: the layer's weights at the last synchronization (the reference of ``"relative"``).
        """
        g = self.threshold_of(name).to(pending.device)
        if self.scope == "relative":
            assert weight is not None, "the relative significance needs the weights"
            return pending.abs() >= g * weight.abs()
        reference = step.abs().max()
        if self.scope == "layer":
            keep = pending.float().norm() >= g * reference
            return keep.expand(pending.shape)
        return pending.abs() >= g * reference

    def state_dict(self) -> dict[str, Any]:
        return {
            "g_thresh": dict(self.g_thresh),
            "velocity": {k: v.clone() for k, v in self._velocity.items()},
            "start": dict(self._start),
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g_thresh = dict(state["g_thresh"])
        self._velocity = {k: v.clone() for k, v in state["velocity"].items()}
        self._start = dict(state["start"])
        self._steps = dict(state["steps"])
