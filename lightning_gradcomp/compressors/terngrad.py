"""TernGrad (Wen et al., NIPS 2017): stochastic ternary gradients with layer-wise, shared scalers.

Per tensor (or per chunk of ``bucket_size`` elements), worker i:

1. optional clipping at c*sigma (Eq. 21): ``clip_mode="paper"`` clips each worker at its own c*sigma_i and
   uses the max-norm of the clipped tensor as its scaler; ``clip_mode="code"`` is what the original
   TensorFlow code does: the scaler is c*sigma_i itself and clipping is implicit at the shared scaler
   (elements with |g| >= s always become +-s). sigma is the population standard deviation (mean-subtracted).
   Deviation: a constant chunk (sigma = 0, e.g. a one-element tensor) is not clipped; the original code
   would send it as zeros forever.
2. scaler sharing (Eq. 4): s = max_i s_i, agreed through a max all-reduce before ternarizing
   (``scaler_share="max"``), or each worker keeps its own scaler and sends it (``"per_worker"``).
3. ternarize (Eq. 1-3): t = sign(g) * b, b ~ Bernoulli(|g| / s), so E[s * t] = g (for |g| <= s).

On the wire (exact): ``2bit`` packing is ceil(n/4) bytes, ``base3`` ceil(n/5) bytes, plus 4 bytes per
scaler when scalers are per worker. With a shared scaler the per-rank ternaries sum to integers in [-N, N],
so an int8 all-reduce of the ternary values (n bytes, summable) is an alternative to an all-gather of packed
payloads; ``collective`` picks one, ``"auto"`` by the ring traffic of each (see :meth:`TernGrad.travels`),
and a planner may pick either per bucket (:meth:`TernGrad.collectives`).

The code is written once, for a group of layers in one flat tensor (:mod:`~lightning_gradcomp.compressors.terngrad_group`);
the per-tensor calls (``per_tensor(compressor).compress(tensor, name)``, ``decompress(packet)``, ...) run it on a group of one.
"""

import copy
from collections.abc import Sequence
from typing import Any, Literal, Optional, cast

import torch
from torch import Tensor

from lightning_gradcomp.compressors.backends import BACKENDS, Backend, KernelBacked
from lightning_gradcomp.compressors.base import Aggregation, CollectiveChoice, CollectiveVariant, SharedStatistic
from lightning_gradcomp.compressors.per_tensor import layer_segments
from lightning_gradcomp.flat import FlatPacket, Segments
from lightning_gradcomp.compressors.streams import CounterStreams, check_counters
from lightning_gradcomp.compressors.terngrad_group import FlatTernGrad, TernGradKernels
from lightning_gradcomp.compressors.terngrad_kernels import TERNGRAD_KERNELS
from lightning_gradcomp.validation import check_choice, check_int, check_number
from lightning_gradcomp.wire.ternary import PACKINGS, Packing, packed_nbytes

ClipMode = Literal["paper", "code"]
ScalerShare = Literal["max", "per_worker"]
Collective = Literal["auto", "allgather", "allreduce_int8"]

# int8 sums of N ternaries stay in [-N, N]; beyond 127 ranks they would overflow.
_INT8_MAX_RANKS = 127
# relative size of the float32 rounding noise in a standard deviation of a constant tensor
_SIGMA_NOISE = 16 * torch.finfo(torch.float32).eps


