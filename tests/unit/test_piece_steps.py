"""The pieces of the compressed reduce-scatter across nodes without a process group: blockwise int8 through the
group step (error feedback's invariant, exact bytes), several groups in one statistics max, and
``Transport.sum_to_owners`` on the emulated workers."""

import threading

import pytest
import torch

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.blockint8 import INT4_MAX, INT8_MAX, BlockInt8
from lightning_gradcomp.compressors.terngrad import TernGrad
from lightning_gradcomp.exchange.groups import LayerGroup
from lightning_gradcomp.exchange.hook import GroupState, group_steps
from lightning_gradcomp.exchange.transport import LoopbackTransport, Workers
from lightning_gradcomp.flat import Segments


def _pieces(compressor: Compressor, nodes: int, piece: int) -> list[LayerGroup]:
    return [LayerGroup(compressor, Segments([f"u/node{m}"], [torch.Size([piece])]), (m,), 0, (m * piece,))
            for m in range(nodes)]


@pytest.mark.parametrize("piece", [1, 100, 256, 600])
def test_block_int8_keeps_what_it_did_not_send_and_counts_its_bytes(piece: int) -> None:
    """Per piece: one code per element and a 4-byte scale per started block of 256; each element within half a step
    (scale / 127 / 2) of what it encodes; sent + new residual == gradient + old residual, at every step."""
    nodes = 2
    compressor = BlockInt8(256)
    state = GroupState(LoopbackTransport(nodes))
    groups = _pieces(compressor, nodes, piece)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        flat = torch.randn(nodes * piece, generator=gen)
        before = {g.segments.names[0]: state.memory.residuals.get(g.segments.names[0]) for g in groups}
        packets = group_steps(state, groups, flat)
        for group, packet in zip(groups, packets):
            name = group.segments.names[0]
            assert packet.payload.numel() == piece + 4 * -(-piece // 256)
            old = before[name]
            x = group.take(flat) if old is None else group.take(flat) + old
            sent = compressor.decompress_flat(packet)
            blocks = torch.nn.functional.pad(x, (0, -piece % 256)).view(-1, 256).abs().amax(1)
            half_step = (blocks / INT8_MAX / 2).repeat_interleave(256)[:piece]
            assert ((sent - x).abs() <= half_step * (1 + 1e-6)).all()
            assert torch.allclose(sent + state.memory.residuals[name], x, atol=1e-6)
    assert state.ledger.last_step_bytes() == nodes * (piece + 4 * -(-piece // 256))


@pytest.mark.parametrize("piece", [1, 7, 100, 256, 601])
def test_block_int4_packs_two_codes_a_byte_and_keeps_what_it_did_not_send(piece: int) -> None:
    """int4 (qgZ's format): ceil(piece / 2) bytes of codes and a 4-byte scale per started block of 64; every code
    within the symmetric levels -7 .. 7 and each element within half a step (scale / 7 / 2) of what it encodes; the
    residual is exactly the input (gradient + old residual) minus the decoded packet, at every step."""
    nodes, block = 2, 64
    compressor = BlockInt8(block, bits=4)
    state = GroupState(LoopbackTransport(nodes))
    groups = _pieces(compressor, nodes, piece)
    gen = torch.Generator().manual_seed(1)
    nbytes = -(-piece // 2) + 4 * -(-piece // block)
    for _ in range(3):
        flat = torch.randn(nodes * piece, generator=gen)
        before = {g.segments.names[0]: state.memory.residuals.get(g.segments.names[0]) for g in groups}
        packets = group_steps(state, groups, flat)
        for group, packet in zip(groups, packets):
            name = group.segments.names[0]
            assert packet.payload.dtype == torch.uint8 and packet.payload.numel() == nbytes
            assert packet.layer_nbytes == (nbytes,)
            old = before[name]
            x = group.take(flat) if old is None else group.take(flat) + old
            sent = compressor.decompress_flat(packet)
            scales = torch.nn.functional.pad(x, (0, -piece % block)).view(-1, block).abs().amax(1)
            step = (scales / INT4_MAX).repeat_interleave(block)[:piece]
            assert ((sent / step).round().abs() <= INT4_MAX).all()
            assert ((sent - x).abs() <= step / 2 * (1 + 1e-5)).all()
            assert torch.equal(state.memory.residuals[name], x - sent)
    assert state.ledger.last_step_bytes() == nodes * nbytes


def test_block_int4_is_coarser_than_int8_and_refuses_other_widths() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    segments = Segments(["w"], [torch.Size([1000])])
    errors = {}
    for bits in (8, 4):
        compressor = BlockInt8(256, bits=bits)
        errors[bits] = (compressor.decompress_flat(compressor.compress_flat(x, segments)) - x).abs().max()
        assert compressor.describe()["bits"] == bits
    assert 0 < errors[8] < errors[4] < x.abs().max() / INT4_MAX
    for bits in (2, 16, True):
        with pytest.raises(ValueError, match=r"Expected `bits` to be 8 or 4 .* but got .*Fix: pass `bits=8`"):
            BlockInt8(bits=bits)


def test_several_groups_share_one_statistics_max() -> None:
    """TernGrad's scalers of every piece travel in one max (one record of their bytes), as a bucket's groups do."""
    compressor = TernGrad()
    compressor.setup(0, 2, torch.device("cpu"))
    state = GroupState(LoopbackTransport(2))
    packets = group_steps(state, _pieces(compressor, 2, 64), torch.randn(128), key=7)
    assert len(packets) == 2
    assert list(state.ledger.shared_stat_bytes) == [7]
    assert state.ledger.shared_stat_bytes[7] > 0


def test_workers_sum_to_owners_gives_each_its_summed_segment() -> None:
    workers = Workers(3)
    inputs = [torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(3)]
    outs: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        out = torch.empty(2)
        workers.transport(rank).sum_to_owners(out, inputs[rank].clone())
        outs[rank] = out

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = inputs[0] + inputs[1] + inputs[2]
    for rank in range(3):
        assert torch.equal(outs[rank], total[2 * rank : 2 * rank + 2])
    loop = torch.empty(2)
    LoopbackTransport(3, rank=1).sum_to_owners(loop, inputs[0])
    assert torch.equal(loop, inputs[0][2:4])
