"""The ``gradcomp`` console script (LightningCLI) with strategies from YAML."""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]

FULL_CONFIG = """
model:
  class_path: tests.integration.cli_fixtures.TinyClassifier
data:
  class_path: tests.integration.cli_fixtures.RandomDataModule
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy:
    class_path: lightning_gradcomp.GradCompStrategy
    init_args:
      compressor:
        class_path: lightning_gradcomp.compressors.TernGrad
        init_args:
          clip_factor: 2.5
          clip_mode: code
          packing: base3
      exclude: ["net.4.*"]
      min_numel: 1
      find_unused_parameters: false
      static_graph: true
      gradient_as_bucket_view: true
      process_group_backend: gloo
  callbacks:
    - class_path: lightning_gradcomp.callbacks.SigmaClipping
      init_args:
        clip_factor: 3.0
"""


def _parse(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``gradcomp ARGS`` that ends before training (``--print_config``, ``--help``, a parse error), in this process:
    (exit status, stdout, stderr). The same ``main`` as the console script, without a second interpreter's imports."""
    from gradcomp_lab.cli import main

    capsys.readouterr()
    with mock.patch.object(sys, "argv", ["gradcomp"]), pytest.raises(SystemExit) as exit_:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def _gradcomp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    code = "import sys; from gradcomp_lab.cli import main; main()"
    script = cwd / "gradcomp_entry.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_print_config_exposes_every_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG)
    code, out, err = _parse("fit", "--config", str(config), "--print_config", capsys=capsys)
    assert code == 0, err
    for option in ("clip_mode: code", "packing: base3", "scaler_share: max", "static_graph: true", "exclude:"):
        assert option in out


def test_fit_from_yaml_with_class_path_strategy_on_two_ranks(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    # the SigmaClipping callback would clip twice with TernGrad's own clip_factor: that must be refused (a check of
    # the configuration, the same on every rank: one rank shows it without starting a second process)
    config.write_text(FULL_CONFIG)
    out = _gradcomp("fit", "--config", str(config), "--trainer.devices=1", cwd=tmp_path)
    assert out.returncode != 0 and "clip_factor=0" in out.stderr
    config.write_text(FULL_CONFIG.replace("clip_factor: 2.5", "clip_factor: 0.0"))
    out = _gradcomp("fit", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in out.stderr + out.stdout
    # nothing written into the working directory (no config.yaml without a logger's run directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "gradcomp_entry.py"]


#: registered name -> what `--print_config` shows for it: the class and the options the name stands for
PRINTED_NAMES = {
    "terngrad": ("class_path: lightning_gradcomp.GradCompStrategy", "class_path: lightning_gradcomp.compressors.TernGrad",
                 "clip_factor: 2.5", "clip_mode: paper", "packing: 2bit", "min_numel: 1"),
    "fp32": ("class_path: lightning_gradcomp.GradCompStrategy", "class_path: lightning_gradcomp.compressors.Identity"),
    "streaming_diloco_notebook": ("class_path: lightning_gradcomp.DiLoCoStrategy", "fragments: 4", "sync_delay: 5",
                                  "mixing: 0.5", "start_method: fork", "class_path: lightning_gradcomp.compressors.Identity"),
}


@pytest.mark.parametrize("name", sorted(PRINTED_NAMES))
def test_registered_name_from_the_command_line(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--print_config` writes a registered name out as its class and every option (the compressor's too), and that
    output parses back to itself."""
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG.split("  strategy:")[0])
    code, out, err = _parse(
        "fit", "--config", str(config), f"--trainer.strategy={name}", "--print_config", capsys=capsys
    )
    assert code == 0, err
    for line in PRINTED_NAMES[name]:
        assert line in out, out
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    code, again, err = _parse("fit", "--config", str(printed), "--print_config", capsys=capsys)
    assert code == 0, err
    assert again == out


def test_print_config_expands_a_compressor_name_in_a_class_path_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(HIERARCHICAL_CONFIG.replace("NAME", "graddrop"))
    code, out, err = _parse("fit", "--config", str(config), "--print_config", capsys=capsys)
    assert code == 0, err
    assert "class_path: lightning_gradcomp.compressors.GradientDropping" in out and "site_sizes:" in out


def test_help_lists_report_and_the_strategy_names(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gradcomp.registry import strategy_names

    code, out, err = _parse("--help", capsys=capsys)
    assert code == 0, err
    assert "gradcomp report" in out
    assert ", ".join(strategy_names()) in out and "gradcomp" in strategy_names()
    names = out.split("--trainer.strategy=NAME")[1]
    for name in ("diloco", "streaming_diloco", "weightgrad", "terngrad"):
        assert f" {name}," in names or f" {name}\n" in names, names


#: (YAML mistake, what the first line of stderr must say)
NESTED_TYPOS = {
    "option": (
        ("clip_factor: 2.5", "clip_factr: 2.5"),
        "Expected `trainer.strategy.init_args.compressor.init_args.clip_factr` to be an option of "
        "lightning_gradcomp.compressors.TernGrad, but it has no option 'clip_factr' (given 2.5). Fix: did you mean 'clip_factor'?",
    ),
    "class_path": (
        ("class_path: lightning_gradcomp.compressors.TernGrad", "class_path: lightning_gradcomp.compressors.TernGrd"),
        "Expected `trainer.strategy.init_args.compressor.class_path` to name an importable class, but got "
        "'lightning_gradcomp.compressors.TernGrd' (module 'lightning_gradcomp.compressors' has no attribute 'TernGrd'). "
        "Fix: did you mean 'lightning_gradcomp.compressors.TernGrad'?",
    ),
    "list": (
        ('exclude: ["net.4.*"]', 'exclude: "net.4.*"'),
        "Expected `trainer.strategy.init_args.exclude` to be a Sequence, but got 'net.4.*'. "
        "Fix: write a YAML list, e.g. `exclude: ['net.4.*']`.",
    ),
    "number": (
        ("clip_factor: 2.5", "clip_factor: two"),
        "Expected `trainer.strategy.init_args.compressor.init_args.clip_factor` to be a float, but got 'two'. "
        "Fix: write a number (its default: `clip_factor: 2.5`).",
    ),
    "choice": (
        ("clip_mode: code", "clip_mode: papre"),
        "Expected `trainer.strategy.init_args.compressor.init_args.clip_mode` to be one of ['paper', 'code'], "
        "but got 'papre'. Fix: did you mean 'paper'? write one of ['paper', 'code'].",
    ),
    "duration": (
        ("min_numel: 1", "min_numel: 1\n      timeout: 30"),
        "Expected `trainer.strategy.init_args.timeout` to be a duration \"h:m:s\" or \"d days, h:m:s\", but got 30. "
        "Fix: write it as a string, e.g. `timeout: '0:00:30'` (30 seconds).",
    ),
    "class_name": (
        ("class_path: lightning_gradcomp.compressors.TernGrad", "class_path: TernGrads"),
        "Expected `trainer.strategy.init_args.compressor.class_path` to name an importable class, but got 'TernGrads'. "
        "Fix: did you mean 'lightning_gradcomp.compressors.TernGrad'?",
    ),
}


@pytest.mark.parametrize("mistake", sorted(NESTED_TYPOS))
def test_nested_typo_is_named_on_the_first_line(
    tmp_path: Path, mistake: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (old, new), first = NESTED_TYPOS[mistake]
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG.replace(old, new))
    code, _, err = _parse("fit", "--config", str(config), capsys=capsys)
    assert code == 2
    lines = err.splitlines()
    assert lines[0].startswith(f"gradcomp: error: {first}"), lines[0]
    assert len(lines) <= 3, err  # instead of jsonargparse's 60-line report


#: (command-line arguments, what the first line of stderr must say)
NESTED_ARGUMENTS = {
    "choice": (
        ["--trainer.strategy.init_args.compressor.init_args.clip_mode=papre"],
        "Expected `trainer.strategy.init_args.compressor.init_args.clip_mode` to be one of ['paper', 'code'], "
        "but got 'papre'. Fix: did you mean 'paper'?",
    ),
    "option": (
        ["--trainer.strategy.init_args.compressor.init_args.clip_factr=3"],
        "Expected `trainer.strategy.init_args.compressor.init_args.clip_factr` to be an option of "
        "lightning_gradcomp.compressors.TernGrad, but it has no option 'clip_factr' (given '3'). "
        "Fix: did you mean 'clip_factor'?",
    ),
}


@pytest.mark.parametrize("mistake", sorted(NESTED_ARGUMENTS))
def test_nested_argument_is_named_on_the_first_line(
    tmp_path: Path, mistake: str, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments, first = NESTED_ARGUMENTS[mistake]
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG)
    code, _, err = _parse("fit", "--config", str(config), *arguments, capsys=capsys)
    assert code == 2
    lines = err.splitlines()
    assert lines[0].startswith(f"gradcomp: error: {first}"), lines[0]
    assert len(lines) <= 3, err


LM_CONFIG = """
model:
  class_path: gradcomp_lab.tasks.CharLanguageModel
  init_args:
    model:
      class_path: gradcomp_lab.models.GPT
      init_args: {width: 8, depth: 1, num_heads: 1, context: 8}
    optimizer: adamw
    lr_schedule: cosine
    warmup_steps: 100
data:
  class_path: tests.integration.cli_fixtures.RandomDataModule
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2000
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
"""

#: (configuration, command-line arguments, what the first line of stderr must say): values that parse but that a
#: constructor refuses, answered with the constructor's message naming the option's full key, without a traceback
REFUSED_VALUES = {
    "compressor_name": (
        FULL_CONFIG, ["--trainer.strategy.init_args.compressor=TernGrads"],
        "Expected `trainer.strategy.init_args.compressor` to be one of ['adacomp', ",
        "but got 'TernGrads'. Fix: did you mean 'terngrad'?",
    ),
    "diloco_sync_every": (
        FULL_CONFIG.replace("lightning_gradcomp.GradCompStrategy", "lightning_gradcomp.DiLoCoStrategy")
        .replace("min_numel: 1", "min_numel: 1\n      sync_every: 0"), [],
        "Expected `trainer.strategy.init_args.sync_every` to be an integer >= 1, but got 0. Fix: ", "",
    ),
    "callback_beside_compressor_option": (  # both have a `clip_factor`: the message names the one refused
        FULL_CONFIG.replace("clip_factor: 3.0", "clip_factor: -3.0"), [],
        "Expected `trainer.callbacks.0.init_args.clip_factor` to be a finite number > 0, but got -3.0. Fix: ", "",
    ),
    "warmup_past_max_steps": (
        LM_CONFIG, ["--trainer.max_steps=20"],
        "Expected `model.init_args.warmup_steps` to be below `trainer.max_steps` (20), but got 100. Fix: ",
        "`model.init_args.warmup_steps`=1) or raise `trainer.max_steps`.",
    ),
}


@pytest.mark.parametrize("mistake", sorted(REFUSED_VALUES))
def test_refused_value_is_named_on_the_first_line_without_a_traceback(
    tmp_path: Path, mistake: str, capsys: pytest.CaptureFixture[str]
) -> None:
    yaml_text, arguments, start, part = REFUSED_VALUES[mistake]
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    code, _, err = _parse("fit", "--config", str(config), *arguments, capsys=capsys)
    assert code == 2, err
    lines = err.splitlines()
    assert lines[0].startswith(f"gradcomp: error: {start}") and part in lines[0], err
    assert "Traceback" not in err and len(lines) <= 3, err


def test_refused_value_keeps_its_traceback_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(LM_CONFIG)
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ValueError, match="Expected `warmup_steps` to be below `max_steps` \\(20\\)"):
        _parse("fit", "--config", str(config), "--trainer.max_steps=20", capsys=capsys)


def test_misspelt_strategy_name_is_answered_with_the_registered_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG.split("  strategy:")[0])
    code, _, err = _parse("fit", "--config", str(config), "--trainer.strategy=terngrd", capsys=capsys)
    assert code == 2
    first = err.splitlines()[0]
    assert first.startswith(
        "gradcomp: error: Expected `trainer.strategy` to be a registered strategy name, but got 'terngrd'. "
        "Fix: did you mean 'terngrad'? use one of gradcomp's ["
    ), first
    ours, lightning = first.split("Lightning's ")
    assert "'diloco'" in ours and "'streaming_diloco'" in ours and "'weightgrad'" in ours
    # Lightning's names only: not our `*_notebook` variants, not DiLoCo
    assert "'ddp'" in lightning and "'ddp_notebook'" in lightning
    assert "diloco" not in lightning and "terngrad_notebook" not in lightning and "gradcomp" not in lightning


HIERARCHICAL_CONFIG = """
model:
  class_path: tests.integration.cli_fixtures.TinyClassifier
data:
  class_path: tests.integration.cli_fixtures.RandomDataModule
trainer:
  accelerator: cpu
  devices: 4
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy:
    class_path: lightning_gradcomp.GradCompStrategy
    init_args:
      compressor: NAME
      site_sizes: [2, 2]
"""


def test_hierarchical_exchange_from_yaml_on_four_ranks(tmp_path: Path) -> None:
    """Any registered compressor name with `site_sizes` from YAML: 4 ranks as 2 sites of 2 train (a layout that
    does not fit fails before the first step: tests/distributed/test_hierarchy.py)."""
    config = tmp_path / "c.yaml"
    config.write_text(HIERARCHICAL_CONFIG.replace("NAME", "graddrop"))
    out = _gradcomp("fit", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in out.stderr + out.stdout
    assert "hierarchical exchange, 2 sites of 2 ranks" in out.stderr + out.stdout
