"""Fit recipes for a couple of steps in one process, one after another (run as a subprocess by test_recipes.py).

Usage: python -m tests.integration.recipe_fit DATA_ROOT RECIPE::OVERRIDE::OVERRIDE ...
Prints ``FIT-OK <recipe> <global_step>`` per recipe; the first failure raises (non-zero exit).
"""

import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from tests.integration.recipe_data import ROOT, data_overrides

#: every fit: CPU, one process, two training batches and two validation batches, quiet
COMMON = [
    "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.fast_dev_run=2",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    data_root = Path(argv[0])
    for spec in argv[1:]:
        recipe, *extra = spec.split("::")
        path = ROOT / recipe
        args = ["--config", str(path), *data_overrides(path, data_root), *COMMON, *extra]
        cli = LightningCLI(
            LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
            args=args, run=False, save_config_kwargs={"overwrite": True},
        )
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert cli.trainer.global_step == 2, (recipe, cli.trainer.global_step)
        for p in cli.model.parameters():
            assert torch.isfinite(p).all(), recipe
        print(f"FIT-OK {recipe} {cli.trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
