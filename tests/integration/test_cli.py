"""The ``gradcomp`` console script (LightningCLI) with strategies from YAML."""

import os
import subprocess
import sys
from pathlib import Path

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
        class_path: lightning_gradcomp.TernGrad
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


def _gradcomp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    code = "import sys; from lightning_gradcomp.cli import main; main()"
    script = cwd / "gradcomp_entry.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_print_config_exposes_every_option(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG)
    out = _gradcomp("fit", "--config", str(config), "--print_config", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for option in ("clip_mode: code", "packing: base3", "scaler_share: max", "static_graph: true", "exclude:"):
        assert option in out.stdout


def test_fit_from_yaml_with_class_path_strategy_on_two_ranks(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    # the SigmaClipping callback would clip twice with TernGrad's own clip_factor: that must be refused
    config.write_text(FULL_CONFIG)
    out = _gradcomp("fit", "--config", str(config), cwd=tmp_path)
    assert out.returncode != 0 and "clip_factor=0" in out.stderr
    config.write_text(FULL_CONFIG.replace("clip_factor: 2.5", "clip_factor: 0.0"))
    out = _gradcomp("fit", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in out.stderr + out.stdout


@pytest.mark.parametrize("name", ["terngrad", "fp32"])
def test_registered_name_from_the_command_line(tmp_path: Path, name: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(FULL_CONFIG.split("  strategy:")[0])
    out = _gradcomp("fit", "--config", str(config), f"--trainer.strategy={name}", "--print_config", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"strategy: {name}" in out.stdout
