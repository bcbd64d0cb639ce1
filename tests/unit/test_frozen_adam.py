"""1-bit Adam / 0/1 Adam in one process: argument errors, the task's optimizer choice, the phase counters in the
optimizer's state dict, and the single-process arithmetic against a written-out reference."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradcomp_lab.models import MLP
from gradcomp_lab.tasks import CharLanguageModel, ImageClassifier
from lightning_gradcomp.optimizers import OneBitAdam, SignSGD, ZeroOneAdam
from lightning_gradcomp.optimizers.frozen_adam import _Alone
from tests.harness import free_port
from lightning_gradcomp.optimizers.frozen_adam import VARIANCE_FLOOR


@pytest.mark.parametrize(
    ("cls", "options", "argument"),
    [(OneBitAdam, {"freeze_step": 0}, "freeze_step"), (ZeroOneAdam, {"var_update_scaler": 0}, "var_update_scaler"),
     (OneBitAdam, {"lr": -1.0}, "lr"), (ZeroOneAdam, {"local_step_clipper": 1.5}, "local_step_clipper"),
     (ZeroOneAdam, {"eps": -1e-8}, "eps"), (OneBitAdam, {"weight_decay": -0.1}, "weight_decay")],
)
def test_bad_options_name_argument_and_fix(cls: type, options: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=f"`{argument}`.*Fix:"):
        cls(nn.Linear(2, 2).parameters(), **options)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
@pytest.mark.parametrize(("betas", "index"), [((1.0, 0.999), 0), ((0.9, 1.0), 1), ((0.9, -0.5), 1), ((1.5, 0.9), 0)])
def test_betas_outside_zero_one_are_refused_as_torch_adam_does(cls: type, betas: tuple, index: int) -> None:
    # at exactly 1 a moment never leaves zero: with beta1 = 1 the parameters would never change
    with pytest.raises(ValueError, match=rf"Expected `betas\[{index}\]` to be a finite number >= 0 and < 1, but got "
                                         rf"{betas[index]}\. Fix: use a decay in \[0, 1\)"):
        cls(nn.Linear(2, 2).parameters(), betas=betas)
    cls(nn.Linear(2, 2).parameters(), betas=(0.0, 0.0))  # the closed end stays allowed, as torch's


def test_signsgd_still_imports_from_the_package() -> None:
    assert SignSGD.__module__ == "lightning_gradcomp.optimizers.sign"


def test_task_builds_the_optimizer_with_its_options() -> None:
    task = CharLanguageModel(MLP(4, 3, 1, 2), optimizer="onebit_adam", lr=0.01, weight_decay=0.1,
                             optimizer_options={"freeze_step": 7})
    optimizer = task.configure_optimizers()["optimizer"]
    assert type(optimizer) is OneBitAdam and optimizer.freeze_step == 7
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    task = CharLanguageModel(MLP(4, 3, 1, 2), optimizer="zero_one_adam", optimizer_options={"var_freeze_step": 5})
    assert task.configure_optimizers()["optimizer"].var_freeze_step == 5


def test_task_refuses_unknown_or_misplaced_optimizer_options() -> None:
    with pytest.raises(ValueError, match=r"among \['freeze_step', 'bias_correction', 'deepspeed_compat'\], but got \['freeze_steps'\].*did you mean 'freeze_step'"):
        ImageClassifier(MLP(4, 3, 1, 2), optimizer="onebit_adam", optimizer_options={"freeze_steps": 3})
    with pytest.raises(ValueError, match=r"`optimizer_options` only with optimizer.*Fix:"):
        ImageClassifier(MLP(4, 3, 1, 2), optimizer="adamw", optimizer_options={"freeze_step": 3})
    with pytest.raises(ValueError, match="`var_freeze_step`"):
        ImageClassifier(MLP(4, 3, 1, 2), optimizer="zero_one_adam", optimizer_options={"var_freeze_step": 0})


def _steps(optimizer: torch.optim.Optimizer, model: nn.Module, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        optimizer.zero_grad()
        model(torch.randn(4, 3, generator=gen)).pow(2).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_state_dict_carries_the_phase_counters(cls: type) -> None:
    options = {"freeze_step": 2} if cls is OneBitAdam else {"var_freeze_step": 2, "local_step_scaler": 1}
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = cls(model.parameters(), lr=0.01, **options)
    _steps(optimizer, model, 5)
    saved, weights = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model.state_dict())
    _steps(optimizer, model, 3, start=5)
    expected = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(weights)
    again = cls(model.parameters(), lr=0.01, **options)
    again.load_state_dict(saved)
    assert again.counters == saved["frozen_adam"] and again.phase == optimizer.phase != cls(model.parameters()).phase
    _steps(again, model, 3, start=5)
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


@pytest.mark.parametrize("deepspeed_compat", [True, False])
def test_one_process_onebit_adam_is_adam_then_frozen_variance(deepspeed_compat: bool) -> None:
    """``deepspeed_compat``: DeepSpeed's arithmetic (no bias correction, no floor); by default, Adam's bias
    correction and the frozen variance floored at :data:`VARIANCE_FLOOR` of its tensor's mean."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    p0 = [p.detach().clone() for p in model.parameters()]
    optimizer = OneBitAdam(model.parameters(), lr=0.01, weight_decay=0.1, freeze_step=2,
                           deepspeed_compat=deepspeed_compat)
    assert optimizer.bias_correction is not deepspeed_compat
    _steps(optimizer, model, 4)
    # written out: m, v from the gradients at the current weights; v frozen after step 2
    ref = nn.Linear(3, 2)
    with torch.no_grad():
        for q, p in zip(ref.parameters(), p0):
            q.copy_(p)
    m = [torch.zeros_like(p) for p in p0]
    v = [torch.zeros_like(p) for p in p0]
    for step in range(4):
        ref.zero_grad()
        ref(torch.randn(4, 3, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        with torch.no_grad():
            for i, q in enumerate(ref.parameters()):
                assert q.grad is not None
                m[i] = 0.9 * m[i] + 0.1 * q.grad
                if step < 2:
                    v[i] = 0.999 * v[i] + 0.001 * q.grad * q.grad
                if step == 1 and not deepspeed_compat:
                    v[i] = torch.maximum(v[i], VARIANCE_FLOOR * v[i].mean())
                if deepspeed_compat:
                    q.sub_(0.01 * (m[i] / (v[i].sqrt() + 1e-8) + 0.1 * q))
                else:
                    corrected = v[i] / (1 - 0.999 ** min(step + 1, 2))
                    q.sub_(0.01 * (m[i] / (1 - 0.9 ** (step + 1)) / (corrected.sqrt() + 1e-8) + 0.1 * q))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_with_bias_correction_the_dense_phase_is_torch_adamw(cls: type) -> None:
    """Before the variance freezes (every step a variance update), ``bias_correction=True`` is AdamW."""
    torch.manual_seed(0)
    model, twin = nn.Linear(3, 2), nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    options = {"freeze_step": 10} if cls is OneBitAdam else {"var_freeze_step": 10}
    _steps(cls(model.parameters(), lr=0.01, weight_decay=0.1, bias_correction=True, **options), model, 5)
    _steps(torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1), twin, 5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_scale_blocks_cut_every_piece_and_bad_sizes_name_the_fix() -> None:
    from lightning_gradcomp import OneBitAdamStrategy, ZeroOneAdamStrategy
    from lightning_gradcomp.onebit_adam.exchange import chunk_pieces

    # pieces are cut at the chunk boundaries first, then in blocks (the last one shorter): no block spans two pieces
    assert chunk_pieces([("a", 130), ("b", 10)], 2, 64) == [[("a:0#0", 64), ("a:0#1", 6)], [("a:1#0", 60), ("b#0", 10)]]
    assert chunk_pieces([("a", 130), ("b", 10)], 2) == [[("a:0", 70)], [("a:1", 60), ("b", 10)]]
    assert ZeroOneAdamStrategy(scale_block=64).scale_block == 64
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=r"`scale_block`.*Fix: use e.g. 64"):
            OneBitAdamStrategy(scale_block=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_unbound_in_a_distributed_run_refuses_its_first_step_before_anything_runs(cls: type[OneBitAdam | ZeroOneAdam]) -> None:
    """Under any strategy but its own (stock DDP, a GradCompStrategy, the sharded engine, DiLoCo, Fabric) nothing
    binds the exchange: the first step refuses before the closure (forward, backward, collectives) or any update."""
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = cls(model.parameters())
    optimizer.resolve_warmup(100)  # what the paired strategy does at setup with the default fraction
    closure_ran = []

    def closure() -> float:
        closure_ran.append(True)
        loss = model(torch.ones(1, 3)).sum()
        loss.backward()
        return loss.item()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=rf"Expected {cls.__name__} to step under Trainer\(strategy="
                                             rf"'{cls.paired_strategy}'\).*but got it unbound in a distributed run of "
                                             rf"1 rank\(s\).*Fix: use Trainer\(strategy='{cls.paired_strategy}'\)"):
            optimizer.step(closure)
        assert not closure_ran and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert optimizer.counters["step"] == 0
        optimizer.bind(_Alone())  # what the paired strategy does (here the identity: one rank)
        optimizer.step(closure)
    finally:
        dist.destroy_process_group()
    assert closure_ran and optimizer.counters["step"] == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize(
    ("strategy", "option", "fix"),
    [("ZeroOneAdamStrategy", "freeze_step", "`ZeroOneAdam(self.parameters(), var_freeze_step=10)`"),
     ("ZeroOneAdamStrategy", "var_freeze_step", "`ZeroOneAdam(self.parameters(), var_freeze_step=10)`"),
     ("OneBitAdamStrategy", "var_freeze_step", "`OneBitAdam(self.parameters(), freeze_step=10)`"),
     ("OneBitAdamStrategy", "freeze_step", "`OneBitAdam(self.parameters(), freeze_step=10)`"),
     ("OneBitAdamStrategy", "local_step_scaler",
      "`ZeroOneAdam(self.parameters(), local_step_scaler=10)` from configure_optimizers, with "
      "Trainer(strategy='zero_one_adam')")],
)
def test_an_optimizer_option_given_to_the_strategy_names_the_optimizer(strategy: str, option: str, fix: str) -> None:
    import lightning_gradcomp

    with pytest.raises(ValueError) as raised:
        getattr(lightning_gradcomp, strategy)(**{option: 10})
    message = str(raised.value)
    assert message.startswith(f"Expected `{option}` to be given to the optimizer, but got {strategy}({option}=10)")
    assert f"Fix: drop it here and return {fix}" in message
    assert "compressor" not in message  # not the generic unknown-option fix


def test_default_warmup_is_a_fraction_of_the_run_resolved_at_setup() -> None:
    optimizer = OneBitAdam(nn.Linear(2, 2).parameters())
    assert optimizer.bias_correction and not optimizer.deepspeed_compat and optimizer.warmup_fraction == 0.15
    model = nn.Linear(3, 2)
    optimizer = OneBitAdam(model.parameters())
    with pytest.raises(ValueError, match=r"Expected `freeze_step` in steps but got the fraction 0.15.*Fix:.*resolve_warmup"):
        _steps(optimizer, model, 1)
    assert optimizer.resolve_warmup(120) == optimizer.freeze_step == 18
    assert ZeroOneAdam(model.parameters(), var_freeze_step=0.5).resolve_warmup(7) == 4
    assert OneBitAdam(model.parameters(), freeze_step=0.01).resolve_warmup(10) == 1  # at least one dense step
    assert OneBitAdam(model.parameters(), freeze_step=40).resolve_warmup(120) == 40  # steps stay steps


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -3, True, "10"])
def test_a_warmup_neither_steps_nor_a_fraction_is_refused(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match=r"Expected `var_freeze_step` to be an int >= 1 \(steps\) or a float in \(0, 1\).*Fix:"):
        ZeroOneAdam(nn.Linear(2, 2).parameters(), var_freeze_step=bad)  # type: ignore[arg-type]


