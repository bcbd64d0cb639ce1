"""WeightGrad pieces in one process: site layouts, argument checks, quantizers, encoding, G_thresh, feedback."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gradcomp.weightgrad import (
    GradientSynchronizer,
    SignificanceFilter,
    WanMessage,
    WeightGradStrategy,
    decode,
    encode,
)
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.loss_aware import LossAwareTernary
from lightning_gradcomp.flat import Segments
from lightning_gradcomp.sites.layout import new_site_groups, site_layout
from lightning_gradcomp.wire.ternary import pack_ternary
from lightning_gradcomp.weightgrad.synchronizer import SiteView, WanQuantization
from lightning_gradcomp.compressors.per_tensor import per_tensor
from tests.harness import free_port


# -- sites ----------------------------------------------------------------------------------------------
def test_site_layouts() -> None:
    assert site_layout(8, num_nodes=2).sizes == (4, 4)
    assert site_layout(6, site_size=3).sizes == (3, 3)
    layout = site_layout(5, site_sizes=[2, 3])
    assert layout.leaders == (0, 2) and layout.ranks(1) == [2, 3, 4] and layout.site_of(4) == 1
    assert site_layout(3, site_sizes=[1, 2], allow_single_rank_sites=True).sizes == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 4, "site_size": 3}, "`site_size` to divide the world size 4"),
        ({"world_size": 4, "site_sizes": [2, 3]}, "`site_sizes` to add up to the world size 4"),
        ({"world_size": 4, "site_sizes": [1, 3]}, "at least 2 ranks"),
        ({"world_size": 4, "site_size": 1}, "allow_single_rank_sites=True"),
        ({"world_size": 4, "site_size": 2, "site_sizes": [2, 2]}, "one of `site_size` and `site_sizes`"),
        ({"world_size": 4, "site_sizes": [2, 0, 2]}, r"site_sizes\[1\]"),
        ({"world_size": 6, "num_nodes": 4}, "multiple of the number of nodes"),
    ],
)
def test_bad_site_layouts_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        site_layout(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"staleness_bound": 0}, "`staleness_bound` to be an integer >= 1"),
        ({"staleness_seconds": 0.0}, "`staleness_seconds`"),
        ({"threshold": -1.0}, "`threshold`"),
        ({"significance": "row"}, "`significance`"),
        ({"aggregation": "sum"}, "`aggregation`"),
        ({"wan_quantization": "int8"}, "`wan_quantization`"),
        ({"site_view": "local"}, "`site_view`"),
        ({"site_size": 0}, "`site_size`"),
        ({"threshold_momentum": 1.0}, "`threshold_momentum`"),
    ],
)
def test_bad_strategy_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WeightGradStrategy(**kwargs)


def test_strategy_layout_is_checked_against_the_world_before_training() -> None:
    with pytest.raises(ValueError, match="divide the world size 4"):
        WeightGradStrategy(site_size=3).make_layout(4)
    assert WeightGradStrategy(site_size=2).make_layout(4).sizes == (2, 2)


def test_registered_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_gradcomp  # noqa: F401

    assert StrategyRegistry["weightgrad"]["strategy"] is WeightGradStrategy


# -- quantizers and wire format ------------------------------------------------------------------------
def _weighted_error(x: torch.Tensor, d: torch.Tensor, alpha: torch.Tensor, b: torch.Tensor) -> float:
    return float((d * (x - alpha * b.float()) ** 2).sum())


def test_loss_aware_ternary_fits_the_metric() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2000, generator=gen)
    b, alpha = LossAwareTernary().ternarize(x, "w")
    assert set(b.unique().tolist()) <= {-1, 0, 1} and float(alpha) > 0
    kept = b != 0
    assert torch.allclose(alpha, x.abs()[kept].mean())  # D = 1: alpha is the mean magnitude of what it keeps
    assert torch.equal(b[kept].float(), torch.sign(x[kept]))
    # a metric that weighs the large elements heavily: its own solution beats the unweighted one under it
    d = torch.where(x.abs() > 1.5, torch.full_like(x, 50.0), torch.ones_like(x))
    weighted = LossAwareTernary(second_moment=lambda name: d**2 if name == "w" else None)  # D = sqrt(v) + eps
    b_d, alpha_d = weighted.ternarize(x, "w")
    assert _weighted_error(x, d, alpha_d, b_d) < _weighted_error(x, d, alpha, b)
    assert torch.equal(weighted.ternarize(x, "other")[0], b)  # a layer without a second moment: D = 1
    zero_b, zero_alpha = LossAwareTernary().ternarize(torch.zeros(7))
    assert float(zero_alpha) == 0 and not zero_b.any()
    # as a compressor: the packet (2-bit b, fp32 alpha) decodes to exactly alpha * b, deterministically
    packet = per_tensor(weighted).compress(x.view(40, 50), "w")
    assert packet.nbytes == 2000 // 4 + 4
    assert torch.equal(per_tensor(weighted).decompress(packet), (alpha_d * b_d.float()).view(40, 50))
    assert torch.equal(per_tensor(weighted).compress(x.view(40, 50), "w").payload, packet.payload)


def test_terngrad_wan_quantizer_is_unbiased_and_agrees_within_a_site() -> None:
    """``wan_quantization="terngrad"`` is TernGrad (scale max|x|) set up with the site as its rank: a site's ranks
    draw the same ternary values, other sites other ones, and the values are unbiased."""
    x = torch.tensor([0.5, -0.25, 0.0, 1.0, -1.0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        sync = _synchronizer("terngrad", "global", nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()
    quantizer = sync.quantizer
    assert isinstance(quantizer, TernGrad) and quantizer.clip_factor == 0.0 and quantizer.rank == 0  # site 0
    site0, replica, site1 = (copy.deepcopy(quantizer) for _ in range(3))
    site1.setup(1, 2, torch.device("cpu"))  # what a rank of site 1 sets up
    replica.setup(0, 2, torch.device("cpu"))
    site0.setup(0, 2, torch.device("cpu"))
    first = [q.ternarize(x.repeat(20), name="w") for q in (site0, replica, site1)]
    assert torch.equal(first[0][0], first[1][0]) and not torch.equal(first[0][0], first[2][0])
    assert all(float(scale) == 1.0 for _, scale in first)  # max|x|: no clipping
    draws = torch.stack([s * b.float() for b, s in (site0.ternarize(x, name="w") for _ in range(4000))])
    torch.testing.assert_close(draws.mean(0), x, atol=0.04, rtol=0)
    # the streams are training state: a resumed round draws what the uninterrupted one drew
    quantizer.ternarize(x, name="w")
    saved = copy.deepcopy(sync.exchange_state())
    drawn = quantizer.ternarize(x.repeat(20), name="w")[0]
    sync.load_exchange_state(saved)
    assert torch.equal(quantizer.ternarize(x.repeat(20), name="w")[0], drawn)
    with pytest.raises(ValueError, match="resume_compression='reset'"):  # an older release's single stream
        sync.load_exchange_state({"significance": saved["significance"], "generator": torch.get_rng_state()})


def test_encoding_round_trip_and_exact_sizes() -> None:
    dense_b = torch.tensor([1, -1, 0, 1, 0, 0, -1, 1], dtype=torch.int8).repeat(100)  # 800 values, many non-zero
    sparse_b = torch.zeros(800, dtype=torch.int8)
    sparse_b[[5, 700]] = torch.tensor([1, -1], dtype=torch.int8)
    fp = torch.zeros(50)
    fp[3] = 2.5
    layers = [(torch.tensor(0.5), dense_b), (torch.tensor(2.0), sparse_b), (None, fp), (torch.tensor(1.0), torch.zeros(9, dtype=torch.int8))]
    message = encode(layers)
    header = 4 * 2 * 4
    assert message.numel() == header + (4 + 200) + (4 + 2 * 4) + 8
    out = decode(message, [800, 800, 50, 9])
    assert torch.equal(out[0], 0.5 * dense_b.float())
    assert torch.equal(out[1], 2.0 * sparse_b.float())
    assert torch.equal(out[2], fp) and not out[3].any()


class _SignTernary:
    """A deterministic ternarizer with known output: ``b = sign(x)``, scale ``max|x|``."""

    def ternarize(self, tensor: torch.Tensor, *, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = tensor.reshape(-1)
        return torch.sign(x).to(torch.int8), x.abs().max() if x.numel() else x.new_zeros(())

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _raw(values: list, dtype: torch.dtype) -> bytes:
    return torch.tensor(values, dtype=dtype).numpy().tobytes()


def test_wan_message_is_the_encoding_of_a_group() -> None:
    """:class:`WanMessage` on a group of layers (empty, all-zero, one element, dense and sparse ternary, sparse and
    dense fp32 layers) makes exactly the encoding's bytes, attributes them to the layers, and decodes to scale * b."""
    dense = torch.tensor([0.5, -1.0, 0.0, 0.25, -0.5, 1.0, 0.0, 2.0])  # 6 of 8 non-zero: dense ternary
    sparse = torch.zeros(64)
    sparse[[3, 40]] = torch.tensor([-0.5, 1.5])  # 2 of 64: sparse ternary
    sparse_fp = torch.zeros(6)
    sparse_fp[4] = -3.25  # an fp32 layer, 1 of 6: sparse fp32
    dense_fp = torch.tensor([1.0, -2.0, 0.5])  # an fp32 layer, all non-zero: dense fp32
    layers = {"a.empty": torch.zeros(0), "b.zero": torch.zeros(5), "c.one": torch.tensor([0.75]), "d.dense": dense,
              "e.sparse": sparse, "f.sparse_fp": sparse_fp, "g.dense_fp": dense_fp.view(3, 1)}
    segments = Segments(list(layers), [t.shape for t in layers.values()])
    flat = torch.cat([t.reshape(-1) for t in layers.values()])
    ternary = _SignTernary()
    wan = WanMessage(ternary, float_names=frozenset({"f.sparse_fp", "g.dense_fp"}))
    wan.setup(1, 2, torch.device("cpu"))
    assert ternary.rank == 1  # the quantizer is set up with the message's rank (the site)
    packet = wan.compress_flat(flat, segments)

    header = _raw([0, 0, 0, 0, 1, 1, 1, 8, 2, 2, 4, 1, 3, 3], torch.int32)
    bodies = [
        _raw([0.75], torch.float32) + pack_ternary(torch.ones(1, dtype=torch.int8)).numpy().tobytes(),
        _raw([2.0], torch.float32) + pack_ternary(torch.sign(dense).to(torch.int8)).numpy().tobytes(),
        _raw([1.5], torch.float32) + _raw([2 * 3 + 1, 2 * 40], torch.int32),
        _raw([4], torch.int32) + _raw([-3.25], torch.float32),
        _raw([1.0, -2.0, 0.5], torch.float32),
    ]
    assert packet.payload.numpy().tobytes() == header + b"".join(bodies)
    assert packet.layer_nbytes == (8, 8, 8 + 5, 8 + 6, 8 + 12, 8 + 8, 8 + 12) and packet.self_describing
    assert sum(packet.layer_nbytes) == packet.nbytes

    expected = torch.cat([torch.zeros(5), torch.tensor([0.75]), 2.0 * torch.sign(dense), 1.5 * torch.sign(sparse),
                          sparse_fp, dense_fp])
    assert torch.equal(wan.decompress_flat(packet), expected)
    assert torch.equal(wan.sent_flat(flat, packet), expected)  # what the engine keeps the rest of
    # the sites' mean: decoded, summed in site order, divided (the exchange's decode)
    other = wan.compress_flat(flat * 2, segments)
    mean = wan.decompress_flat_mean_into([packet, other], torch.empty(segments.total))
    assert torch.equal(mean, (expected + wan.decompress_flat(other)) / 2)
    # a single tensor is a group of one; without a quantizer every layer travels as fp32 values
    one = per_tensor(wan).compress(dense.view(2, 4), "d.dense")
    assert one.payload.numpy().tobytes() == _raw([1, 8], torch.int32) + bodies[1]
    assert torch.equal(per_tensor(wan).decompress(one), (2.0 * torch.sign(dense)).view(2, 4))
    unquantized = WanMessage()
    assert torch.equal(unquantized.decompress_flat(unquantized.compress_flat(flat, segments)), flat)


