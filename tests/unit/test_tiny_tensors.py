"""Every registered compressor on empty and one-element tensors (a bias of one unit, a zero-size buffer).

Parametrised over ``registry.compressor_names()``, so a compressor registered later is covered without editing
this file. Two ranks are simulated in one process: packets cross the "wire" as their payload bytes only
(decoded with the receiver's own context, as the hook does), summed or gathered by the compressor's aggregation.
"""

from typing import cast

import pytest
import torch

from lightning_gradcomp.compressors.base import Aggregation, Compressor
from lightning_gradcomp.flat import Packet
from lightning_gradcomp.compressors.multiround import MultiRoundCompressor
from lightning_gradcomp.registry import compressor_names, make_compressor
from lightning_gradcomp.compressors.per_tensor import per_tensor

SHAPES = [(0,), (0, 3), (1,), (1, 1)]
WORLD = 2
#: a value every wire format carries exactly (fp16, bf16, sign x scale, one QSGD level, ...)
VALUE = -0.75


def _variants() -> list[tuple[str, str]]:
    """(name, backend): the registered default, and the torch backend too where a compressor has a fused one."""
    return [
        (name, backend)
        for name in compressor_names()
        for backend in (("default", "torch") if hasattr(make_compressor(name), "backend") else ("default",))
    ]


def _ranks(name: str, backend: str, world: int) -> list[Compressor]:
    ranks = []
    for rank in range(world):
        compressor = make_compressor(name)
        if backend != "default":
            compressor.backend = backend  # type: ignore[attr-defined]  # those with a fused backend (_variants)
        compressor.setup(rank, world, torch.device("cpu"))
        ranks.append(compressor)
    return ranks


def _over_the_wire(packet: Packet, payload_bytes: torch.Tensor) -> Packet:
    """The receiver's packet: only the payload's bytes travel; the receiver's own context decodes them."""
    dtype = packet.payload.dtype
    return packet.with_payload(payload_bytes.clone().view(dtype) if dtype != torch.uint8 else payload_bytes)


def _exchange(ranks: list[Compressor], xs: list[torch.Tensor], name: str) -> tuple[list[Packet], torch.Tensor]:
    """Every rank's packet and rank 0's decoded mean, as the hook computes them."""
    local = [per_tensor(c).local_statistic(x, name) for c, x in zip(ranks, xs)]
    # every rank's compressor has a statistic, or none has
    shared = None if local[0] is None else torch.stack(cast(list[torch.Tensor], local)).amax(dim=0)
    packets = []
    for c, x in zip(ranks, xs):
        if c.uses_memory:
            per_tensor(c).observe_gradient(x, name)
        packets.append(per_tensor(c).compress(x, name, shared))
    wire = [p.payload.contiguous().reshape(-1).view(torch.uint8) for p in packets]
    assert [p.nbytes for p in packets] == [w.numel() for w in wire]  # Packet.nbytes is what crosses the wire
    receiver, own = ranks[0], packets[0]
    out = torch.full(xs[0].shape, float("nan"))
    if receiver.aggregation is Aggregation.SUM:
        total = sum(p.payload for p in packets[1:])
        total = packets[0].payload + total if packets[1:] else packets[0].payload
        decoded = per_tensor(receiver).decompress(own.with_payload(total))
        out.copy_(decoded / WORLD)
    else:
        per_tensor(receiver).decompress_mean_into([_over_the_wire(own, w) for w in wire], out)
    return packets, out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,backend", _variants())
def test_every_compressor_handles_empty_and_one_element_tensors(name: str, backend: str, shape: tuple[int, ...]) -> None:
    multiround = isinstance(make_compressor(name), MultiRoundCompressor)
    # a multi-round compressor's rounds need real ranks to interleave: a world of one here
    ranks = _ranks(name, backend, 1 if multiround else WORLD)
    xs = [torch.full(shape, VALUE) for _ in ranks]
    if multiround:
        assert isinstance(ranks[0], MultiRoundCompressor)
        (result,) = ranks[0].exchange(xs, ["w"], lambda t: t)
        nbytes, mean = [result.nbytes], result.mean
        packet = per_tensor(ranks[0]).compress(xs[0], "w2")
        assert torch.equal(per_tensor(ranks[0]).decompress(packet), xs[0])
    else:
        packets, mean = _exchange(ranks, xs, "w")
        nbytes = [p.nbytes for p in packets]
        for p in packets:
            assert p.shape == torch.Size(shape) and p.dtype == torch.float32
            assert all(torch.isfinite(v).all() for v in p.stats.values()), p.stats
    assert mean.shape == torch.Size(shape)
    if xs[0].numel() == 0:
        assert nbytes == [0] * len(nbytes), "an empty tensor sends nothing"
    else:
        assert all(n > 0 for n in nbytes)
        # every registered compressor carries a one-element tensor exactly on its first step
        assert torch.equal(mean, xs[0]), (mean, xs[0])
