"""GradCompStrategy configuration: names, DDP options, validation before training."""

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import Identity, TernGrad
from lightning_gradcomp.registry import compressor_names


def test_import_registers_names_with_fresh_compressors() -> None:
    assert {"terngrad", "fp32"} <= set(StrategyRegistry.available_strategies())
    a, b = StrategyRegistry.get("terngrad"), StrategyRegistry.get("terngrad")
    assert isinstance(a, GradCompStrategy) and isinstance(a.compressor, TernGrad)
    assert a.compressor is not b.compressor, "two Trainers must not share a stateful compressor"
    assert isinstance(StrategyRegistry.get("fp32").compressor, Identity)


def test_trainer_accepts_the_registered_name() -> None:
    trainer = Trainer(strategy="terngrad", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, GradCompStrategy)
    assert isinstance(trainer.strategy.compressor, TernGrad)


@pytest.mark.parametrize("name", ["terngard", "TernGard", "shraded_terngrad"])
def test_a_misspelt_name_given_to_the_trainer_names_the_closest_one(name: str) -> None:
    """The CLI's message (``registry.strategy_name_error``) from a plain script too, instead of Lightning's list of its
    own names without a suggestion."""
    closest = "sharded_terngrad" if "shraded" in name else "terngrad"
    with pytest.raises(ValueError, match=rf"got {name!r}\. Fix: did you mean {closest!r}\?.*'terngrad_lm'.*'ddp'"):
        Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)


def test_names_lightning_accepts_are_still_accepted_in_any_case() -> None:
    assert isinstance(Trainer(strategy="TernGrad", accelerator="cpu", devices=2, logger=False).strategy, GradCompStrategy)
    assert type(Trainer(strategy="DDP", accelerator="cpu", devices=2, logger=False).strategy).__name__ == "DDPStrategy"


def test_the_strategy_check_wraps_each_lightning_connector_once() -> None:
    """Importing twice (or a reload) must not stack the wrappers: each connector's check is wrapped exactly once."""
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from lightning_gradcomp.strategies import argument

    connectors = (_AcceleratorConnector, _Connector)
    before: list[Any] = [c._check_config_and_set_final_flags for c in connectors]
    argument.install()
    assert [c._check_config_and_set_final_flags for c in connectors] == before
    assert all(getattr(m, "_gradcomp_strategy_check", False) for m in before)
    assert not any(getattr(m.__wrapped__, "_gradcomp_strategy_check", False) for m in before)


def test_ddp_options_reach_ddp() -> None:
    s = GradCompStrategy(
        "terngrad", find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=5
    )
    assert s._ddp_kwargs == {
        "find_unused_parameters": True,
        "static_graph": True,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 5,
    }
    # passed only when given: torch 2.13 warns about `broadcast_buffers` whenever it is passed
    assert GradCompStrategy("fp32", broadcast_buffers=False)._ddp_kwargs["broadcast_buffers"] is False
    assert GradCompStrategy("fp32", process_group_backend="gloo").process_group_backend == "gloo"


def test_unknown_option_is_a_value_error_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"clip_factr.*compressor=TernGrad\(clip_factor=2.5\)"):
        GradCompStrategy("terngrad", clip_factr=2.5)


def test_unknown_compressor_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="terngrd") as info:
        GradCompStrategy("terngrd")
    assert all(name in str(info.value) for name in compressor_names())


def test_custom_hook_arguments_are_refused_but_explicit_none_is_fine() -> None:
    GradCompStrategy("fp32", ddp_comm_hook=None, ddp_comm_state=None)  # what jsonargparse passes
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        GradCompStrategy("fp32", ddp_comm_hook=lambda s, b: None)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_min_numel_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="min_numel"):
        GradCompStrategy("terngrad", min_numel=bad)


def test_exclusion_patterns_and_min_numel_select_float_tensors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    named = dict(model.named_parameters())
    s = GradCompStrategy("terngrad", exclude=["1.*"], min_numel=9)
    assert s._float_names(named) == {"1.weight", "1.bias", "0.bias"}
    with pytest.raises(ValueError, match=r"'classifier\.\*' matches none.*0\.weight"):
        GradCompStrategy("terngrad", exclude=["classifier.*"])._float_names(named)


def test_gradcomp_is_a_registered_name_for_the_class_with_its_defaults() -> None:
    assert GradCompStrategy.strategy_name == "gradcomp"
    strategy = StrategyRegistry.get("gradcomp")
    assert type(strategy) is GradCompStrategy and isinstance(strategy.compressor, TernGrad)


def test_strategy_name_errors_name_the_cause_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gradcomp.registry import strategy_name_error, strategy_names

    assert strategy_name_error("terngrad") is None and strategy_name_error("ddp") is None
    assert strategy_name_error("auto") is None
    typo = strategy_name_error("terngrd")
    assert typo is not None and "did you mean 'terngrad'?" in typo and all(n in typo for n in strategy_names())
    # a gradcomp name Lightning does not know yet: the script forgot `import lightning_gradcomp`
    monkeypatch.setattr(StrategyRegistry, "available_strategies", lambda: ["ddp"])
    missing = strategy_name_error("weightgrad")
    assert missing is not None and "Fix: `import lightning_gradcomp`" in missing


def test_weightgrad_on_one_site_warns_with_the_fix() -> None:
    from lightning_gradcomp import WeightGradStrategy

    with pytest.warns(UserWarning, match=r"one site.*no WAN round.*Fix: set `site_size` \(e\.g\. site_size=2\)"):
        assert WeightGradStrategy().make_layout(4).sizes == (4,)  # one node: one site by default
    with pytest.warns(UserWarning, match="one site"):
        WeightGradStrategy(site_sizes=[4]).make_layout(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert WeightGradStrategy(site_size=2).make_layout(4).sizes == (2, 2)
