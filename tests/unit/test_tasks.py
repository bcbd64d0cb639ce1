"""Training pieces: the task's LR schedule, the EMA callback, and the tasks under a real (single-process) Trainer."""

import math
import sys
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradcomp_lab.ema import ExponentialMovingAverage
from gradcomp_lab.models import MLP, CharLSTM, LeNet, Seq2SeqAttention
from gradcomp_lab.tasks import CharLanguageModel, ImageClassifier, Seq2SeqTask
from gradcomp_lab.tasks.base import OptimizerName


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(**kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    options.update(kwargs)
    return L.Trainer(**options)


# ---------------------------------------------------------------- schedules


def test_task_applies_schedule_per_step() -> None:
    task = ImageClassifier(LeNet(image_size=8), lr=0.1, lr_schedule="poly", max_steps=4)
    config = task.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.1, 0.1 * math.sqrt(0.75), 0.1 * math.sqrt(0.5), 0.1 * math.sqrt(0.25), 0.0])
    with pytest.raises(ValueError, match="decay_steps"):
        ImageClassifier(LeNet(), lr_schedule="staircase")
    with pytest.raises(ValueError, match="`adam_betas`"):
        ImageClassifier(LeNet(), optimizer="adamw", adam_betas=(0.9, 0.95, 0.99))


# ---------------------------------------------------------------- EMA


