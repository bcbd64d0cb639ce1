"""Optimisation shared by the tasks: optimizer choice, L2 inside the loss, and the LR schedule."""

from collections.abc import Iterable
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from gradcomp_lab.schedules import WarmupCosine
from lightning_gradcomp.optimizers import OneBitAdam, SignSGD, ZeroOneAdam
from lightning_gradcomp.registry import did_you_mean
from lightning_gradcomp.validation import check_choice, check_int, check_number

OptimizerName = Literal["sgd", "momentum", "adam", "adagrad", "adamw", "signsgd", "onebit_adam", "zero_one_adam"]
ScheduleName = Literal["constant", "poly", "staircase", "cosine"]
_OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "adamw", "signsgd", "onebit_adam", "zero_one_adam")
#: the optimizers that take ``optimizer_options`` (the method's own options)
_FROZEN_ADAM = {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam}
_FROZEN_ADAM_OPTIONS = {
    "onebit_adam": ("freeze_step", "bias_correction", "deepspeed_compat"),
    "zero_one_adam": ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                      "bias_correction", "deepspeed_compat"),
}


def regularized_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a model's reference code puts under L2 decay.

    A model may define ``regularized_parameters()`` (LeNet: all weights; CifarNet: fc3/fc4 weights only);
    otherwise every parameter with more than one dimension (weights, not biases or norm scales).
    """
    chooser = getattr(model, "regularized_parameters", None)
    return list(chooser()) if callable(chooser) else [p for p in model.parameters() if p.ndim > 1]


def l2_penalty(parameters: Iterable[Tensor]) -> Tensor:
    """``sum(0.5 * ||w||^2)``, TF's ``tf.nn.l2_loss`` summed over ``parameters``."""
    squares = [p.pow(2).sum() for p in parameters]
    return 0.5 * torch.stack(squares).sum() if squares else torch.zeros(())


