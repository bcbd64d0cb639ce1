"""``Fabric(strategy=...)`` resolves every registered name and a strategy instance; bad configurations fail early."""

from datetime import timedelta

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning.pytorch import Trainer

from lightning_gradcomp import (
    DiLoCoStrategy,
    GradCompFabricStrategy,
    GradCompStrategy,
    PresetStrategy,
    ShardedGradCompFabricStrategy,
    ShardedGradCompStrategy,
)
from lightning_gradcomp.callbacks import MomentumCorrection, SigmaClipping
from lightning_gradcomp.callbacks.clipping import SigmaClip
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.registry import NOTEBOOK_SUFFIX, SHARDED_PREFIX, compressor_names, make_compressor

#: this package's Fabric strategy classes
_FABRIC_CLASSES = (GradCompFabricStrategy, ShardedGradCompFabricStrategy)


@pytest.mark.parametrize("name", compressor_names())
def test_every_registered_name_constructs_a_fabric_strategy(name: str) -> None:
    for key, start_method in ((name, "popen"), (name + NOTEBOOK_SUFFIX, "fork")):
        assert key in STRATEGY_REGISTRY
        fabric = Fabric(strategy=key, accelerator="cpu", devices=2)
        strategy = fabric.strategy
        assert isinstance(strategy, GradCompFabricStrategy)
        assert type(strategy.compressor) is type(make_compressor(name))
        assert strategy._start_method == start_method
    other = Fabric(strategy=name, accelerator="cpu", devices=2).strategy
    assert isinstance(other, GradCompFabricStrategy) and isinstance(strategy, GradCompFabricStrategy)
    assert other.compressor is not strategy.compressor, "two Fabrics must not share a stateful compressor"


def test_fabric_accepts_a_configured_strategy_instance() -> None:
    compressor = TernGrad(clip_factor=0.0)
    strategy = GradCompFabricStrategy(
        compressor, exclude=["0.*"], bucket_cap_mb=5, static_graph=True, transforms=[SigmaClipping(2.5)]
    )
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    assert fabric.strategy is strategy and strategy.compressor is compressor
    assert [type(t) for t in strategy.transforms] == [SigmaClip]
    # broadcast_buffers is left to DDP unless given: passing it makes torch print a deprecation warning
    assert strategy._ddp_kwargs == {
        "find_unused_parameters": False, "static_graph": True, "gradient_as_bucket_view": False, "bucket_cap_mb": 5
    }


@pytest.mark.parametrize(
    ("build", "match"),
    [
        # wrong types on purpose (ignored for mypy): the checks under test run at construction
        (lambda: GradCompFabricStrategy("terngrad", transforms=[object()]), "Expected every entry of `transforms`"),
        (lambda: GradCompFabricStrategy("terngrad", transforms=[SigmaClipping(2.5)]), "Expected one sigma clipping"),
        (lambda: GradCompFabricStrategy("dgc", transforms=[MomentumCorrection(0.9, weight_decay=1e-4)]), "weight_decay"),
        (lambda: GradCompFabricStrategy("terngrad", nonfinite="drop"), "Expected `nonfinite`"),
        (lambda: GradCompFabricStrategy("terngrad", ddp_comm_hook=print), "Expected `ddp_comm_hook` to be None"),
        (lambda: GradCompFabricStrategy("terngrad", clip_factor=2.5), "Unknown option"),
        (lambda: GradCompFabricStrategy("ternary"), "Expected `compressor`"),
        (lambda: GradCompFabricStrategy("terngrad", timeout=timedelta(0)), "Expected `timeout`"),
        (lambda: GradCompFabricStrategy("terngrad", static_graph="no"), "Expected `static_graph`"),
        (lambda: GradCompFabricStrategy("terngrad", bucket_cap_mb=-25), "Expected `bucket_cap_mb`"),
    ],
)
def test_bad_fabric_configurations_fail_at_construction(build, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match) as info:
        build()
    assert "Fix:" in str(info.value)


def test_momentum_correction_checks_the_optimizer_at_fabric_setup() -> None:
    import torch

    strategy = GradCompFabricStrategy("dgc", transforms=[MomentumCorrection(0.9)])
    with pytest.raises(ValueError, match="own momentum to be 0"):
        strategy.setup_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9))
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert strategy.setup_optimizer(plain) is plain


def test_pytorch_lightning_trainer_refuses_the_names_and_the_strategy() -> None:
    """What docs/compatibility.md says: the old package name is a separate class hierarchy; use lightning.pytorch."""
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_gradcomp import GradCompStrategy

    for strategy in ("terngrad", GradCompStrategy("terngrad")):
        with pytest.raises(ValueError, match="invalid strategy"):
            pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert not issubclass(GradCompStrategy, pl.strategies.Strategy)


