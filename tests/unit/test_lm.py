"""The language-model pieces: byte tokenizer, windows, the corpus readers on generated files, GPT, schedules."""

import math
from pathlib import Path

import pytest
import torch

from gradcomp_lab.data import (
    ByteTokenizer,
    StdlibSourceDataModule,
    TinyShakespeareDataModule,
    TokenWindows,
    WikiTextDataModule,
)
from gradcomp_lab.data.files import DatasetNotFoundError
from gradcomp_lab.models import GPT
from gradcomp_lab.schedules import WarmupCosine
from gradcomp_lab.tasks import CharLanguageModel
from lightning_gradcomp.optimizers import SignSGD


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' + \"λ\"\n"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_token_windows_stride_and_count() -> None:
    ids = torch.arange(20)
    windows = TokenWindows(ids, seq_len=4, stride=2)
    # starts 0, 2, ..., 14 (the last window needs 5 tokens: 15..19)
    assert len(windows) == 8
    x, y = windows[3]
    assert x.tolist() == [6, 7, 8, 9] and y.tolist() == [7, 8, 9, 10]
    plain = TokenWindows(ids, seq_len=4)  # non-overlapping: starts 0, 4, 8, 12 (16 would need token 20)
    assert len(plain) == 4 and plain[3][1].tolist() == [13, 14, 15, 16]


def _write_stdlib(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "b.py").write_text("B = 2\n" * 50)
    (root / "a.py").write_text("A = 1\n" * 50)
    (root / "pkg" / "c.py").write_text("C = 3\n" * 50)
    (root / "site-packages" / "z.py").write_text("Z = 9\n" * 50)  # installed packages differ per machine: excluded


def test_stdlib_reader_order_split_and_truncation(tmp_path: Path) -> None:
    _write_stdlib(tmp_path)
    dm = StdlibSourceDataModule(str(tmp_path), batch_size=2, seq_len=16, max_bytes=None, val_fraction=0.25)
    stream = dm.corpus()
    assert stream.index("# file: a.py") < stream.index("# file: b.py") < stream.index("# file: pkg/c.py")
    assert "Z = 9" not in stream
    dm.setup("fit")
    assert isinstance(dm.val_set, TokenWindows)
    val_text = ByteTokenizer().decode(dm.val_set.ids)
    assert stream.endswith(val_text) and len(val_text) == int(len(stream) * 0.25)
    assert "C = 3" in val_text and "A = 1" not in val_text
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    small = StdlibSourceDataModule(str(tmp_path), max_bytes=100, seq_len=8, val_fraction=0.2)
    assert len(small.corpus().encode("utf-8")) == 100


def test_stdlib_reader_reads_the_real_standard_library() -> None:
    dm = StdlibSourceDataModule(max_bytes=20_000, seq_len=32)
    dm.setup("fit")
    assert isinstance(dm.train_set, TokenWindows)
    assert dm.vocab_size == 256 and len(dm.train_set) > 100
    assert ByteTokenizer().decode(dm.train_set.ids[:8]) == "# file: "


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("raw", [True, False])
def test_wikitext_reader_on_generated_files(tmp_path: Path, nested: bool, raw: bool) -> None:
    folder = tmp_path / ("wikitext-2" + ("-raw" if raw else "")) if nested else tmp_path
    folder.mkdir(exist_ok=True)
    suffix = "raw" if raw else "tokens"
    texts = {"train": " = Valkyria Chronicles = \n" * 20, "valid": " = Robert Boulter = \n" * 5, "test": " = Test = \n" * 5}
    for split, text in texts.items():
        (folder / f"wiki.{split}.{suffix}").write_text(text, encoding="utf-8")
    dm = WikiTextDataModule(str(tmp_path), variant="2", raw=raw, seq_len=8, stride=4, batch_size=2)
    dm.setup("fit")
    tok = ByteTokenizer()
    assert isinstance(dm.train_set, TokenWindows) and isinstance(dm.val_set, TokenWindows)
    assert isinstance(dm.test_set, TokenWindows)
    assert tok.decode(dm.train_set.ids) == texts["train"] and tok.decode(dm.val_set.ids) == texts["valid"]
    assert tok.decode(dm.test_set.ids) == texts["test"]
    assert len(dm.train_set) == (len(texts["train"]) - 1 - 8) // 4 + 1


def test_wikitext_missing_files_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="download=True"):
        WikiTextDataModule(str(tmp_path)).setup("fit")


