"""Declared collective variants: what a compressor offers a planner, and the per-bucket view it travels as.

The planner picks among :meth:`Compressor.collectives` and hands its choice to the hook as a
:class:`~lightning_gradcomp.exchange.planner.BucketPlan`; the compressor itself is never changed.
"""

import pytest
import torch

from lightning_gradcomp.compressors import GradientDropping, Identity, TernGrad
from lightning_gradcomp.compressors.backends import Backend
from lightning_gradcomp.compressors.base import Aggregation, CollectiveVariant
from lightning_gradcomp.exchange.router import Router
from lightning_gradcomp.exchange.planner import BucketPlan

GATHER = CollectiveVariant("allgather", Aggregation.GATHER)
INT8 = CollectiveVariant("allreduce_int8", Aggregation.SUM)


def test_terngrad_declares_both_variants_only_when_left_on_auto() -> None:
    assert TernGrad().collectives(2) == (GATHER, INT8)
    assert TernGrad().collectives(127) == (GATHER, INT8)
    assert TernGrad().collectives(128) == (GATHER,)  # int8 sums of 128 ternaries overflow
    assert TernGrad(scaler_share="per_worker").collectives(8) == (GATHER,)  # nothing to sum without a shared scaler
    assert TernGrad(collective="allgather").collectives(8) == ()  # the user's choice is kept
    assert GradientDropping().collectives(8) == () and Identity().collectives(8) == ()


def _set_up(comp: TernGrad, world_size: int = 4) -> TernGrad:
    comp.setup(1, world_size, torch.device("cpu"))
    return comp


def test_a_variant_travels_its_way_and_leaves_the_compressor_as_it_was() -> None:
    comp = _set_up(TernGrad(backend="torch"))
    before = comp.describe()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    int8, packed = comp.for_collective("allreduce_int8"), comp.for_collective("allgather")
    assert int8.aggregation_for(4) is Aggregation.SUM and int8.compress(x, "w").payload.dtype == torch.int8
    assert packed.aggregation_for(4) is Aggregation.GATHER and packed.compress(x, "w").nbytes == 250
    assert comp.describe() == before and comp.aggregation_for(4) is Aggregation.GATHER
    assert comp.for_collective("allgather") is packed  # made once per setup
    comp.setup(1, 4, torch.device("cpu"))
    assert comp.for_collective("allgather") is not packed  # a view of the old setup is not reused


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_views_draw_from_the_compressors_own_streams(backend: Backend) -> None:
    """Buckets alternating between variants draw the same random streams as one compressor would."""
    mixed = _set_up(TernGrad(backend=backend, seed=3))
    plain = _set_up(TernGrad(backend=backend, seed=3, collective="allgather"))
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        ours = mixed.for_collective("allgather").compress(x, "w") if step % 2 else mixed.compress(x, "w")
        theirs = plain.compress(x, "w")
        assert torch.equal(mixed.decompress(ours), plain.decompress(theirs)), f"step {step}"
    assert mixed.state_dict().keys() == plain.state_dict().keys()
    assert mixed.state_dict()["counters"] == plain.state_dict()["counters"]


def test_an_undeclared_variant_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Expected `collective` to be one of TernGrad's variants .* Fix"):
        _set_up(TernGrad(collective="allgather")).for_collective("allreduce_int8")
    with pytest.raises(ValueError, match=r"variants \[\] but got 'allgather'"):
        Identity().for_collective("allgather")
    with pytest.raises(ValueError, match="allreduce_int8"):
        _set_up(TernGrad(), world_size=200).for_collective("allreduce_int8")


def test_a_bucket_plan_routes_the_buckets_layers() -> None:
    comp, identity = _set_up(TernGrad()), Identity()
    assert BucketPlan("allreduce_fp32", None, {}).compressor_for(comp, identity) is identity
    assert BucketPlan("allgather", None, {}).compressor_for(comp, identity) is comp
    view = BucketPlan("allreduce_int8", "allreduce_int8", {}).compressor_for(comp, identity)
    assert view is comp.for_collective("allreduce_int8") and view is not comp


def test_the_router_sends_a_bucket_as_its_plan_says() -> None:
    comp = _set_up(TernGrad())
    router = Router(comp, float_names={"bias"})
    assert router.route_with(None, ["w", "bias"]) == [comp, router.identity]  # no planner
    w, bias = router.route_with(BucketPlan("allreduce_int8", "allreduce_int8", {}), ["w", "bias"])
    assert w.aggregation_for(4) is Aggregation.SUM
    assert bias is router.identity  # kept in fp32 whatever the plan
    assert router.route_with(BucketPlan("allreduce_fp32", None, {}), ["w"]) == [router.identity]
    router.set_dense(True)  # a dense warm-up overrides the plan
    assert router.route_with(BucketPlan("allreduce_int8", "allreduce_int8", {}), ["w"]) == [router.identity]
    assert comp.collective == "auto"
