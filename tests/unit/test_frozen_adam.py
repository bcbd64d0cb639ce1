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
    with pytest.raises(ValueError, match=r"among \['freeze_step', 'bias_correction'\], but got \['freeze_steps'\].*did you mean 'freeze_step'"):
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


def test_one_process_onebit_adam_is_adam_without_bias_correction_then_frozen_variance() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    p0 = [p.detach().clone() for p in model.parameters()]
    optimizer = OneBitAdam(model.parameters(), lr=0.01, weight_decay=0.1, freeze_step=2)
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
                q.sub_(0.01 * (m[i] / (v[i].sqrt() + 1e-8) + 0.1 * q))
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