class _Scalar(L.LightningModule):
    """One parameter w, loss = c * w with SGD lr 1: w_t = w_0 - t * c, so the averages are easy by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0]))
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return 0.5 * self.w.sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen.append(float(self.w.detach()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_ema_matches_hand_computed_average() -> None:
    model = _Scalar()
    data = DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1)
    ema = ExponentialMovingAverage(decay=0.9999)
    _trainer(max_steps=2, callbacks=[ema], limit_val_batches=1).fit(model, data, data)
    w0, w1, w2 = 1.0, 0.5, 0.0
    d1, d2 = 2 / 11, 3 / 12  # min(0.9999, (1 + t) / (10 + t)) at t = 1, 2
    s1 = d1 * w0 + (1 - d1) * w1
    s2 = d2 * s1 + (1 - d2) * w2
    assert float(ema.shadow["w"]) == pytest.approx(s2)
    assert model.seen == pytest.approx([s2])  # validation ran on the average...
    assert float(model.w.detach()) == pytest.approx(w2)  # ...and the raw weights came back
    restored = ExponentialMovingAverage()
    restored.load_state_dict(ema.state_dict())
    assert float(restored.shadow["w"]) == pytest.approx(s2)


# ---------------------------------------------------------------- tasks under a Trainer


def _blobs(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    centres = torch.tensor([[2.0, 0.0], [-2.0, 2.0], [0.0, -2.0]])
    return TensorDataset(centres[labels] + 0.3 * torch.randn(n, 2, generator=generator), labels)


def test_image_classifier_trains_and_logs_val_acc() -> None:
    task = ImageClassifier(
        MLP(input_dim=2, hidden_dim=16, num_hidden_layers=1, num_classes=3), num_classes=3, top_k=2,
        optimizer="momentum", lr=0.1, lr_schedule="poly", weight_decay=1e-4, weight_decay_in_loss=True,
    )  # fmt: skip
    train, val = DataLoader(_blobs(96, 0), batch_size=16, shuffle=True), DataLoader(_blobs(48, 1), batch_size=16)
    trainer = _trainer(max_epochs=4, callbacks=[ExponentialMovingAverage(decay=0.9)])
    trainer.fit(task, train, val)
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_acc", "val_acc_top2"} <= set(metrics)
    assert float(metrics["val_acc"]) > 0.9
    result = trainer.test(task, val, verbose=False)[0]
    assert result["test_acc"] > 0.9 and result["test_acc_top2"] >= result["test_acc"]
    # the polynomial schedule reached 0 at the Trainer's last step
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0)


def test_staircase_decay_counts_epochs_in_steps() -> None:
    task = ImageClassifier(
        MLP(input_dim=2, hidden_dim=8, num_hidden_layers=1, num_classes=3), num_classes=3,
        optimizer="sgd", lr=1.0, lr_schedule="staircase", decay_epochs=1, decay_rate=0.1,
    )  # fmt: skip
    trainer = _trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(task, DataLoader(_blobs(48, 0), batch_size=8))  # 6 steps per epoch
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.step_size == 6
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01)


def test_weight_decay_inside_the_loss_reaches_the_gradient() -> None:
    model = LeNet(image_size=8)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))

    def grads(task: ImageClassifier) -> dict[str, Tensor]:
        model.zero_grad()
        task.training_step((x, y), 0).backward()
        grads = {}
        for n, p in model.named_parameters():
            assert p.grad is not None
            grads[n] = p.grad.clone()
        return grads

    inside = ImageClassifier(model, weight_decay=0.01, weight_decay_in_loss=True)
    inside.log = lambda *a, **k: None  # type: ignore[method-assign]  # outside a Trainer
    outside = ImageClassifier(model, weight_decay=0.01, weight_decay_in_loss=False)
    outside.log = lambda *a, **k: None  # type: ignore[method-assign]
    g_in, g_out = grads(inside), grads(outside)
    for name, p in model.named_parameters():
        extra = 0.01 * p.detach() if p.ndim > 1 else torch.zeros_like(p)  # weights decay, biases do not
        torch.testing.assert_close(g_in[name], g_out[name] + extra)
    # without in-loss decay the optimizer applies it, to the same parameters only
    groups = outside.configure_optimizers()["optimizer"].param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and len(groups[0]["params"]) == 4
    groups = inside.configure_optimizers()["optimizer"].param_groups
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]


def test_optimizer_choices() -> None:
    def build(name: OptimizerName) -> torch.optim.Optimizer:
        return ImageClassifier(LeNet(image_size=8), optimizer=name, lr=0.5).configure_optimizers()["optimizer"]

    assert build("sgd").param_groups[0]["momentum"] == 0.0
    assert build("momentum").param_groups[0]["momentum"] == 0.9
    assert isinstance(build("adam"), torch.optim.Adam) and isinstance(build("adagrad"), torch.optim.Adagrad)
    with pytest.raises(ValueError, match="`optimizer`"):
        build("rmsprop")  # type: ignore[arg-type]  # an unknown name, refused at runtime
    assert build("adamw").param_groups[0]["betas"] == (0.9, 0.95)


def test_char_lm_and_seq2seq_tasks_train() -> None:
    text = torch.arange(200) % 7  # a periodic "text": easy to learn
    windows = torch.stack([text[i : i + 9] for i in range(0, 190, 9)])
    chars = DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=4)
    lm = CharLanguageModel(CharLSTM(vocab_size=7, hidden_size=16, num_layers=1), lr=0.05)
    trainer = _trainer(max_epochs=3)
    trainer.fit(lm, chars, chars)
    metrics = trainer.callback_metrics
    assert float(metrics["val_bpc"]) == pytest.approx(float(metrics["val_loss"]) / math.log(2), rel=1e-5)
    assert float(metrics["val_acc"]) > 0.5

    src = torch.randint(4, 12, (16, 5))
    pairs = [(s, torch.cat([torch.tensor([2]), s]), torch.cat([s, torch.tensor([3])])) for s in src]  # copy task

    def collate(batch: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, ...]:
        s, ti, to = map(torch.stack, zip(*batch))
        return s, torch.full((len(s),), 5), ti, to

    copies: DataLoader[tuple[Tensor, Tensor, Tensor]] = DataLoader(pairs, batch_size=8, collate_fn=collate)  # type: ignore[arg-type]  # a list is a map-style dataset
    seq = Seq2SeqTask(Seq2SeqAttention(12, 12, embedding_dim=8, hidden_size=16), bleu=True, max_decode_len=8, lr=0.02)
    trainer = _trainer(max_epochs=2)
    trainer.fit(seq, copies, copies)
    metrics = trainer.callback_metrics
    assert {"val_loss", "val_acc", "val_ppl", "val_bleu"} <= set(metrics)
    assert float(metrics["val_ppl"]) == pytest.approx(math.exp(float(metrics["val_loss"])), rel=1e-5)
    with pytest.raises(ValueError, match="greedy_decode"):
        Seq2SeqTask(LeNet(), bleu=True)  # BLEU needs a decoder: refused at construction, not at the first validation


def test_lightning_cli_builds_nested_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from gradcomp_lab.data import DigitsDataModule

    monkeypatch.setattr(sys, "argv", ["gradcomp"])  # only `args` below, not pytest's own arguments
    cli = LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        save_config_callback=None,
        args=[
            "--seed_everything=0",
            "--model=gradcomp_lab.tasks.ImageClassifier",
            "--model.model=gradcomp_lab.models.LeNet",
            "--model.model.padding=valid",
            "--model.weight_decay_in_loss=true",
            "--data=gradcomp_lab.data.DigitsDataModule",
            "--data.batch_size=16",
            "--trainer.logger=false",
            "--trainer.callbacks+=gradcomp_lab.ema.ExponentialMovingAverage",
            "--trainer.callbacks.decay=0.99",
        ],
    )
    assert isinstance(cli.model, ImageClassifier) and isinstance(cli.model.model, LeNet)
    assert cli.model.model.fc3.in_features == 4 * 4 * 50 and cli.model.weight_decay_in_loss
    assert isinstance(cli.datamodule, DigitsDataModule) and cli.datamodule.batch_size == 16
    callbacks = cli.trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    (ema,) = [c for c in callbacks if isinstance(c, ExponentialMovingAverage)]
    assert ema.decay == 0.99
