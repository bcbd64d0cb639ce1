"""The ``gradcomp`` console script: LightningCLI with every gradcomp strategy name registered.

``gradcomp fit --config recipes/quickstart.yaml`` trains; the strategy is a registered name
(``trainer.strategy: terngrad``) or a ``class_path``/``init_args`` block exposing every option. What it adds to
LightningCLI (:class:`GradCompCLI`, usable from Python too):

* errors whose first line names the option by its full key, the value and the fix (:mod:`gradcomp_lab.cli_errors`),
  without a traceback (``JSONARGPARSE_DEBUG=true`` shows jsonargparse's report and the traceback): a value of the
  wrong type, a misspelt option or class, and a value a constructor refuses before the first step (``sync_every: 0``,
  ``warmup_steps`` past ``--trainer.max_steps``); a misspelt strategy name is answered with the registered names
  instead of Lightning's generic list;
* ``--print_config`` (and a saved ``config.yaml``) writes a registered strategy or compressor name out as the
  ``class_path`` and every ``init_args`` value it stands for;
* the LR schedule's horizon linked to the Trainer's: ``--trainer.max_steps`` alone moves both;
* ``config.yaml`` saved into the run's log directory, never into the working directory (nothing with
  ``logger: false``, as every recipe has: the recipe and the command line are the record; ``--print_config`` shows
  the resolved configuration).
"""

import argparse
import importlib
import os
import sys
from typing import Any, NoReturn, Optional

from jsonargparse import ArgumentError, ArgumentParser, DefaultHelpFormatter, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from typing_extensions import override

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from gradcomp_lab.cli_errors import instantiation_error, summarize
from lightning_gradcomp.extras import missing_extra_message
from lightning_gradcomp.registry import COMPRESSORS, strategy_name_error, strategy_names

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


#: the LR schedule's horizon follows the Trainer's (source, target): GradCompCLI.add_arguments_to_parser
_MAX_STEPS_LINK = ("trainer.max_steps", "model.init_args.max_steps")
#: linked options, target -> source: an error about the target names the source, the option a user sets
_LINKS = {_MAX_STEPS_LINK[1]: _MAX_STEPS_LINK[0]}


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"gradcomp: error: {message}\n")
    sys.exit(2)


def _debug() -> bool:
    """``JSONARGPARSE_DEBUG`` set: show jsonargparse's full report and tracebacks instead of the one-line errors."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() not in ("", "false", "0")


class GradCompParser(LightningArgumentParser):
    """LightningCLI's parser whose errors start with one line naming the option, the value and the fix."""

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        # nested parsers raise to the top one
        first = summarize(message) if self.exit_on_error and not _debug() else None
        if first is None:
            super().error(message, ex)
        _fail(f"{first}\n(every option: `gradcomp fit --help`; jsonargparse's full report: `JSONARGPARSE_DEBUG=true`)")

    @override
    def dump(self, cfg: Namespace, *args: Any, **kwargs: Any) -> str:
        # `--print_config` and the saved config.yaml: a registered name as the class and options it stands for
        if "skip_none" in kwargs:  # LightningCLI's spelling, deprecated by jsonargparse: warned in our frame now
            kwargs["skip_unset"] = kwargs.pop("skip_none")
        return super().dump(_expand_names(cfg), *args, **kwargs)


def _import_path(cls: type) -> str:
    """The shortest import path of ``cls``: ``lightning_gradcomp.GradCompStrategy``, as a recipe writes it. A module's
    own names only (``vars``): a deprecated alias, resolved by the module's ``__getattr__``, is never written."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts)):
        module = ".".join(parts[:end])
        if vars(importlib.import_module(module)).get(cls.__qualname__) is cls:
            return f"{module}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _compressor_block(name: Any) -> Any:
    """A registered compressor name as ``class_path``/``init_args`` (defaults filled in later); other values as given."""
    factory = COMPRESSORS[name.lower()][0] if isinstance(name, str) and name.lower() in COMPRESSORS else None
    if not isinstance(factory, type):  # a factory function (register_compressor) has no class to show
        return name
    return {"class_path": _import_path(factory), "init_args": {}}


def _expand_names(cfg: Namespace) -> Namespace:
    """``cfg`` with a registered strategy name of ours, and registered compressor names in the strategy's options,
    written out as the ``class_path`` and every ``init_args`` value they stand for (what the run uses)."""
    strategy = cfg.get("trainer.strategy") if isinstance(cfg.get("trainer"), Namespace) else None
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        cls = entry["strategy"]
        if not cls.__module__.startswith("lightning_gradcomp."):
            return cfg  # Lightning's own names (ddp, ...) stay names
        block: Any = {"class_path": _import_path(cls), "init_args": dict(entry["init_params"])}
    elif isinstance(strategy, Namespace) and isinstance(strategy.get("init_args"), Namespace):
        block = strategy.as_dict()
    else:
        return cfg
    names = ("compressor", "inner_compressor")
    if not any(isinstance(block["init_args"].get(n), str) for n in names) and isinstance(strategy, Namespace):
        return cfg
    # a parser of its own fills in the defaults, as the CLI's parser does for a class_path given in YAML: first the
    # strategy's (its default compressor may be a name), then those of the compressors the names stand for
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    try:
        block = parser.parse_object({"strategy": block}).strategy.as_dict()
        block["init_args"].update({n: _compressor_block(block["init_args"][n]) for n in names if n in block["init_args"]})
        strategy = parser.parse_object({"strategy": block}).strategy
    except ArgumentError:  # only a display: a value the run itself will refuse is shown as given
        return cfg
    expanded = cfg.clone()
    expanded["trainer.strategy"] = strategy
    return expanded


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
        parser.link_arguments(*_MAX_STEPS_LINK, compute_fn=_schedule_steps, apply_on="parse")

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
        except (ModuleNotFoundError, ValueError, TypeError) as err:  # jsonargparse wraps a class's error in a ValueError
            chain: list[BaseException] = []
            cause: Optional[BaseException] = err
            while cause is not None:
                chain.append(cause)
                cause = cause.__cause__
            missing = next((c for c in chain if isinstance(c, ModuleNotFoundError)), None)
            if missing is not None and "wandb" in str(missing):
                # Lightning's WandbLogger names the missing distribution, not the extra that installs it
                _fail(missing_extra_message("wandb", "wandb", "`WandbLogger`") + f" ({str(missing).splitlines()[0]})")
            if _debug():
                raise
            # a value a constructor refused: its message, naming the option by its full key, instead of the traceback
            subcommand = self.config.get("subcommand")
            config = (self.config[subcommand] if subcommand else self.config).as_dict()
            first = instantiation_error("\n".join(str(c) for c in chain), config, _LINKS)
            if first is None:
                raise
            _fail(f"{first}\n(the traceback: `JSONARGPARSE_DEBUG=true`)")


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``gradcomp``; returns None (a console script that returns a value exits with 1)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in _EXTRA_COMMANDS:
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
