"""The ``gradcomp`` console script: LightningCLI with every gradcomp strategy name registered.

``gradcomp fit --config recipes/quickstart.yaml`` trains; the strategy is a registered name
(``trainer.strategy: terngrad``) or a ``class_path``/``init_args`` block exposing every option.
"""

import sys
from typing import Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_gradcomp  # noqa: F401  (registers the strategy names)

# subcommands that are not LightningCLI's: name -> "module:function" taking argv
_EXTRA_COMMANDS: dict[str, str] = {
    "report": "lightning_gradcomp.report:main",  # gradcomp report RUN: PNG plots from CSV/TensorBoard logs
}


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``gradcomp``; returns None (a console script that returns a value exits with 1)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in _EXTRA_COMMANDS:
        import importlib

        module, function = _EXTRA_COMMANDS[argv[0]].split(":")
        getattr(importlib.import_module(module), function)(argv[1:])
        return
    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
