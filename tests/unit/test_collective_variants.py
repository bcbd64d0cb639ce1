"""Declared collective variants: what a compressor offers a planner, and the per-bucket view it travels as.

The planner picks among :meth:`Compressor.collectives` and hands its choice to the hook as a
:class:`~lightning_gradcomp.exchange.planner.BucketPlan`; the compressor itself is never changed.
"""

import pytest
import torch

from lightning_gradcomp.compressors import GradientDropping, Identity, TernGrad
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.base import Aggregation, CollectiveChoice, CollectiveVariant, Compressor
from lightning_gradcomp.exchange.router import Router
from lightning_gradcomp.exchange.planner import BucketPlan
from lightning_gradcomp.compressors.per_tensor import per_tensor

GATHER = CollectiveVariant("allgather", Aggregation.GATHER)
INT8 = CollectiveVariant("allreduce_int8", Aggregation.SUM)


def test_terngrad_declares_both_variants_only_when_left_on_auto() -> None:
    assert TernGrad().collectives(2) == (GATHER, INT8)
    assert TernGrad().collectives(127) == (GATHER, INT8)
    assert TernGrad().collectives(128) == (GATHER,)  # int8 sums of 128 ternaries overflow
    assert TernGrad(scaler_share="per_worker").collectives(8) == (GATHER,)  # nothing to sum without a shared scaler
    assert TernGrad(collective="allgather").collectives(8) == ()  # the user's choice is kept
    assert not isinstance(GradientDropping(), CollectiveChoice) and not isinstance(Identity(), CollectiveChoice)


def _set_up(comp: TernGrad, world_size: int = 4) -> TernGrad:
    comp.setup(1, world_size, torch.device("cpu"))
    return comp


def _variant(comp: TernGrad, name: str) -> Compressor:
    return next(v.compressor for v in comp.collectives(comp.world_size) if v.name == name)


def test_a_variant_travels_its_way_and_leaves_the_compressor_as_it_was() -> None:
    comp = _set_up(TernGrad(backend="torch"))
    before = comp.describe()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    int8, packed = _variant(comp, "allreduce_int8"), _variant(comp, "allgather")
    assert int8.aggregation is Aggregation.SUM and per_tensor(int8).compress(x, "w").payload.dtype == torch.int8
    assert packed.aggregation is Aggregation.GATHER and per_tensor(packed).compress(x, "w").nbytes == 250
    assert comp.describe() == before and comp.aggregation is Aggregation.GATHER
    assert _variant(comp, "allgather") is packed  # made once per setup
    comp.setup(1, 4, torch.device("cpu"))
    assert _variant(comp, "allgather") is not packed  # a view of the old setup is not reused


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_views_draw_from_the_compressors_own_streams(backend: Backend) -> None:
    """Buckets alternating between variants draw the same random streams as one compressor would."""
    mixed = _set_up(TernGrad(backend=backend, seed=3))
    plain = _set_up(TernGrad(backend=backend, seed=3, collective="allgather"))
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        ours = per_tensor(_variant(mixed, "allgather")).compress(x, "w") if step % 2 else per_tensor(mixed).compress(x, "w")
        theirs = per_tensor(plain).compress(x, "w")
        assert torch.equal(per_tensor(mixed).decompress(ours), per_tensor(plain).decompress(theirs)), f"step {step}"
    assert mixed.state_dict().keys() == plain.state_dict().keys()
    assert mixed.state_dict()["counters"] == plain.state_dict()["counters"]


def test_a_variant_travels_as_it_is_declared() -> None:
    for variant in _set_up(TernGrad()).collectives(4):
        assert variant.compressor.aggregation is variant.aggregation, variant.name


def test_a_bucket_plan_routes_the_buckets_layers() -> None:
    comp, identity = _set_up(TernGrad()), Identity()
    assert BucketPlan("allreduce_fp32", None, {}).compressor_for(comp, identity) is identity
    assert BucketPlan("allgather", None, {}).compressor_for(comp, identity) is comp
    view = BucketPlan("allreduce_int8", "allreduce_int8", {}).compressor_for(comp, identity)
    assert view is _variant(comp, "allreduce_int8") and view is not comp


def test_the_router_sends_a_bucket_as_its_plan_says() -> None:
    comp = _set_up(TernGrad())
    router = Router(comp, float_names={"bias"})
    assert router.route_with(None, ["w", "bias"]) == [comp, router.identity]  # no planner
    w, bias = router.route_with(BucketPlan("allreduce_int8", "allreduce_int8", {}), ["w", "bias"])
    assert w.aggregation is Aggregation.SUM
    assert bias is router.identity  # kept in fp32 whatever the plan
    assert router.route_with(BucketPlan("allreduce_fp32", None, {}), ["w"]) == [router.identity]
    router.set_dense(True)  # a dense warm-up overrides the plan
    assert router.route_with(BucketPlan("allreduce_int8", "allreduce_int8", {}), ["w"]) == [router.identity]
    assert comp.collective == "auto"
