"""Every recipe under ``recipes/<paper>/`` parses, instantiates, and trains a few steps on generated data.

What runs (the datasets are tiny files in each dataset's real format, written by ``recipe_data.py``):

* ``test_recipe_parses_and_instantiates`` (every recipe): LightningCLI parses the YAML with the generated
  dataset's directory and builds the model, datamodule, strategy and Trainer exactly as ``gradcomp fit`` would,
  with the recipe's own worker counts and full-size models (built on the ``meta`` device, so AlexNet, GoogLeNet,
  VGG-A, ResNet-50 and the 37M-parameter MLP cost no memory or init time). The datamodule then reads its
  generated files (``setup("fit")``) and yields a batch.
* ``test_every_recipe_fits`` (every recipe, 63 today): trains each recipe on the generated data with its own
  model class, task, optimizer, callbacks, compressor or strategy and their options, through
  ``recipe_fit.py`` (subprocesses that each fit their recipes one after another). ``fit_plan`` gives each recipe's
  launch and overrides:

  - ``[1proc]`` every recipe that is not WeightGradStrategy (55): one CPU process, ``devices=1`` (a TowerStrategy
    recipe keeps its emulated workers), ``--trainer.fast_dev_run=2`` (2 training and 2 validation batches);
    ``SHARDS`` such processes at once. Under GradCompStrategy the DDP hook compresses and decodes every bucket even
    on one rank.
  - ``[4proc]`` the WeightGradStrategy recipes (CifarNet, VGG-A and AlexNet: 8): 4 real ranks
    (``torch.distributed.run``, Gloo; Lightning reads torchrun's environment), 2 sites of 2. The 8-worker recipes
    (2 sites of 4) run as 2 sites of 2 (``site_size=2``): 8 processes would cost far more than 4 on 2 cores
    (WEIGHTGRAD_RANKS says how much).

  The language-model and DiLoCo smoke fits (``SMOKE``) join the launch on as many processes (4: the sharded GPT
  recipes; 1: the DeMo GPT recipe), so that each launch starts its processes once.

  WeightGradStrategy fits run ``staleness_bound`` (T = 4) steps, so that their last step is a WAN round. The
  only other overrides are ``MODEL_OVERRIDES`` (the MLP, the NMT model, and VGG-A's and AlexNet's fc layers are
  narrowed through their constructors) and ``DATA_OVERRIDES`` (batch sizes the tiny datasets hold; ImageNet
  images at 64x64, where GoogLeNet and ResNet-18/50 run at full width). After each fit every rank
  checks: ``global_step`` is the requested count; every parameter is finite; the compressor ran (the gradcomp
  hook ran every step and, unless the compressor is fp32, sent fewer bytes than fp32 DDP would; a TowerStrategy
  recorded its packets; a WeightGrad fit ran at least one WAN round); and with several ranks, the parameter
  digests agree where the strategy guarantees bit-identical replicas: within every site, and across all ranks
  after a WAN round with ``site_view="global"`` (``site_view="gaia"`` sites keep their own unsent updates).

Recipes whose compressor or strategy class is not on this branch yet are skipped with the reason.
"""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

import lightning_gradcomp
from gradcomp_lab.cli import GradCompCLI
from tests.integration.recipe_data import ROOT, data_overrides, recipe_paths, write_datasets

RECIPES = recipe_paths()
#: the language-model benchmark's recipes (benchmarks/lm.py): all parsed, one fitted (test_lm_recipe_smoke_fit)
LM_RECIPES = recipe_paths("lm")
#: DiLoCo's recipes on the same benchmark (benchmarks/diloco.py): all parsed, two fitted (test_diloco_recipe_smoke_fit)
DILOCO_RECIPES = recipe_paths("diloco")

