"""Packaging a new user meets: optional extras fail with the install that fixes them, the license, CI = README."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger

from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.extras import require

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")


def test_core_imports_without_wandb() -> None:
    code = (
        "import sys; sys.modules['wandb'] = None\n"  # as if not installed: any import of it raises
        "import lightning_gradcomp, gradcomp_lab.cli, lightning_gradcomp.callbacks, gradcomp_lab.tasks\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_wandb_is_an_extra_that_test_includes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("wandb") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("wandb") for d in extras["wandb"])
    # README installs `.[test]` only: everything the tests import must be in it
    for needed in ("wandb", "matplotlib", "tensorboard", "scikit-learn"):
        assert any(d.startswith(needed) for d in extras["test"]), needed


def test_monitor_with_wandb_logger_but_no_wandb_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logger = WandbLogger(offline=True, save_dir=str(tmp_path))  # builds no run until used
    trainer = Trainer(strategy="fp32", accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'lightning_gradcomp[wandb]'")):
        CompressionMonitor().setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_require_returns_the_module_or_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert require("json", "none", "a test").dumps([]) == "[]"
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"`wandb`.*W&B logging.*lightning_gradcomp\[wandb\]"):
        require("wandb", "wandb", "W&B logging")


def test_report_names_a_wrong_path_even_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradcomp_lab import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "does not exist" in err and "matplotlib" not in err


def test_license_file_matches_the_declared_license() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_ci_runs_the_readme_commands() -> None:
    """``.ci/run`` runs README's two commands word for word: each is in README once, and in ``.ci/run`` as a line."""
    readme = (ROOT / "README.md").read_text().splitlines()
    install = [line for line in readme if line.startswith("python3 -m venv .venv && ")]
    tests = [line for line in readme if line.startswith("python -m pytest")]
    assert len(install) == 1 and 'pip install -e ".[test]"' in install[0]
    assert tests == ["python -m pytest -q -n 2 --dist loadfile tests"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install[0] in ci and tests[0] in ci


def test_cli_wandb_logger_without_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import lightning.pytorch.loggers.wandb as lightning_wandb
    from lightning_utilities.core.imports import RequirementCache

    from gradcomp_lab.cli import GradCompCLI

    # what Lightning sees without the package: an unmet requirement
    monkeypatch.setattr(lightning_wandb, "_WANDB_AVAILABLE", RequirementCache("wandb>=999"))
    monkeypatch.setattr(sys, "argv", ["gradcomp"])
    args = [
        "--model=tests.integration.cli_fixtures.TinyClassifier", "--data=tests.integration.cli_fixtures.RandomDataModule",
        "--trainer.logger=lightning.pytorch.loggers.WandbLogger", "--trainer.accelerator=cpu",
    ]
    with pytest.raises(SystemExit) as exit_info:
        GradCompCLI(args=args, run=False)
    first = capsys.readouterr().err.splitlines()[0]
    assert exit_info.value.code == 2
    assert first.startswith("gradcomp: error: Expected `wandb` to be installed for `WandbLogger`, but it is not. "
                            "Fix: pip install 'lightning_gradcomp[wandb]'"), first


def test_package_data_ships_the_kernel_sources_and_py_typed() -> None:
    # a non-editable install holds only the package data pyproject.toml lists: a C++ file the build reads but no
    # glob matches would leave an installed package unable to compile its kernels (silently on the torch path)
    from lightning_gradcomp.kernels import _build

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {
        path.resolve()
        for package, globs in package_data.items()
        for pattern in globs
        for path in (ROOT / package.replace(".", "/")).glob(pattern)
    }
    needed = [_build.SOURCE_DIR / name for name in (*_build._HEADERS, *_build._SOURCES)]
    assert needed and all(path.is_file() for path in needed)
    assert {path.resolve() for path in needed} <= shipped
    assert (ROOT / "lightning_gradcomp" / "py.typed").resolve() in shipped


def test_ci_lints_and_type_checks_the_library_after_the_install() -> None:
    # the lint steps run in the venv the README's install line activated, from the `lint` extra, before the tests
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lint"]
    assert {re.split(r"[<>=!~ \[]", r)[0] for r in lint} == {"ruff", "mypy"}
    # plain `mypy` checks what [tool.mypy] names: both packages and the code ruff lints around them, so none of it
    # can drift untyped again
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["packages"] == [
        "lightning_gradcomp", "gradcomp_lab", "tests", "benchmarks", "tools", "examples", "docs"
    ]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    install = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv .venv && "))
    ruff = "ruff check lightning_gradcomp gradcomp_lab tests benchmarks tools examples docs"  # the tests and scripts too
    steps = [ci.index(step) for step in ('pip install -e ".[lint,docs]"', ruff, "mypy")]
    assert install < steps[0] < steps[1] < steps[2] < ci.index("python -m pytest -q -n 2 --dist loadfile tests")
