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
    _close_process_group()


def _close_process_group() -> None:
    """Destroy the process group the run created, while the interpreter is still whole.

    Lightning keeps it after ``fit``; left to interpreter shutdown, a Gloo group's worker threads could be torn
    down in the wrong order and abort the process ("terminate called without an active exception", exit status
    -6) after a successful run.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
