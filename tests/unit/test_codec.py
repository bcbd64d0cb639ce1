"""The codec measures through the hook's exchange (a loopback transport) what the compressor's own packets say."""

import pytest
import torch

from lightning_gradcomp import registry
from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.exchange.codec import measure_codec
from lightning_gradcomp.compressors.per_tensor import per_tensor

SHAPES = [("a.weight", (64, 32)), ("a.bias", (64,)), ("b.weight", (10, 64)), ("c", (3, 3, 8, 4))]


def _per_layer(name: str, world: int) -> tuple[float, float, Aggregation]:
    """Bytes, shared-statistic bytes and aggregation from the compressor's per-layer packets, on the tensors
    ``measure_codec`` draws (the exchange reads its bytes from the ledger instead)."""
    compressor = registry.make_compressor(name)
    compressor.setup(0, world, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    grads = [(n, torch.randn(*shape, generator=gen) * 1e-3) for n, shape in SHAPES]
    for n, g in grads:
        per_tensor(compressor).observe_gradient(g, n)
    if isinstance(compressor, MultiRoundCompressor):
        exchanged = compressor.exchange([g for _, g in grads], [n for n, _ in grads], lambda t: t)
        return float(sum(e.nbytes for e in exchanged)), 0.0, compressor.aggregation
    packets = [per_tensor(compressor).compress(g, n, None) for n, g in grads]
    stats = [per_tensor(compressor).local_statistic(g, n) for n, g in grads]
    shared = float(sum(4 * s.numel() for s in stats if s is not None))
    return float(sum(p.nbytes for p in packets)), shared, compressor.aggregation


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", registry.compressor_names())
def test_the_exchange_counts_the_bytes_of_the_compressors_own_packets(name: str, world: int) -> None:
    codec = measure_codec(registry.make_compressor(name), SHAPES, world, timed=False)
    nbytes, shared, aggregation = _per_layer(name, world)
    assert (codec.nbytes, codec.shared_nbytes, codec.aggregation) == (nbytes, shared, aggregation)
    assert codec.nbytes > 0
    assert codec.rounds == (1 if shared else 0)