#: by model class: where the real architecture at its recipe width costs several seconds per fit on 2 CPU cores, it
#: is narrowed through its own constructor (layer types, depth and every other option stay the recipe's). Full width
#: measured with recipe_fit.py: MLP 3.1 s (x 9 recipes), Seq2SeqAttention 10.0 s (x 4) per fit, 0.2 s narrowed;
#: VGG-A under WeightGrad on 4 ranks 16.4 s, 4.8 s narrowed; AlexNet 6-10 s per one-rank fit (x 12) and 27 s under
#: WeightGrad on 2 ranks (x 2)
MODEL_OVERRIDES: dict[str, list[str]] = {
    # 3 hidden layers of 4096 (37M parameters): 64 units keep the 4 Linear layers Gradient Dropping sees
    "MLP": ["--model.init_args.model.init_args.hidden_dim=64"],
    # 500-dim embeddings over 30k-word vocabularies and 1024 hidden units (74M parameters)
    "Seq2SeqAttention": [
        "--model.init_args.model.init_args.embedding_dim=8", "--model.init_args.model.init_args.hidden_size=8",
        "--model.init_args.max_decode_len=8",
    ],
    # two fc layers of 4096 (19M of its 28M parameters): the 8 convs with batch norm and the 3 fc layers stay
    "VGGA": ["--model.init_args.model.init_args.classifier_width=64"],
    # fc6 and fc7 of 4096 (55M of its 61M parameters): the 5 grouped convs, LRN, batch norm and the 3 fc layers stay
    "AlexNet": ["--model.init_args.model.init_args.classifier_width=64"],
}  # fmt: skip

#: by datamodule class: per-process batches that the generated datasets hold a few of (recipe_data.py)
DATA_OVERRIDES: dict[str, list[str]] = {
    "MNISTDataModule": ["--data.init_args.batch_size=8"],  # 32 training images; the 4 towers of fig. 3 get 2 each
    "CIFAR10DataModule": ["--data.init_args.batch_size=4"],  # 80 training images: 5 batches on each of 4 ranks
    # 32 training JPEGs; GoogLeNet, ResNet-18/50 at full width, AlexNet's convs too, on 64x64 crops instead of
    # 224x224 (AlexNet's three 3x3/2 pools need at least 57 pixels; the others pool globally): about 1-3 s per fit
    "ImageFolderDataModule": [
        "--data.init_args.batch_size=2", "--data.init_args.image_size=64", "--data.init_args.resize_size=64",
    ],
    "TinyShakespeareDataModule": ["--data.init_args.batch_size=4"],
    "ParallelTextDataModule": ["--data.init_args.batch_size=4"],
}  # fmt: skip

#: WeightGradStrategy recipes run on this many real ranks (torchrun, Gloo), keeping the recipe's number of sites:
#: 4-worker recipes as they are (2 sites of 2), 8-worker ones (2 sites of 4) as 2 sites of 2. Measured on the 2 shared
#: cores (recipe_fit.py's per-fit seconds and ``/usr/bin/time``): the 4 CifarNet/VGG-A 8-worker recipes took 68 s on
#: 8 ranks (38 s of fits, the rest is starting 8 processes), and 17 s of fits on 4 ranks. (AlexNet at full width
#: needed 3.8 GB per rank under WeightGrad, so its recipes ran on 2 ranks; narrowed, they run on 4 as the others.)
WEIGHTGRAD_RANKS = 4


def _config(recipe: Path) -> dict:
    return yaml.safe_load(recipe.read_text())