class TrainingTask(LightningModule):
    """Base LightningModule holding ``model`` and configuring its optimizer and LR schedule.

    Args:
        model: the network (any ``nn.Module``; under LightningCLI a ``class_path``/``init_args`` object).
        optimizer: ``"sgd"`` (vanilla), ``"momentum"`` (SGD with ``momentum``, TF's MomentumOptimizer),
            ``"adam"`` (TF defaults: betas 0.9/0.999, eps 1e-8), ``"adagrad"``, ``"adamw"`` (decoupled weight
            decay, betas ``adam_betas``, eps 1e-8) or ``"signsgd"`` (:class:`~lightning_gradcomp.optimizers.SignSGD`,
            DeMo's update, decoupled weight decay), ``"onebit_adam"`` / ``"zero_one_adam"``
            (:class:`~lightning_gradcomp.optimizers.OneBitAdam` / ``ZeroOneAdam``, betas ``adam_betas``, eps 1e-8;
            for ``strategy: onebit_adam`` / ``zero_one_adam``).
        lr: base learning rate.
        momentum: momentum of ``"momentum"``.
        weight_decay: L2 coefficient, applied to :func:`regularized_parameters` only.
        weight_decay_in_loss: add ``weight_decay * sum(0.5 * ||w||^2)`` to the loss (TernGrad's code) so the
            decay gradient travels inside the compressed gradient; otherwise the optimizer applies it after
            the exchange.
        lr_schedule: ``"constant"``, ``"poly"`` (polynomial decay to 0 over ``max_steps`` with ``poly_power``:
            TF's ``polynomial_decay``, torch's ``PolynomialLR``) or ``"staircase"`` (multiply by ``decay_rate`` every
            ``decay_steps`` steps or ``decay_epochs`` epochs: TF's ``exponential_decay(staircase=True)``, torch's
            ``StepLR``) or ``"cosine"`` (linear warm-up over ``warmup_steps``, cosine decay to ``end_factor`` at
            ``max_steps``: :class:`~gradcomp_lab.schedules.WarmupCosine` through ``LambdaLR``).
        max_steps: steps of the polynomial or cosine decay (``None``: the Trainer's estimated total steps). The ``gradcomp``
            CLI links it to ``trainer.max_steps``, so that one override moves both.
        poly_power: exponent of the polynomial decay (0.5 in TernGrad and WeightGrad).
        decay_steps: steps between staircase decays.
        decay_epochs: epochs between staircase decays (used when ``decay_steps`` is ``None``).
        decay_rate: staircase multiplier.
        warmup_steps: linear warm-up steps of the ``"cosine"`` schedule.
        end_factor: final LR of the ``"cosine"`` schedule as a fraction of ``lr``.
        adam_betas: ``"adamw"``'s betas (GPT-2/nanoGPT: 0.9, 0.95).
        init_weights: a Lightning checkpoint (or a saved ``state_dict``) whose ``model.*`` weights start this run;
            the optimizer, schedule and strategy start afresh (DiLoCo's dense warm start: its runs begin from a
            model pretrained with synchronous training). Loaded on every rank, before the strategy sees the model.
        optimizer_options: the method's own options of ``"onebit_adam"`` (``freeze_step``, ``bias_correction``,
            ``deepspeed_compat``) or ``"zero_one_adam"`` (``var_freeze_step``, ``var_update_scaler``,
            ``local_step_scaler``, ``local_step_clipper``, ``bias_correction``, ``deepspeed_compat``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerName = "momentum",
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        weight_decay_in_loss: bool = False,
        lr_schedule: ScheduleName = "constant",
        max_steps: Optional[int] = None,
        poly_power: float = 0.5,
        decay_steps: Optional[int] = None,
        decay_epochs: Optional[float] = None,
        decay_rate: float = 0.1,
        warmup_steps: int = 0,
        end_factor: float = 0.1,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        init_weights: Optional[str] = None,
        optimizer_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        check_choice("optimizer", optimizer, _OPTIMIZERS)
        if optimizer_options and optimizer not in _FROZEN_ADAM:
            raise ValueError(
                f"Expected `optimizer_options` only with optimizer {sorted(_FROZEN_ADAM)}, but got {optimizer_options!r} "
                f"with optimizer {optimizer!r}. Fix: drop `optimizer_options`, or use one of those optimizers."
            )
        check_number("lr", lr, minimum=0.0, min_open=True)
        check_number("momentum", momentum, minimum=0.0, maximum=1.0, max_open=True)
        check_number("weight_decay", weight_decay, minimum=0.0)
        check_choice("lr_schedule", lr_schedule, ("constant", "poly", "staircase", "cosine"))
        check_int("warmup_steps", warmup_steps, minimum=0)
        check_number("end_factor", end_factor, minimum=0.0, maximum=1.0)
        if len(adam_betas) != 2:
            raise ValueError(
                f"Expected `adam_betas` to be two numbers (beta1, beta2), but got {adam_betas!r}. "
                "Fix: pass e.g. (0.9, 0.95)."
            )
        beta1, beta2 = adam_betas  # also turns the list a YAML config gives into the pair AdamW takes
        for beta in (beta1, beta2):
            check_number("adam_betas", beta, minimum=0.0, maximum=1.0, max_open=True)
        if max_steps is not None:
            check_int("max_steps", max_steps, minimum=1)
        check_number("poly_power", poly_power, minimum=0.0, min_open=True)
        if decay_steps is not None:
            check_int("decay_steps", decay_steps, minimum=1)
        if decay_epochs is not None:
            check_number("decay_epochs", decay_epochs, minimum=0.0, min_open=True)
        if lr_schedule == "staircase" and decay_steps is None and decay_epochs is None:
            raise ValueError(
                "Expected `decay_steps` or `decay_epochs` with `lr_schedule='staircase'`, but got neither. "
                "Fix: set one of them (TernGrad AlexNet: decay_epochs=20)."
            )
        check_number("decay_rate", decay_rate, minimum=0.0, maximum=1.0, min_open=True)
        if lr_schedule == "cosine" and max_steps is not None:
            # the schedule's own checks, here before the first step rather than in configure_optimizers on every rank
            WarmupCosine(max_steps, warmup_steps, end_factor)
        self.model = model
        self.optimizer_name, self.lr, self.momentum = optimizer, lr, momentum
        self.weight_decay, self.weight_decay_in_loss = weight_decay, weight_decay_in_loss
        self.lr_schedule, self.max_steps, self.poly_power = lr_schedule, max_steps, poly_power
        self.decay_steps, self.decay_epochs, self.decay_rate = decay_steps, decay_epochs, decay_rate
        self.warmup_steps, self.end_factor, self.adam_betas = warmup_steps, end_factor, (beta1, beta2)
        self.optimizer_options = dict(optimizer_options or {})
        if optimizer in _FROZEN_ADAM:  # a misspelt option or a bad value fails here, before the Trainer starts
            allowed = _FROZEN_ADAM_OPTIONS[optimizer]
            unknown = sorted(set(self.optimizer_options) - set(allowed))
            if unknown:
                raise ValueError(
                    f"Expected `optimizer_options` of {optimizer!r} among {list(allowed)}, but got {unknown}. Fix: "
                    f"{did_you_mean(unknown[0], allowed)}use those names (lr, betas and weight decay are the task's)."
                )
            _FROZEN_ADAM[optimizer]([torch.zeros(1, requires_grad=True)], lr=lr, **self.optimizer_options)
        if init_weights is not None:
            self.model.load_state_dict(_model_weights(init_weights))

    @override
    def configure_model(self) -> None:
        """Shard the model with FSDP2 when the strategy gives a ``("replicate", "shard")`` device mesh
        (:class:`~lightning_gradcomp.ShardedGradCompStrategy`): each of the model's ``blocks`` (a transformer's
        layers), then the model itself, over the mesh's ``"shard"`` dimension. Any other strategy: nothing."""
        mesh = self._device_mesh
        if mesh is None or "shard" not in (mesh.mesh_dim_names or ()):
            return
        from torch.distributed.fsdp import fully_shard

        for block in getattr(self.model, "blocks", ()):
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(self.model, mesh=mesh["shard"])

    def regularization(self) -> Tensor:
        """``weight_decay * sum(0.5 * ||w||^2)`` when the decay lives in the loss, else 0."""
        if not self.weight_decay_in_loss or self.weight_decay == 0.0:
            return torch.zeros((), device=self.device)
        return self.weight_decay * l2_penalty(regularized_parameters(self.model)).to(self.device)

    def _lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """torch's scheduler with the papers' schedule (``tests/unit/test_lr_schedules.py`` compares them with TF's
        formulas step by step); ``None`` for a constant LR."""
        if self.lr_schedule == "poly":
            steps = self.max_steps or self.trainer.estimated_stepping_batches
            check_int("max_steps", steps, minimum=1, fix="set `max_steps` (or the Trainer's) for polynomial decay")
            return torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=int(steps), power=self.poly_power)
        if self.lr_schedule == "cosine":
            steps = self.max_steps or self.trainer.estimated_stepping_batches
            check_int("max_steps", steps, minimum=1, fix="set `max_steps` (or the Trainer's) for cosine decay")
            return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(int(steps), self.warmup_steps, self.end_factor))
        if self.lr_schedule == "staircase":
            step_size = self.decay_steps
            if step_size is None:
                self.trainer.estimated_stepping_batches  # noqa: B018  (loads the train loader to count batches)
                per_epoch = max(1, self.trainer.num_training_batches // self.trainer.accumulate_grad_batches)
                step_size = max(1, round(float(self.decay_epochs or 0.0) * per_epoch))
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=self.decay_rate)
        return None

    @override
    def configure_optimizers(self) -> Any:
        decayed = {id(p) for p in regularized_parameters(self.model)}
        optimizer_decay = 0.0 if self.weight_decay_in_loss else self.weight_decay
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if id(p) in decayed], "weight_decay": optimizer_decay},
            {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(groups, lr=self.lr, betas=(0.9, 0.999), eps=1e-8)
        elif self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.adam_betas, eps=1e-8)
        elif self.optimizer_name == "signsgd":
            optimizer = SignSGD(groups, lr=self.lr)
        elif self.optimizer_name in _FROZEN_ADAM:
            optimizer = _FROZEN_ADAM[self.optimizer_name](groups, lr=self.lr, betas=self.adam_betas, eps=1e-8,
                                                          **self.optimizer_options)
        elif self.optimizer_name == "adagrad":
            optimizer = torch.optim.Adagrad(groups, lr=self.lr)
        else:
            momentum = self.momentum if self.optimizer_name == "momentum" else 0.0
            optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=momentum)
        scheduler = self._lr_scheduler(optimizer)
        if scheduler is None:
            return {"optimizer": optimizer}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _model_weights(path: str) -> dict[str, Tensor]:
    """The ``model.*`` entries of a Lightning checkpoint's ``state_dict`` (prefix removed), or a bare state dict."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise ValueError(
            f"Expected `init_weights` to be a readable checkpoint, but got {path!r} ({exc}). Fix: pass the path of a "
            f"Lightning `.ckpt` (e.g. from `--trainer.enable_checkpointing=true`) or of a `torch.save`d state dict."
        ) from exc
    state = saved.get("state_dict", saved) if isinstance(saved, dict) else saved
    if not isinstance(state, dict):
        raise ValueError(f"Expected `init_weights` to hold a state dict, but got {type(state).__name__} in {path!r}. "
                         f"Fix: save `module.state_dict()` or a Lightning checkpoint.")
    prefixed = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return prefixed or state