def test_warmup_warnings_name_the_value_to_use() -> None:
    params = list(nn.Linear(2, 2).parameters())
    never = OneBitAdam(params, freeze_step=100000)
    [message] = never.warmup_warnings(120)
    assert "freeze_step=100000 is at or past the run's 120 steps: no step is compressed" in message
    assert "Fix: freeze_step=18" in message
    assert OneBitAdam(params, freeze_step=120).warmup_warnings(120) and not OneBitAdam(params, freeze_step=119).warmup_warnings(120)
    # uncorrected, 15 updates of beta2 0.999 hold 1.5 % of the variance's scale: 693 updates hold half
    short = OneBitAdam(params, freeze_step=15, deepspeed_compat=True)
    [message] = short.warmup_warnings(120)
    assert "after 15 updates" in message and "Fix: bias_correction=True (the default), or freeze_step=693" in message
    assert OneBitAdam(params, freeze_step=15).warmup_warnings(120) == []  # corrected: Adam's scale at any length
    assert OneBitAdam(params, freeze_step=693, bias_correction=False).warmup_warnings(1000) == []
    [message] = ZeroOneAdam(params, var_freeze_step=40, deepspeed_compat=True).warmup_warnings(120)
    assert "var_update_scaler=693 with var_freeze_step=693" in message
    # 0/1 Adam compresses its variance phase's other steps: only a run of variance updates alone never compresses
    assert ZeroOneAdam(params).resolve_warmup(120) == 18 and ZeroOneAdam(params, var_freeze_step=500).warmup_warnings(120) == []
    assert "no step is compressed" in ZeroOneAdam(params, var_freeze_step=500).warmup_warnings(16)[0]


@pytest.mark.parametrize("steps", [1, 16, 17, 40, 49, 50, 51, 130])
def test_zero_one_adam_counts_its_variance_updates_as_it_steps(steps: int) -> None:
    model = nn.Linear(3, 2)
    optimizer = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=45, var_update_scaler=4)
    _steps(optimizer, model, steps)
    assert optimizer.variance_updates(steps) == optimizer.counters["var_updates"]


@pytest.mark.parametrize("deepspeed_compat", [True, False])
def test_the_frozen_variance_has_a_floor_unless_deepspeed_compat(deepspeed_compat: bool) -> None:
    model = nn.Linear(3, 2)
    optimizer = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=1, deepspeed_compat=deepspeed_compat)
    model.bias.register_hook(lambda g: g * torch.tensor([1.0, 0.0]))  # the second bias gets no gradient
    _steps(optimizer, model, 2)
    v = optimizer.state[model.bias]["exp_avg_sq"]
    assert optimizer.counters["var_frozen"]
    # the floor: a hundredth of the tensor's mean variance before the floor, (v[0] + 0) / 2
    assert (v[1] == 0) if deepspeed_compat else torch.isclose(v[1], VARIANCE_FLOOR * v[0] / 2)