def fit_plan(recipe: Path) -> tuple[int, list[str]]:
    """How ``recipe`` is fitted: (processes, overrides on top of ``recipe_fit.COMMON`` and the data directory).

    One process by default (``devices=1``, 2 steps): the recipe's model, compressor or strategy and every other option
    as written, narrowed only by ``MODEL_OVERRIDES``/``DATA_OVERRIDES``. A ``WeightGradStrategy`` recipe runs on
    several ranks for ``staleness_bound`` steps, so that its last step is a WAN round.
    """
    config = _config(recipe)
    model = config["model"]["init_args"]["model"]["class_path"].rsplit(".", 1)[1]
    data = config["data"]["class_path"].rsplit(".", 1)[1]
    overrides = [*MODEL_OVERRIDES.get(model, []), *DATA_OVERRIDES[data]]
    strategy = config["trainer"].get("strategy")
    if not (isinstance(strategy, dict) and strategy["class_path"].endswith(".WeightGradStrategy")):
        return 1, overrides
    args = strategy["init_args"]
    workers = config["trainer"]["devices"] * config["trainer"].get("num_nodes", 1)
    site_size = WEIGHTGRAD_RANKS // (workers // args["site_size"])  # the recipe's number of sites, on fewer ranks
    overrides.append(f"--trainer.fast_dev_run={args.get('staleness_bound', 4)}")
    if site_size != args["site_size"]:
        overrides.append(f"--trainer.strategy.init_args.site_size={site_size}")
    return WEIGHTGRAD_RANKS, overrides


def _class_paths(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["class_path"]] if isinstance(node.get("class_path"), str) else []
        return found + [c for v in node.values() for c in _class_paths(v)]
    if isinstance(node, list):
        return [c for v in node for c in _class_paths(v)]
    return []


def _missing_class(recipe: Path) -> str:
    """The first ``class_path`` of the recipe that does not import on this branch, or ``""``."""
    import importlib

    for path in _class_paths(yaml.safe_load(recipe.read_text())):
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return path
    return ""


def _skip_if_unmerged(recipe: Path) -> None:
    missing = _missing_class(recipe)
    if missing:
        pytest.skip(f"{missing} is not on this branch yet (merged from another branch later)")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_datasets(tmp_path_factory.mktemp("recipe-data"))


def test_every_paper_has_recipes() -> None:
    papers = {p.parent.name for p in RECIPES}
    assert papers == {"terngrad", "graddrop", "adacomp", "weightgrad"}
    for recipe in RECIPES:
        header = recipe.read_text().splitlines()[0]
        assert header.startswith("# "), f"{recipe} has no header comment"
        assert "gradcomp fit --config recipes/" in recipe.read_text(), f"{recipe} does not say how to run it"
    for recipe in RECIPES:
        assert fit_plan(recipe)[0] in LAUNCHES, recipe