@pytest.mark.parametrize("name", ["diloco", "streaming_diloco", "weightgrad", "diloco_notebook"])
def test_trainer_only_names_are_refused_by_fabric_with_what_to_use(name: str) -> None:
    with pytest.raises(ValueError, match="Trainer-only") as info:
        Fabric(strategy=name, accelerator="cpu", devices=2)
    message = str(info.value)
    assert f"got {name!r}" in message and "Fix:" in message
    assert "GradCompFabricStrategy" in message and "'terngrad'" in message  # what Fabric supports
    assert f"Trainer(strategy={name!r})" in message  # and where this one runs
    # every name Fabric runs is offered, read from Fabric's registry: the presets ('terngrad_lm') and sharded names too
    runnable = [n for n, data in STRATEGY_REGISTRY.items() if not n.endswith(NOTEBOOK_SUFFIX)
                and isinstance(data["strategy"], type) and issubclass(data["strategy"], _FABRIC_CLASSES)]
    assert "terngrad_lm" in runnable and "sharded_terngrad" in runnable
    assert [n for n in runnable if repr(n) not in message] == []


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (lambda: GradCompStrategy("terngrad"), "`Fabric(strategy=GradCompFabricStrategy(...))`"),
        (lambda: PresetStrategy("qsgd_lm"), "`Fabric(strategy=PresetFabricStrategy(...))`"),
        (lambda: ShardedGradCompStrategy(), "`Fabric(strategy=ShardedGradCompFabricStrategy(...))`"),
        (lambda: DiLoCoStrategy(), "Trainer-only"),
    ],
    ids=["gradcomp", "preset", "sharded", "diloco"],
)
def test_a_trainer_strategy_given_to_fabric_is_refused_at_construction_with_the_fabric_class(  # type: ignore[no-untyped-def]
    strategy, expected: str
) -> None:
    """Lightning's own message ("You selected an invalid strategy name") names neither the cause nor the class to use."""
    instance = strategy()
    with pytest.raises(ValueError, match="Expected `strategy`") as info:
        Fabric(strategy=instance, accelerator="cpu", devices=2)
    message = str(info.value)
    assert f"the Trainer's `{type(instance).__name__}`" in message and expected in message and "Fix:" in message


def test_a_fabric_strategy_given_to_the_trainer_names_the_trainer_class() -> None:
    with pytest.raises(ValueError, match=r"got Fabric's `GradCompFabricStrategy`.*Fix: `Trainer\(strategy="
                       r"GradCompStrategy\(\.\.\.\)\)`"):
        # the wrong API on purpose (ignored for mypy): the check under test runs at construction
        Trainer(strategy=GradCompFabricStrategy("terngrad"), accelerator="cpu", devices=2, logger=False)  # type: ignore[arg-type]


def test_a_misspelt_name_given_to_fabric_names_the_closest_fabric_name() -> None:
    with pytest.raises(ValueError, match=r"got 'terngard'\. Fix: did you mean 'terngrad'\?"):
        Fabric(strategy="terngard", accelerator="cpu", devices=2)
    # what Lightning accepts is still accepted: it looks names up lower-cased
    assert isinstance(Fabric(strategy="TernGrad", accelerator="cpu", devices=2).strategy, GradCompFabricStrategy)


def test_every_sharded_name_constructs_the_sharded_fabric_strategy() -> None:
    for name in compressor_names():
        strategy = Fabric(strategy=SHARDED_PREFIX + name, accelerator="cpu", devices=4).strategy
        assert isinstance(strategy, ShardedGradCompFabricStrategy), name
        assert type(strategy.compressor) is type(make_compressor(name))
    default = Fabric(strategy="sharded_gradcomp", accelerator="cpu", devices=4).strategy
    assert isinstance(default, ShardedGradCompFabricStrategy) and default.shard_size is None


@pytest.mark.parametrize(
    ("build", "match"),
    [
        # wrong types on purpose (ignored for mypy): the checks under test run at construction
        (lambda: ShardedGradCompFabricStrategy("terngrad"), "Expected `parallelize_fn` to be a function"),
        (lambda: ShardedGradCompFabricStrategy(compressor="terngrad", shard_size=0), "Expected `shard_size`"),
        (lambda: ShardedGradCompFabricStrategy(compressor="ternary"), "Expected `compressor`"),
        (lambda: ShardedGradCompFabricStrategy(nonfinite="drop"), "Expected `nonfinite`"),
        (lambda: ShardedGradCompFabricStrategy(timeout=timedelta(0)), "Expected `timeout`"),
    ],
)
def test_bad_sharded_fabric_configurations_fail_at_construction(build, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match) as info:
        build()
    assert "Fix:" in str(info.value)