def test_tiny_shakespeare_stride(tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text("First Citizen:\nSpeak, speak.\n" * 20)
    dm = TinyShakespeareDataModule(str(tmp_path), seq_len=10, stride=5, val_fraction=0.2)
    dm.setup("fit")
    assert isinstance(dm.train_set, TokenWindows)
    assert dm.train_set[1][0][:5].tolist() == dm.train_set[0][0][5:].tolist()
    assert len(dm.train_set) == (len(dm.train_set.ids) - 11) // 5 + 1


@pytest.mark.parametrize(
    ("factory", "arg"),
    [
        (lambda: TokenWindows(torch.arange(9), 4, stride=0), "stride"),
        (lambda: StdlibSourceDataModule(seq_len=0), "seq_len"),
        (lambda: StdlibSourceDataModule(val_fraction=0.9), "val_fraction"),
        (lambda: WikiTextDataModule(variant="3"), "variant"),  # type: ignore[arg-type]
        (lambda: GPT(width=30, num_heads=4), "width"),
        (lambda: GPT(depth=0), "depth"),
        (lambda: WarmupCosine(10, warmup_steps=10), "warmup_steps"),
        (lambda: CharLanguageModel(GPT(), optimizer="lion"), "optimizer"),  # type: ignore[arg-type]
        (lambda: CharLanguageModel(GPT(), lr_schedule="linear"), "lr_schedule"),
    ],
)
def test_bad_input_names_argument_and_fix(factory, arg: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=rf"`{arg}`.*but got.*Fix: "):
        factory()


def test_gpt_is_causal_and_ties_embeddings() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, width=32, depth=2, num_heads=4, context=16).eval()
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    # positions before the changed token see exactly the same logits
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10], rtol=0, atol=0)
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])
    names = [n for n, _ in model.named_parameters()]
    assert sum("embedding" in n for n in names) == 2 and not any("head" in n for n in names)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_warmup_cosine_shape() -> None:
    s = WarmupCosine(100, warmup_steps=10, end_factor=0.1)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0) and s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(100) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_sign_sgd_step_with_decoupled_decay() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -7.0, 0.0])
    SignSGD([p], lr=0.1, weight_decay=0.5).step()
    expected = torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.05) - 0.1 * torch.tensor([1.0, -1.0, 0.0])
    torch.testing.assert_close(p.detach(), expected)


@pytest.mark.parametrize("optimizer", ["adamw", "signsgd"])
def test_language_model_task_configures_optimizer_and_cosine(optimizer: str) -> None:
    task = CharLanguageModel(GPT(width=16, depth=1, num_heads=2, context=8), optimizer=optimizer,  # type: ignore[arg-type]
                             lr=1e-3, weight_decay=0.1, lr_schedule="cosine", max_steps=20, warmup_steps=2)
    config = task.configure_optimizers()
    opt = config["optimizer"]
    assert type(opt).__name__ == {"adamw": "AdamW", "signsgd": "SignSGD"}[optimizer]
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 0.1]
    sched = config["lr_scheduler"]["scheduler"]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 2)  # first warm-up step
    for _ in range(20):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_init_weights_starts_from_a_checkpoints_model_weights(tmp_path: Path) -> None:
    """DiLoCo's dense warm start: a Lightning checkpoint's ``model.*`` weights (or a bare state dict) start the run;
    an unreadable path is refused naming the argument, the value and the fix."""
    torch.manual_seed(0)
    trained = CharLanguageModel(GPT(width=16, depth=1, num_heads=2, context=8))
    torch.save({"state_dict": trained.state_dict(), "epoch": 0}, tmp_path / "run.ckpt")
    torch.save(trained.model.state_dict(), tmp_path / "bare.pt")
    for path in ("run.ckpt", "bare.pt"):
        torch.manual_seed(1)  # another initialization, replaced by the saved weights
        task = CharLanguageModel(GPT(width=16, depth=1, num_heads=2, context=8), init_weights=str(tmp_path / path))
        for (name, a), b in zip(trained.model.state_dict().items(), task.model.state_dict().values()):
            assert torch.equal(a, b), f"{path}: {name}"
    with pytest.raises(ValueError, match=r"Expected `init_weights` to be a readable checkpoint.*missing\.ckpt.*Fix:"):
        CharLanguageModel(GPT(width=16, depth=1, num_heads=2, context=8), init_weights=str(tmp_path / "missing.ckpt"))