@pytest.mark.parametrize("recipe", RECIPES + LM_RECIPES + DILOCO_RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_parses_and_instantiates(recipe: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_if_unmerged(recipe)
    monkeypatch.setattr(sys, "argv", ["gradcomp"])  # LightningCLI warns when pytest's argv is set too
    args = ["--config", str(recipe), *data_overrides(recipe, data_root), "--trainer.accelerator=cpu"]
    with torch.device("meta"):
        cli = GradCompCLI(args=args, run=False)  # as `gradcomp fit` parses it
    config = yaml.safe_load(recipe.read_text())
    assert type(cli.model).__name__ == config["model"]["class_path"].rsplit(".", 1)[1]
    assert cli.trainer.max_steps == config["trainer"].get("max_steps", -1)
    if "max_steps" in config["model"].get("init_args", {}) or hasattr(cli.model, "max_steps"):
        # the LR schedule's horizon is the Trainer's (GradCompCLI links them); recipes do not repeat it
        assert "max_steps" not in config["model"].get("init_args", {}), f"{recipe}: set trainer.max_steps only"
        assert cli.model.max_steps == (cli.trainer.max_steps if cli.trainer.max_steps > 0 else None)
    strategy = config["trainer"].get("strategy")
    if isinstance(strategy, dict):
        assert type(cli.trainer.strategy).__name__ == strategy["class_path"].rsplit(".", 1)[1]
        compressor = strategy["init_args"].get("compressor")
        if isinstance(compressor, dict):  # DiLoCo's `compressor` encodes the pseudo-gradients
            strategy_compressor = cli.trainer.strategy.compressor  # type: ignore[attr-defined]  # every recipe's strategy has one
            built = getattr(cli.trainer.strategy, "outer_compressor", strategy_compressor)
            assert type(built).__name__ == compressor["class_path"].rsplit(".", 1)[1]
    # the datamodule reads the generated files in the dataset's real format
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    assert len(batch) >= 2


def test_one_max_steps_override_moves_the_lr_schedule(data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = ROOT / "recipes" / "terngrad" / "lenet_mnist_fig3.yaml"  # poly decay over the run, 10,000 steps
    monkeypatch.setattr(sys, "argv", ["gradcomp"])
    args = ["--config", str(recipe), *data_overrides(recipe, data_root), "--trainer.max_steps=40"]
    cli = GradCompCLI(args=args, run=False)
    assert cli.trainer.max_steps == 40 and cli.model.max_steps == 40
    scheduler = cli.model.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert scheduler.total_iters == 40


#: one launch per number of processes; each subprocess fits its recipes one after another
LAUNCHES = (1, WEIGHTGRAD_RANKS)
#: the one-process recipes are split over this many subprocesses running at once (one thread each; CI has 2 cores)
SHARDS = 2

#: the benchmark's GPT narrowed for the smoke fits below
NARROW_GPT = ["--model.init_args.model.init_args.width=32", "--data.init_args.batch_size=2",
              "--data.init_args.max_bytes=null"]
#: the smoke fits of the language-model and DiLoCo recipes, by test: (processes, specs). Each joins the launch of the
#: recipes on as many processes (one start of its processes, each importing torch and Lightning, per launch)
SMOKE: dict[str, tuple[int, list[str]]] = {
    "lm": (1, ["::".join(["recipes/lm/gpt_stdlib_demo.yaml", *NARROW_GPT,
                          "--model.init_args.model.init_args.depth=1"])]),
    "sharded_lm": (4, [
        "::".join(["recipes/lm/gpt_stdlib_sharded_terngrad.yaml", *NARROW_GPT,
                   "--model.init_args.model.init_args.depth=2", "--model.init_args.warmup_steps=1"]),
        "::".join(["recipes/diloco/gpt_stdlib_sharded_diloco.yaml", *NARROW_GPT,
                   "--model.init_args.model.init_args.depth=2", "--model.init_args.warmup_steps=1",
                   "--trainer.strategy.init_args.sync_every=2"]),
    ]),
    "diloco": (2, [
        "::".join(["recipes/diloco/gpt_stdlib_diloco_sparseloco.yaml", *NARROW_GPT,
                   "--model.init_args.model.init_args.depth=1", "--model.init_args.warmup_steps=1",
                   "--trainer.strategy.init_args.sync_every=2"]),
        "::".join(["recipes/diloco/gpt_stdlib_diloco_streaming.yaml", *NARROW_GPT,
                   "--model.init_args.model.init_args.depth=1", "--model.init_args.warmup_steps=1",
                   "--trainer.strategy.init_args.sync_every=2", "--trainer.strategy.init_args.sync_delay=0",
                   "--trainer.strategy.init_args.mixing=0.0", "--trainer.strategy.init_args.fragments=2"]),
    ]),
}  # fmt: skip


def _recipe_specs(processes: int) -> list[str]:
    """The recipes (not the smoke fits) that ``fit_plan`` launches on ``processes`` processes, as specs."""
    specs = []
    for recipe in RECIPES:
        ranks, overrides = fit_plan(recipe)
        if ranks == processes and not _missing_class(recipe):
            specs.append("::".join([str(recipe.relative_to(ROOT)), *overrides]))
    return specs


#: a launch's outcome per shard: (its specs, exit code, output, the recipes it reported fitted)
Launch = list[tuple[list[str], int, str, list[str]]]


@pytest.fixture(scope="module")
def launched(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Launch]:
    """``launched(processes)``: every recipe and smoke fit on ``processes`` processes, fitted in one launch (the first
    test that asks starts it; the others read its outcome)."""
    done: dict[int, Launch] = {}

    def launch(processes: int) -> Launch:
        if processes not in done:
            specs = _recipe_specs(processes) + [s for n, spec in SMOKE.values() if n == processes for s in spec]
            done[processes] = _fit_in_subprocesses(specs, processes, data_root, tmp_path_factory.mktemp("fits"))
        return done[processes]

    return launch


def _assert_fitted(launch: Launch, specs: list[str]) -> None:
    """Each of ``specs`` fitted (recipe_fit.py's checks passed), and its launch ended cleanly."""
    for spec in specs:
        shard, code, text, fitted = next(run for run in launch if spec in run[0])
        assert code == 0, text[-8000:]
        assert spec.split("::")[0] in fitted, text[-8000:]


@pytest.mark.parametrize("processes", LAUNCHES, ids=lambda n: f"{n}proc")
def test_every_recipe_fits(processes: int, launched: Callable[[int], Launch]) -> None:
    specs = _recipe_specs(processes)
    if not specs:
        pytest.skip(f"no recipe on this branch runs on {processes} processes")
    _assert_fitted(launched(processes), specs)
    assert lightning_gradcomp.__version__


def _fit_in_subprocesses(specs: list[str], processes: int, data_root: Path, tmp_path: Path) -> Launch:
    """Fit ``RECIPE::OVERRIDE...`` specs through ``recipe_fit.py`` on ``processes`` ranks (one process: in shards)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    shards = [specs[i::SHARDS] for i in range(SHARDS)] if processes == 1 and len(specs) > 1 else [specs]
    runs = []
    for i, shard in enumerate(shards):
        log = tmp_path / f"shard{i}.log"
        with open(log, "w") as out:  # a file, not a pipe: a shard must never wait for the test to read its output
            command = [sys.executable, *launcher, "-m", "tests.integration.recipe_fit", str(data_root), *shard]
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        runs.append((shard, log, proc))
    outcome: Launch = []
    try:
        for shard, log, proc in runs:
            code = proc.wait(timeout=600)
            text = log.read_text()
            fitted = [line.split()[1] for line in text.splitlines() if line.startswith("FIT-OK")]
            outcome.append((shard, code, text, fitted))
    finally:
        for _, _, proc in runs:
            if proc.poll() is None:
                proc.kill()
    return outcome


def test_lm_recipe_smoke_fit(launched: Callable[[int], Launch]) -> None:
    """One language-model recipe (DeMo with SignSGD, the benchmark's GPT narrowed to width 32 and one block) trains
    2 steps on generated sources; recipe_fit.py checks the step count, finite weights and that DeMo compressed."""
    processes, specs = SMOKE["lm"]
    _assert_fitted(launched(processes), specs)


def test_sharded_lm_recipe_smoke_fit(launched: Callable[[int], Launch]) -> None:
    """The sharded recipes (FSDP2 shards of the GPT, the task's configure_model) on 4 real ranks as 2 replicas of 2:
    TernGrad between the replicas every step, and DiLoCo between the sites at H = 2. recipe_fit.py checks the steps,
    that TernGrad compressed or an outer round ran, and that every shard is identical in both replicas."""
    processes, specs = SMOKE["sharded_lm"]
    _assert_fitted(launched(processes), specs)


def test_diloco_recipe_smoke_fit(launched: Callable[[int], Launch]) -> None:
    """Two DiLoCo recipes (SparseLoCo-style and Streaming DiLoCo, the GPT narrowed) on 2 real ranks, H = 2:
    recipe_fit.py checks that a round ran and that every rank holds the same weights right after it."""
    processes, specs = SMOKE["diloco"]
    _assert_fitted(launched(processes), specs)
