"""1-bit Adam's compressed all-reduce on the loopback transport (this rank standing in for every rank, as the codec
measures): it runs the hook's group step for both stages, and its ledgers hold exactly the packets' bytes."""

import math

import pytest
import torch

from lightning_gradcomp.exchange.hook import GroupState, group_step
from lightning_gradcomp.exchange.transport import LoopbackTransport
from lightning_gradcomp.onebit_adam import CompressedAllReduce


@pytest.mark.parametrize(("world", "rank"), [(2, 1), (3, 0), (4, 3)])
def test_loopback_exchange_records_its_packets_bytes(world: int, rank: int) -> None:
    tensors = [("a", 50), ("b", 1), ("c", 29)]
    exchange = CompressedAllReduce(tensors, rank, world, transport=LoopbackTransport(world, rank))
    assert exchange.last_nbytes == 0  # nothing recorded before the first exchange
    x = torch.randn(80, generator=torch.Generator().manual_seed(0))
    mean = exchange.average(x)
    assert mean.shape == x.shape and torch.isfinite(mean).all()
    # worker packet: every piece's sign bits and two float32; server packet: this rank's chunk's pieces
    worker = sum(math.ceil(n / 8) + 8 for n in exchange.worker_segments.numels)
    server = sum(math.ceil(n / 8) + 8 for n in exchange.server_segments.numels)
    assert exchange.last_nbytes == worker + server == exchange.expected_nbytes()
    assert exchange.worker_step.ledger.collectives == {"scatter_to_owners": 1}
    assert exchange.server_step.ledger.collectives == {"gather_from_owners": 1}
    # the worker stage kept what its bits did not carry; the server's mean of identical 1-bit packets is 1-bit
    # already, so its error is exactly zero
    norms = exchange.error_norms()
    assert norms["worker_error_norm"] > 0 and norms["server_error_norm"] == 0


def test_group_step_refuses_a_multi_round_compressor() -> None:
    from lightning_gradcomp.compressors import PowerSGD
    from lightning_gradcomp.exchange.groups import LayerGroup
    from lightning_gradcomp.flat import Segments

    segments = Segments(["w"], [torch.Size([4, 4])])
    group = LayerGroup(PowerSGD(), segments, (0,), 0, (0,))
    with pytest.raises(ValueError, match="Expected a one-round compressor for group_step"):
        group_step(GroupState(LoopbackTransport(2)), group, torch.zeros(16))