# -- G_thresh ------------------------------------------------------------------------------------------
def test_dynamic_threshold_starts_at_norm_ratio_and_follows_eq13() -> None:
    g = torch.tensor([3.0, -4.0, 0.0, 1.0])
    f = SignificanceFilter(momentum=0.9)
    f.observe("w", g, lr=0.1)
    start = g.norm() / g.abs().max()
    torch.testing.assert_close(f.threshold_of("w"), start)
    f.observe("w", g, lr=0.05)  # same gradient (bias-corrected velocity unchanged), LR halved
    torch.testing.assert_close(f.threshold_of("w"), start / 2)
    f.observe("w", g / 4, lr=0.05)  # gradients shrink: the velocity norm falls and so does G
    assert float(f.threshold_of("w")) < float(start / 2)


def test_capped_threshold_never_rises_above_its_start() -> None:
    g = torch.tensor([3.0, -4.0, 0.0, 1.0])
    capped, literal = SignificanceFilter(), SignificanceFilter(rule="eq13")
    for f in (capped, literal):
        f.observe("w", g, lr=0.1)
        f.observe("w", 10 * g, lr=0.1)  # the gradient norm rises
    start = g.norm() / g.abs().max()
    torch.testing.assert_close(capped.threshold_of("w"), start)
    assert float(literal.threshold_of("w")) > 2 * float(start)