class TernGrad(KernelBacked[TernGradKernels], CollectiveChoice):
    """Stochastic ternarization with layer-wise scalers, scaler sharing and sigma clipping.

    Args:
        clip_factor: c in the c*sigma clipping of Eq. 21 (paper: 2.5); 0 disables clipping.
        clip_mode: ``"paper"`` (clip at each worker's own c*sigma, then max-norm scaler) or ``"code"`` (the
            original TensorFlow code: scaler = max over ranks of c*sigma, implicit clipping).
        scaler_share: ``"max"`` shares one scaler per tensor (or chunk) as the max over ranks (Eq. 4);
            ``"per_worker"`` sends each worker's own scaler with its payload.
        bucket_size: elements per scaler within a tensor; ``None`` is one scaler per tensor (the paper).
        packing: ``"2bit"`` (4 values per byte, the original layout) or ``"base3"`` (5 values per byte).
        collective: ``"allgather"`` of packed payloads, ``"allreduce_int8"`` of the ternary values (needs
            ``scaler_share="max"``), or ``"auto"`` to pick by ring traffic for the world size.
        seed: seed of this compressor's random stream (counter-based, :mod:`lightning_gradcomp.kernels.rng`); rank r
            draws from seed and r, so ranks differ and runs repeat.
        backend: ``"torch"`` (torch ops), ``"fused"`` (the compiled CPU kernels, one call per group; torch ops or
            Triton elsewhere) or ``"auto"`` (fused on CPU when the kernels compile here, else torch). Both give the
            same bits.
    """

    def __init__(
        self,
        clip_factor: float = 2.5,
        clip_mode: ClipMode = "paper",
        scaler_share: ScalerShare = "max",
        bucket_size: Optional[int] = None,
        packing: Packing = "2bit",
        collective: Collective = "auto",
        seed: int = 0,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        check_number("clip_factor", clip_factor, minimum=0.0, fix="use 2.5 (the paper) or 0 to disable clipping")
        check_choice("clip_mode", clip_mode, ("paper", "code"))
        check_choice("scaler_share", scaler_share, ("max", "per_worker"))
        if bucket_size is not None:
            check_int("bucket_size", bucket_size, minimum=1, fix="use None for one scaler per tensor")
        check_choice("packing", packing, PACKINGS)
        check_choice("collective", collective, ("auto", "allgather", "allreduce_int8"))
        check_int("seed", seed, minimum=0)
        check_choice("backend", backend, BACKENDS)
        if collective == "allreduce_int8" and scaler_share != "max":
            raise ValueError(
                f"`collective='allreduce_int8'` sums ternary values, which needs one scaler shared by all ranks, "
                f"but got `scaler_share={scaler_share!r}`. Fix: use `scaler_share='max'` or `collective='allgather'`."
            )
        self.clip_factor = float(clip_factor)
        self.clip_mode = clip_mode
        self.scaler_share = scaler_share
        self.bucket_size = bucket_size
        self.packing: Packing = packing
        self.collective = collective
        self.seed = seed
        self.backend = backend
        self._keys = CounterStreams(seed)
        #: the one implementation: a group of layers in one flat tensor per call (a single tensor: a group of one)
        self._flat = FlatTernGrad(self, sigma_noise=_SIGMA_NOISE, streams=self._keys, kernels=self.kernels)
        #: this compressor travelling as each of its variants, made on first use (see `collectives`)
        self._views: dict[str, TernGrad] = {}
        self.aggregation = self.travels(self.world_size)

    # -- setup and state --------------------------------------------------------------------------------
    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        if self.collective == "allreduce_int8" and world_size > _INT8_MAX_RANKS:
            raise ValueError(
                f"`collective='allreduce_int8'` overflows int8 beyond {_INT8_MAX_RANKS} ranks, but the world size is "
                f"{world_size}. Fix: use `collective='allgather'` or `'auto'`."
            )
        super().setup(rank, world_size, device)  # chooses the backend (may load the kernels): after the checks
        self._keys.reset(rank)
        self._flat.forget()
        self._views = {}
        self.aggregation = self.travels(world_size)

    def state_dict(self) -> dict[str, Any]:
        return self._keys.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a checkpoint's "streams": the per-name torch.Generator states of the torch backend's earlier per-layer draws,
        # which no counter can continue: refused unless empty (nothing drawn)
        check_counters(state.get("streams", {}), type(self).__name__)
        self._keys.load_state_dict(state)
        self._flat.forget()

    def describe(self) -> dict[str, Any]:
        return {
            "compressor": "TernGrad",
            "clip_factor": self.clip_factor,
            "clip_mode": self.clip_mode,
            "scaler_share": self.scaler_share,
            "bucket_size": self.bucket_size,
            "packing": self.packing,
            "collective": self.collective,
            "seed": self.seed,
            "backend": self.backend,
        }

    # -- how it travels ---------------------------------------------------------------------------------
    def travels(self, world_size: int) -> Aggregation:
        """How this compressor travels in a group of ``world_size`` ranks (its :attr:`aggregation` once set up for
        them): all-gather of packed payloads, or an int8 all-reduce of ternary values.

        Per rank, a ring all-gather sends (N-1) * n/k bytes (k = 4 or 5 values per byte) and a ring all-reduce
        of int8 values sends 2(N-1)/N * n bytes, so ``"auto"`` all-reduces from N >= 2k ranks (8 with 2-bit,
        10 with base-3 packing) when scalers are shared, and all-gathers below.
        """
        if self.collective == "allreduce_int8":
            return Aggregation.SUM
        if self.collective == "allgather" or self.scaler_share != "max":
            return Aggregation.GATHER
        per_byte = 4 if self.packing == "2bit" else 5
        if 2 * per_byte <= world_size <= _INT8_MAX_RANKS:
            return Aggregation.SUM
        return Aggregation.GATHER

    def collectives(self, world_size: int) -> tuple[CollectiveVariant, ...]:
        """Both ways when ``collective="auto"``: packed payloads all-gathered, and (with a shared scaler, up to 127
        ranks) int8 ternaries all-reduced. An explicit ``collective`` is the user's choice: nothing to choose."""
        if self.collective != "auto":
            return ()
        variants = [CollectiveVariant("allgather", Aggregation.GATHER, self._variant("allgather"))]
        if self.scaler_share == "max" and world_size <= _INT8_MAX_RANKS:
            variants.append(CollectiveVariant("allreduce_int8", Aggregation.SUM, self._variant("allreduce_int8")))
        return tuple(variants)

    def _variant(self, name: str) -> "TernGrad":
        view = self._views.get(name)
        if view is None:
            # a shallow copy: the random streams, counters and chosen backend are the same objects
            view = copy.copy(self)
            view.collective = cast(Collective, name)  # a declared variant's name is a `collective=` value
            view.aggregation = view.travels(self.world_size)
            self._views[name] = view
        return view

    def payload_nbytes(self, numel: int) -> int:
        if self.aggregation is Aggregation.SUM:
            return numel
        extra = 4 * self._num_chunks(numel) if self.scaler_share == "per_worker" else 0
        return packed_nbytes(numel, self.packing) + extra

    # -- the maths: on a group of layers (a single tensor is a group of one) ----------------------------------
    def _num_chunks(self, numel: int) -> int:
        if numel == 0:  # an empty tensor has no chunk: no scaler, nothing on the wire
            return 0
        return 1 if self.bucket_size is None else -(-numel // self.bucket_size)

    def ternarize(self, tensor: Tensor, scaler: Optional[Tensor] = None, name: str = "") -> tuple[Tensor, Tensor]:
        """Ternary values (int8, the tensor's flat length) and the scalers used (float32, one per chunk): the group
        code's ternaries on a group of one, drawn from ``name``'s stream (its counter moves on, as in ``compress``).

        Args:
            tensor: the gradient.
            scaler: scalers shared by all ranks (one per chunk); ``None`` uses this rank's own.
            name: the parameter's name, which selects its random stream.
        """
        x = tensor.detach().reshape(-1)
        if x.numel() == 0:
            return x.new_zeros(0, dtype=torch.int8), x.new_zeros(0, dtype=torch.float32)
        group = layer_segments(self, name, tensor.shape)
        local, clip = self._flat.scale_clip(x, group)
        s = local if scaler is None else scaler.reshape(-1).to(local.device, torch.float32)
        return self._flat.encode(x, group, s, clip), s

    def clipped(self, tensor: Tensor) -> Tensor:
        """``tensor`` after this rank's own c*sigma clipping, as float32 (for monitoring; draws no randomness).

        With ``clip_mode="code"`` the clipping is implicit at the shared scaler; this shows it at this rank's
        own c*sigma.
        """
        x = tensor.detach().reshape(-1).float()
        if self.clip_factor == 0.0 or x.numel() == 0:
            return x.view(tensor.shape)
        group = layer_segments(self, "", tensor.shape)
        scale, clip = self._flat.scale_clip(x, group)
        threshold = self._flat.chunk_layout(group).chunks.expand(scale if clip is None else clip)
        return torch.maximum(torch.minimum(x, threshold), -threshold).view(tensor.shape)

    # -- a group of layers in one flat tensor (the hook's batched pipeline) -----------------------------------
    #: the kernel sets that run the groups (:mod:`~lightning_gradcomp.compressors.terngrad_kernels`)
    providers = TERNGRAD_KERNELS

    #: a fixed number of ops per group on every device and backend (torch ops, Triton, or one call of the compiled
    #: kernels per group)
    batched = True

    def _provider_input(self) -> FlatTernGrad:
        return self._flat

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        return self._flat.statistic(flat, segments)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        return self._flat.compress(flat, segments, shared, self.aggregation)

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        return self._flat.decompress(packet)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        return self._flat.decompress_mean_into(packets, out)

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        return self._flat.decompress(packet)
