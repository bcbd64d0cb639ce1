"""Shared by the reproduction runners: train a recipe through LightningCLI with overrides, then evaluate it.

``run_recipe`` builds exactly what ``gradcomp fit --config RECIPE OVERRIDES...`` builds (the same parser), so
each printed row corresponds to a command line that the runner also prints.
"""

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
# run from a checkout: the package next to this folder, not an installed copy (an editable install may point
# at another checkout)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_gradcomp  # noqa: E402  (registers the strategy names)
from benchmarks.lm import provenance  # noqa: E402,F401  (re-exported for the runners)

#: where the reproduction runners store their results (one JSON per command; ``tools/results_tables.py`` reads them)
REPRODUCTIONS = ROOT / "benchmarks" / "results" / "reproductions"

FASHION = "gradcomp_lab.data.FashionMNISTDataModule"


def command_line(recipe: str, overrides: list[str]) -> str:
    """The ``gradcomp fit`` command that trains the same run."""
    return " ".join(["gradcomp fit --config", recipe, *overrides])


def run_recipe(recipe: str, overrides: list[str], quiet: bool = True, callbacks: Optional[list[Any]] = None) -> dict[str, Any]:
    """Fit ``recipe`` with ``overrides``, validate once more at the end, and return metrics and wall time.

    Returns a dict with the final ``callback_metrics`` after validation (floats), ``seconds`` of ``fit``, and
    ``bytes_per_step`` for a :class:`~lightning_gradcomp.strategies.towers.TowerStrategy` (one worker's payload).
    """
    args = ["--config", str(ROOT / recipe), *overrides]
    if quiet:
        args += ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    cli = LightningCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
        args=args, run=False, save_config_kwargs={"overwrite": True},
    )
    cli.trainer.callbacks.extend(callbacks or [])  # type: ignore[attr-defined]  # set by Lightning's callback connector
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - start
    # the strategy's byte records before validating: `validate` sets the strategy up again, which starts them afresh
    strategy = cli.trainer.strategy
    sent: dict[str, Any] = {}
    if hasattr(strategy, "bytes_per_step"):
        sent = {"bytes_per_step": strategy.bytes_per_step(), "layer_records": dict(getattr(strategy, "records", {}))}
    results = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    out: dict[str, Any] = {k: float(v) for k, v in (results[0] if results else {}).items()}
    out["seconds"] = seconds
    out["steps"] = cli.trainer.global_step
    out.update(sent)
    out["model"] = cli.model
    return out


def machine() -> str:
    """One line describing where the numbers were measured."""
    return (f"{os.uname().nodename}, {os.cpu_count()} CPUs, torch {torch.__version__}, threads {torch.get_num_threads()}, "
            f"lightning_gradcomp from {Path(lightning_gradcomp.__file__).parent}")


def host() -> str:
    """The machine as the stored results name it (``tools/results_tables.py`` adds the torch version)."""
    return f"{os.uname().nodename}, {os.cpu_count()} CPUs (shared), Python {sys.version.split()[0]}"


def save_results(out: Path, script: str, argv: list[str], rows: list[dict[str, Any]], stamp: dict[str, str],
                 **extra: Any) -> None:
    """Store a runner's rows as JSON with what the results tables stamp: the command that produced them (``script``
    with ``argv``), the machine, torch, and ``stamp``: the commit and date of the code that ran
    (``benchmarks.lm.provenance()``, taken when the run started: the tree may change while it runs)."""
    result = {"command": shlex.join(["python", script, *argv]), "machine": host(), "torch": torch.__version__,
              **stamp, **extra, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"# stored {out}", flush=True)