def test_significance_masks() -> None:
    pending = torch.tensor([0.5, -2.0, 0.1])
    step = torch.tensor([0.1, -0.5, 0.0])
    assert SignificanceFilter(threshold=0.0).mask("w", pending, step).all()
    element = SignificanceFilter(threshold=3.0, scope="element")
    assert element.mask("w", pending, step).tolist() == [False, True, False]  # |g_u| >= 3 * 0.5
    layer = SignificanceFilter(threshold=3.0)  # ||g_u||_2 = 2.06... >= 3 * 0.5
    assert layer.mask("w", pending, step).all()
    assert not layer.mask("w", pending / 2, step).any()
    relative = SignificanceFilter(threshold=0.1, scope="relative")  # Gaia: |g_u| >= 10% of |w|
    weight = torch.tensor([1.0, 100.0, 0.5])
    assert relative.mask("w", pending, step, weight).tolist() == [True, False, True]


# -- error feedback across a WAN round (one rank, one site) -------------------------------------------------
def _synchronizer(quantization: WanQuantization, view: SiteView, layer: nn.Module) -> GradientSynchronizer:
    """One site of one rank (needs a process group)."""
    return GradientSynchronizer(
        dict(layer.named_parameters()), [], new_site_groups(site_layout(1), 0), SignificanceFilter(threshold=1.5),
        staleness_bound=2, staleness_seconds=None, trigger="bound", flush_at_bound=False, wan_quantization=quantization,
        site_view=view, second_moment=lambda n: None, learning_rate=lambda n: 0.1,
    )


