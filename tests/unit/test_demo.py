"""DeMo's pieces without a process group: the chunked DCT, the wire format, edge shapes, the momentum, bad input."""

import pytest
import torch

from lightning_gradcomp import registry
from lightning_gradcomp.compressors import DeMo
from lightning_gradcomp.compressors.demo import ChunkedDCT, dct_matrix, largest_divisor
from lightning_gradcomp.exchange.memory import ResidualMemory
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.compressors.per_tensor import per_tensor


@pytest.mark.parametrize("shape", [(128, 64), (130, 70), (97,), (256, 128), (8, 3, 3, 3), (), (1,)])
def test_chunked_dct_round_trips(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t = ChunkedDCT(torch.Size(shape), 64, torch.float32, torch.device("cpu"))
    coeffs = t.encode(x)
    assert coeffs.shape == (t.chunks, t.chunk_numel) and t.chunks * t.chunk_numel == x.numel()
    torch.testing.assert_close(t.decode(coeffs, x.shape), x, rtol=1e-5, atol=1e-5)
    # orthonormal: energy preserved
    torch.testing.assert_close(coeffs.pow(2).sum(), x.pow(2).sum(), rtol=1e-5, atol=1e-5)


def test_dct_matrix_is_orthonormal_dct_ii() -> None:
    from scipy.fft import dct

    d = dct_matrix(8)
    torch.testing.assert_close(d @ d.T, torch.eye(8, dtype=torch.float64))
    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(d @ x, torch.from_numpy(dct(x.numpy(), norm="ortho")))
    assert largest_divisor(130, 64) == 26 and largest_divisor(127, 64) == 1 and largest_divisor(4096, 64) == 64


@pytest.mark.parametrize(("shape", "index_dtype", "expected"), [
    ((128, 64), "int16", 2 * 32 * 6),  # two 64x64 chunks, 32 coefficients each, fp32 value + int16 index
    ((128, 64), "int64", 2 * 32 * 12),  # the reference's int64 indices
    ((100,), "int16", 2 * 32 * 6),  # 100 -> chunks of 50, 32 kept of 50
    ((7,), "int16", 7 * 6),  # prime: 7 chunks of 1 element, 1 kept each (clamped, as the reference)
    ((1,), "int16", 6),
    ((0,), "int16", 0),
    ((3, 0), "int16", 0),
])
def test_exact_bytes(shape: tuple[int, ...], index_dtype: str, expected: int) -> None:
    demo = DeMo(index_dtype=index_dtype)  # type: ignore[arg-type]
    x = torch.randn(shape)
    packet = per_tensor(demo).compress(x, "w")
    assert packet.nbytes == expected == demo.packet_bytes(torch.Size(shape))
    decoded = per_tensor(demo).decompress(packet)
    assert decoded.shape == x.shape


def test_uint8_indices_carry_the_same_coefficients_in_five_bytes_each() -> None:
    """Chunks of at most 16 x 16: the in-chunk index fits a byte; the mean of three ranks' packets decodes to the
    same tensor as with int16 indices, in 5 bytes per coefficient instead of 6."""
    xs = [torch.randn(64, 48) for _ in range(3)]  # 4 x 3 chunks of 16 x 16, top-5 of each
    decoded, sizes = {}, {}
    for index_dtype in ("int16", "uint8"):
        demo = DeMo(topk=5, chunk=16, index_dtype=index_dtype)
        packets = [per_tensor(demo).compress(x, "w") for x in xs]
        decoded[index_dtype] = per_tensor(demo).decompress_mean_into(packets, torch.empty(64, 48))
        sizes[index_dtype] = packets[0].nbytes
        assert sizes[index_dtype] == demo.packet_bytes(torch.Size((64, 48)))
    assert sizes == {"int16": 12 * 5 * 6, "uint8": 12 * 5 * 5}
    assert torch.equal(decoded["int16"], decoded["uint8"])


def test_top_k_of_a_sparse_spectrum_is_lossless() -> None:
    t = ChunkedDCT(torch.Size((64, 64)), 64, torch.float32, torch.device("cpu"))
    coeffs = torch.zeros(1, 4096)
    coeffs[0, torch.randperm(4096)[:32]] = torch.randn(32)
    x = t.decode(coeffs, torch.Size((64, 64)))
    demo = DeMo()
    torch.testing.assert_close(per_tensor(demo).decompress(per_tensor(demo).compress(x, "w")), x, rtol=1e-5, atol=1e-6)
    # with one more coefficient than kept, the smallest is dropped
    coeffs[0, 0] = 1e-3 if coeffs[0, 0] == 0 else coeffs[0, 0]
    partial = per_tensor(demo).decompress(per_tensor(demo).compress(t.decode(coeffs, torch.Size((64, 64))), "w"))
    assert torch.count_nonzero(t.encode(partial).abs() > 1e-5) == 32


def test_mean_of_packets_is_decoded_in_the_coefficient_domain() -> None:
    demo = DeMo(topk=4)
    xs = [torch.randn(32, 48) for _ in range(3)]
    packets = [per_tensor(demo).compress(x, "w") for x in xs]
    expected = sum(per_tensor(demo).decompress(p) for p in packets) / 3
    out = torch.empty(32, 48)
    torch.testing.assert_close(per_tensor(demo).decompress_mean_into(packets, out), expected, rtol=1e-5, atol=1e-6)


def test_selectors_average_each_coefficient_over_the_ranks_that_sent_it() -> None:
    """``average="selectors"``: the reference's ``scatter_reduce(reduce="mean", include_self=False)`` per chunk,
    written out independently here (dense coefficient sums over counts of senders), then inverse-transformed."""
    demo, plain = DeMo(topk=3, chunk=8, average="selectors"), DeMo(topk=3, chunk=8)
    t = ChunkedDCT(torch.Size((16, 24)), 8, torch.float32, torch.device("cpu"))
    xs = [torch.randn(16, 24, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    total, count = torch.zeros(t.chunks, 64), torch.zeros(t.chunks, 64)
    for x in xs:
        coeffs = t.encode(x)
        keep = coeffs.abs().topk(3, dim=1).indices
        total.scatter_add_(1, keep, coeffs.gather(1, keep))
        count.scatter_add_(1, keep, torch.ones(keep.shape))
    assert int(count.max()) > 1 and int((count == 1).sum()) > 0  # the ranks' selections overlap only in part
    expected = t.decode(total / count.clamp(min=1), torch.Size((16, 24)))
    packets = [per_tensor(demo).compress(x, "w") for x in xs]
    torch.testing.assert_close(per_tensor(demo).decompress_mean_into(packets, torch.empty(16, 24)),
                               expected, rtol=1e-5, atol=1e-6)
    # the flat path (the hook's) gives the same bits as the per-layer one
    flat = [demo.compress_flat(x.reshape(-1), Segments(("w",), (torch.Size((16, 24)),))) for x in xs]
    assert torch.equal(demo.decompress_flat_mean_into(flat, torch.empty(16 * 24)).view(16, 24),
                       per_tensor(demo).decompress_mean_into(packets, torch.empty(16, 24)))
    # where selections differ it is not the plain mean; the bytes and what a rank sent (its residual) are the same
    assert not torch.allclose(per_tensor(plain).decompress_mean_into(packets, torch.empty(16, 24)), expected)
    assert all(torch.equal(per_tensor(demo).sent(x, p), per_tensor(plain).sent(x, p)) for x, p in zip(xs, packets))
    assert demo.packet_bytes(torch.Size((16, 24))) == plain.packet_bytes(torch.Size((16, 24)))


def test_hook_residual_is_the_decayed_momentum() -> None:
    """Through the hook's error feedback (``x = g + residual``, ``residual = x - sent``): DeMo's recursion."""
    demo, memory = DeMo(topk=2, beta=0.9), ResidualMemory()
    m = torch.zeros(16, 16)
    for step in range(3):
        g = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
        x = memory.compensate(g, "w")
        m = 0.9 * m + g if step else g
        torch.testing.assert_close(x, m, rtol=1e-5, atol=1e-6)
        packet = per_tensor(demo).compress(x, "w")
        memory.update("w", x, per_tensor(demo).sent(x, packet))
        m = m - per_tensor(demo).decompress(packet)
    assert 0.0 < float(per_tensor(demo).compress(x, "w").stats["energy_kept"]) < 1.0


@pytest.mark.parametrize(("kwargs", "arg"), [
    ({"topk": 0}, "topk"), ({"chunk": 0}, "chunk"), ({"chunk": 256}, "chunk"), ({"beta": 1.0}, "beta"),
    ({"beta": -0.1}, "beta"), ({"index_dtype": "int8"}, "index_dtype"), ({"average": "mean"}, "average"),
    ({"chunk": 32, "index_dtype": "uint8"}, "chunk"),
])
def test_bad_input_names_argument_value_and_fix(kwargs: dict, arg: str) -> None:
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=rf"`{arg}`.*but got {value!r}.*Fix: "):
        DeMo(**kwargs)


def test_registered_as_a_strategy_name() -> None:
    assert "demo" in registry.compressor_names()
    demo = registry.make_compressor("demo")
    assert isinstance(demo, DeMo) and (demo.topk, demo.chunk, demo.beta) == (32, 64, 0.999)
