"""The ``gradcomp`` console script: LightningCLI with every gradcomp strategy name registered.

``gradcomp fit --config recipes/quickstart.yaml`` trains; the strategy is a registered name
(``trainer.strategy: terngrad``) or a ``class_path``/``init_args`` block exposing every option. What it adds to
LightningCLI (:class:`GradCompCLI`, usable from Python too):

* errors whose first line names the option, the value and the fix (:mod:`gradcomp_lab.cli_errors`), and a
  misspelt strategy name answered with the registered names instead of Lightning's generic list;
* the LR schedule's horizon linked to the Trainer's: ``--trainer.max_steps`` alone moves both;
* ``config.yaml`` saved into the run's log directory, never into the working directory (nothing with
  ``logger: false``, as every recipe has: the recipe and the command line are the record; ``--print_config`` shows
  the resolved configuration).
"""

import argparse
import os
import sys
from typing import Any, NoReturn, Optional

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from typing_extensions import override

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from gradcomp_lab.cli_errors import summarize
from lightning_gradcomp.extras import missing_extra_message
from lightning_gradcomp.registry import strategy_name_error, strategy_names

# subcommands that are not LightningCLI's: name -> ("module:function" taking argv, one-line help)
_EXTRA_COMMANDS: dict[str, tuple[str, str]] = {
    "report": ("gradcomp_lab.report:main", "PNG plots of a run's compression statistics from its CSV/TensorBoard log"),
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's formatter keeping the description's line breaks (the lists of commands and names)."""


def _description() -> str:
    commands = "\n".join(f"  gradcomp {name} ...  {text} (gradcomp {name} --help)"
                         for name, (_, text) in _EXTRA_COMMANDS.items())
    return (
        "Train with gradient compression: LightningCLI with lightning_gradcomp's strategies registered.\n\n"
        f"Other commands:\n{commands}\n\n"
        "Strategy names for --trainer.strategy=NAME (or trainer.strategy: NAME in YAML):\n  "
        + ", ".join(strategy_names())
        + "\n(any other option through `class_path: lightning_gradcomp.GradCompStrategy` and its `init_args`)"
    )


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"gradcomp: error: {message}\n")
    sys.exit(2)


class GradCompParser(LightningArgumentParser):
    """LightningCLI's parser whose errors start with one line naming the option, the value and the fix."""

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        # nested parsers raise to the top one; JSONARGPARSE_DEBUG asks for jsonargparse's own report
        debug = os.environ.get("JSONARGPARSE_DEBUG", "").lower() not in ("", "false", "0")
        first = summarize(message) if self.exit_on_error and not debug else None
        if first is None:
            super().error(message, ex)
        _fail(f"{first}\n(every option: `gradcomp fit --help`; jsonargparse's full report: `JSONARGPARSE_DEBUG=true`)")


def _schedule_steps(max_steps: Optional[int]) -> Optional[int]:
    """The Trainer's ``max_steps`` as the task's LR-schedule horizon; ``-1`` (unset) lets the task estimate it."""
    return max_steps if max_steps is not None and max_steps > 0 else None


class RunDirSaveConfig(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback``, but never into the working directory: only into a logger's run directory."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not trainer.loggers:  # Lightning would write into default_root_dir, i.e. the current directory
            return
        super().setup(trainer, pl_module, stage)


class GradCompCLI(LightningCLI):
    """LightningCLI for any LightningModule and LightningDataModule given by ``class_path``, as ``gradcomp`` runs it.

    Args:
        args: arguments to parse (``None``: ``sys.argv``).
        **kwargs: further ``LightningCLI`` arguments.
    """

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_callback", RunDirSaveConfig)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", GradCompParser)
        kwargs.setdefault("parser_kwargs", {"description": _description(), "formatter_class": _HelpFormatter})
        super().__init__(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         args=args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # one `--trainer.max_steps` moves the LR schedule too (tasks.TrainingTask.max_steps); ignored by a model
        # without that argument
        parser.link_arguments("trainer.max_steps", "model.init_args.max_steps", compute_fn=_schedule_steps,
                              apply_on="parse")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy")
        if isinstance(strategy, str):
            error = strategy_name_error(strategy)
            if error is not None:
                _fail(error.replace("`strategy`", "`trainer.strategy`"))


    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ModuleNotFoundError, ValueError) as err:  # jsonargparse wraps the logger's error in a ValueError
            cause: Optional[BaseException] = err
            while cause is not None and not isinstance(cause, ModuleNotFoundError):
                cause = cause.__cause__
            if cause is None or "wandb" not in str(cause):
                raise
            # Lightning's WandbLogger names the missing distribution, not the extra that installs it
            _fail(missing_extra_message("wandb", "wandb", "`WandbLogger`") + f" ({str(cause).splitlines()[0]})")


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``gradcomp``; returns None (a console script that returns a value exits with 1)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in _EXTRA_COMMANDS:
        import importlib

        module, function = _EXTRA_COMMANDS[argv[0]][0].split(":")
        getattr(importlib.import_module(module), function)(argv[1:])
        return
    GradCompCLI(args=args)
    close_process_group()
    if args is None:  # the console script: this process is ours to end
        _exit_without_native_teardown()


def _exit_without_native_teardown() -> None:
    """End a finished run here: Python's exit handlers (logging, loggers such as W&B) run, C++ teardown does not.

    Even with the process group destroyed, a Gloo run's native threads torn down with the interpreter aborted a
    successful 2-rank fit now and then ("terminate called without an active exception", exit status -6, seen in a CI
    run of ``tests/integration/test_cli.py``). Everything the run writes is written by now; only that teardown is
    skipped.
    """
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def close_process_group() -> None:
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