@pytest.mark.parametrize(
    ("quantization", "view"), [("loss_aware", "global"), ("terngrad", "global"), ("none", "global"), ("loss_aware", "gaia")]
)
def test_round_keeps_what_it_did_not_send(quantization: WanQuantization, view: SiteView) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        layer = nn.Linear(6, 4)
        params = dict(layer.named_parameters())
        sync = _synchronizer(quantization, view, layer)
        start = {n: p.detach().clone() for n, p in params.items()}
        for step in range(2):
            with torch.no_grad():
                for p in params.values():
                    p.add_(torch.randn_like(p) * 0.1)
                    p.grad = torch.randn_like(p)
            before = {n: sync.pending(n).clone() for n in params}
            ran = sync.after_local_step()
            assert ran == (step == 1)
        for n, p in params.items():
            if view == "global":
                # what the site accumulated == what reached the global weights + what it still holds
                torch.testing.assert_close(sync.anchor[n] + sync.hidden[n], start[n] + before[n])
                assert torch.equal(p.detach(), sync.anchor[n])  # the weights are the global weights
            else:
                # Gaia's view: a lone site keeps all of its own progress in its weights
                torch.testing.assert_close(p.detach(), start[n] + before[n])
                torch.testing.assert_close(sync.pending(n), before[n] - (sync.anchor[n] - start[n]))
        assert int(sync.stats["wan_rounds"]) == 1 and int(sync.stats["staleness"]) == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"staleness_seconds": 1e-9}, [True, True, True]),  # the clock forces a round every step
        ({"trigger": "significance"}, [True, True, True]),  # threshold 0: always significant
        ({}, [False, False, True]),  # only the bound T = 3
    ],
)
def test_round_triggers(options: dict, expected: list[bool]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        layer = nn.Linear(3, 2)
        params = dict(layer.named_parameters())
        kwargs = dict(staleness_seconds=None, trigger="bound") | options
        sync = GradientSynchronizer(
            params, [], new_site_groups(site_layout(1), 0), SignificanceFilter(threshold=0.0), staleness_bound=3,
            flush_at_bound=False, wan_quantization="none", site_view="global", second_moment=lambda n: None,
            learning_rate=lambda n: 0.1, **kwargs,
        )
        ran = []
        for _ in range(3):
            with torch.no_grad():
                for p in params.values():
                    p.add_(0.1)
                    p.grad = torch.ones_like(p)
            ran.append(sync.after_local_step())
        assert ran == expected
    finally:
        dist.destroy_process_group()


def test_the_quantizers_old_function_spellings_warn_and_agree_with_the_compressors() -> None:
    """``weightgrad.loss_aware_ternary``/``stochastic_ternary`` still resolve, with a DeprecationWarning, to the
    compressors' ternarization: LAT's bits exactly, TernGrad's scale ``max|x|`` and values in {-1, 0, 1}."""
    import lightning_gradcomp.weightgrad as weightgrad
    from lightning_gradcomp.compressors import LossAwareTernary

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    with pytest.warns(DeprecationWarning, match="LossAwareTernary"):
        alpha, b = weightgrad.loss_aware_ternary(x)
    b_new, alpha_new = LossAwareTernary().ternarize(x)
    assert torch.equal(alpha, alpha_new) and torch.equal(b, b_new.view(x.shape))
    with pytest.warns(DeprecationWarning, match="TernGrad"):
        scale, b = weightgrad.stochastic_ternary(x, torch.Generator().manual_seed(1))
    assert torch.equal(scale, x.abs().max()) and b.shape == x.shape and set(b.unique().tolist()) <= {-1, 0, 1}


def test_the_stochastic_ternary_alias_draws_afresh_from_its_generator_and_is_unbiased() -> None:
    """``weightgrad.stochastic_ternary(x, generator)`` keeps its old meaning: each call a new draw from the generator
    it is given (which moves on), the same seed the same draws, and ``scale * b`` unbiased (its mean over calls
    tends to ``x``); the name still warns."""
    import lightning_gradcomp.weightgrad as weightgrad

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(DeprecationWarning, match="stochastic_ternary"):
        stochastic_ternary = weightgrad.stochastic_ternary
    generator = torch.Generator().manual_seed(3)
    draws = [stochastic_ternary(x, generator) for _ in range(3)]
    assert not torch.equal(draws[0][1], draws[1][1]) and not torch.equal(draws[1][1], draws[2][1])
    again = torch.Generator().manual_seed(3)
    assert all(torch.equal(b, stochastic_ternary(x, again)[1]) for _, b in draws)

    n = 4000
    total = torch.zeros_like(x, dtype=torch.float64)  # float32 sums of 4000 terms would round by more than 1e-6
    for _ in range(n):
        scale, b = stochastic_ternary(x, generator)
        total += scale.double() * b
    # scale * b takes the values 0 and scale * sign(x): its variance is scale * |x| - x^2; 5 standard errors
    scale = x.abs().max()
    tolerance = 5 * ((scale * x.abs() - x * x).clamp_min(0) / n).sqrt() + 1e-6
    assert ((total / n - x.double()).abs() <= tolerance).all()
