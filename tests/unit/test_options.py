"""The strategies' options are declared once (``strategies/options.py``) and every front end's constructor takes each
of them as a named parameter: what ``inspect.signature`` and LightningCLI's parser see, and what a call binds to."""

import dataclasses
import inspect

import pytest
from jsonargparse import ArgumentParser

from lightning_gradcomp import GradCompStrategy, ShardedGradCompStrategy
from lightning_gradcomp.strategies.fabric import GradCompFabricStrategy, ShardedGradCompFabricStrategy
from lightning_gradcomp.strategies.options import DDPOptions, ShardedOptions

PAIRS = [
    (DDPOptions, GradCompStrategy, GradCompFabricStrategy),
    (ShardedOptions, ShardedGradCompStrategy, ShardedGradCompFabricStrategy),
]


@pytest.mark.parametrize(("options", "trainer", "fabric"), PAIRS)
def test_both_front_ends_take_every_option_by_name_with_its_default(options: type, trainer: type, fabric: type) -> None:
    fields = {f.name: f for f in dataclasses.fields(options)}
    for front_end in (trainer, fabric):
        parameters = inspect.signature(front_end).parameters
        assert "options" not in parameters
        for name, field in fields.items():
            assert parameters[name].default == field.default, (front_end.__name__, name)
            assert parameters[name].annotation == field.type, (front_end.__name__, name)
            assert parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_a_call_binds_keywords_and_the_leading_positional_as_before() -> None:
    strategy = GradCompStrategy("fp32", min_numel=7, pipeline_mb=None, static_graph=True, site_size=2)
    assert type(strategy.compressor).__name__ == "Identity"
    assert (strategy.min_numel, strategy.pipeline_mb) == (7, None)
    assert strategy._ddp_kwargs["static_graph"] is True
    assert strategy.hierarchy is not None
    sharded = ShardedGradCompFabricStrategy(None, compressor="fp32", shard_size=2)
    assert sharded.shard_size == 2 and type(sharded.compressor).__name__ == "Identity"


def test_wrong_names_are_refused_as_before() -> None:
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['min_numell'\] for GradCompStrategy"):
        GradCompStrategy(min_numell=2)  # a DDP engine's further keywords are DDP's, checked by name
    with pytest.raises(ValueError, match=r"did you mean 'shard_size'"):
        ShardedGradCompStrategy(shard_sizes=2)
    with pytest.raises(TypeError, match="multiple values for argument 'compressor'"):
        GradCompFabricStrategy("fp32", compressor="terngrad")
    with pytest.raises(ValueError, match=r"Expected `min_numel` to be an integer >= 1, but got 0"):
        GradCompFabricStrategy(min_numel=0)


@pytest.mark.parametrize("front_end", [GradCompStrategy, ShardedGradCompStrategy])
def test_the_cli_parser_sees_every_option_with_its_default(front_end: type) -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(front_end, "strategy")
    defaults = parser.get_defaults().strategy
    options = DDPOptions if front_end is GradCompStrategy else ShardedOptions
    for field in dataclasses.fields(options):
        assert field.name in defaults, field.name
    assert defaults.min_numel == 1 and defaults.compressor == "terngrad" and defaults.pipeline_mb == 8.0
    # DDP's own hook arguments stay hidden: the strategy installs its hook and refuses them
    assert "ddp_comm_hook" not in defaults
    # each option's help is its description in the dataclass
    assert "parameters with fewer elements (whole tensor) are sent" in " ".join(parser.format_help().split())
