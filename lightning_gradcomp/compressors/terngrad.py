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
payloads; ``collective`` picks one, ``"auto"`` by the ring traffic of each (see :meth:`TernGrad.aggregation_for`),
and a planner may pick either per bucket (:meth:`TernGrad.collectives`).
"""

import copy
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Literal, Optional, cast

import torch
from torch import Tensor

from lightning_gradcomp.compressors.backends import BACKENDS, Backend, KernelBacked
from lightning_gradcomp.compressors.base import (
    Aggregation,
    CollectiveVariant,
    FlatPacket,
    Packet,
    SharedStatistic,
    max_or_zero,
)
from lightning_gradcomp.compressors.streams import CounterStreams, RandomStreams
from lightning_gradcomp.compressors.terngrad_flat import FlatTernGrad
from lightning_gradcomp.compressors.terngrad_fused import FusedTernGrad
from lightning_gradcomp.kernels._build import extension_for
from lightning_gradcomp.exchange.segments import Segments
from lightning_gradcomp.validation import check_choice, check_int, check_number
from lightning_gradcomp.wire.ternary import PACKINGS, Packing, pack_ternary, packed_nbytes, unpack_ternary

ClipMode = Literal["paper", "code"]
ScalerShare = Literal["max", "per_worker"]
Collective = Literal["auto", "allgather", "allreduce_int8"]

# int8 sums of N ternaries stay in [-N, N]; beyond 127 ranks they would overflow.
_INT8_MAX_RANKS = 127
# relative size of the float32 rounding noise in a standard deviation of a constant tensor
_SIGMA_NOISE = 16 * torch.finfo(torch.float32).eps


class TernGrad(KernelBacked[FusedTernGrad]):
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
        seed: seed of this compressor's random stream; rank r draws from seed and r, so ranks differ and
            runs repeat.
        backend: ``"torch"`` (this module's torch ops with ``torch.Generator``, the reference), ``"fused"``
            (:mod:`lightning_gradcomp.kernels`: one statistics pass, one ternarize + pack pass with a
            counter-based random stream, fused decode; compiled on CPU, torch ops elsewhere) or ``"auto"``
            (fused on CPU when the kernels compile here, else torch). Both draw the same Bernoulli
            probabilities from different random streams; decoding is bit-identical.
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
        self._streams = RandomStreams(seed)
        self._keys = CounterStreams(seed)
        self._offer_kernels(
            FusedTernGrad(self, sigma_noise=_SIGMA_NOISE, streams=self._keys)
        )
        #: a group of layers in one flat tensor, in a fixed number of torch ops (draws from `_keys`, as fused)
        self._flat = FlatTernGrad(self, sigma_noise=_SIGMA_NOISE, streams=self._keys, native=self._native)
        #: the device type the gradients live on, from `setup`
        self._device_type: Optional[str] = None
        #: this compressor travelling as each of its variants, made on first use (see `for_collective`)
        self._views: dict[str, TernGrad] = {}

    # -- setup and state --------------------------------------------------------------------------------
    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        if self.collective == "allreduce_int8" and world_size > _INT8_MAX_RANKS:
            raise ValueError(
                f"`collective='allreduce_int8'` overflows int8 beyond {_INT8_MAX_RANKS} ranks, but the world size is "
                f"{world_size}. Fix: use `collective='allgather'` or `'auto'`."
            )
        super().setup(rank, world_size, device)  # chooses the backend (may load the kernels): after the checks
        self._streams.reset(rank)
        self._keys.reset(rank)  # the fused backend's counters start afresh too
        self._fused_impl.forget()
        self._flat.forget()
        self._device_type = device.type
        self._views = {}

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._streams.state_dict(), **self._keys.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streams.load_state_dict(state.get("streams", {}))
        self._keys.load_state_dict(state)
        self._fused_impl.forget()
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
    def aggregation_for(self, world_size: int) -> Aggregation:
        """All-gather of packed payloads, or an int8 all-reduce of ternary values.

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
        variants = [CollectiveVariant("allgather", Aggregation.GATHER)]
        if self.scaler_share == "max" and world_size <= _INT8_MAX_RANKS:
            variants.append(CollectiveVariant("allreduce_int8", Aggregation.SUM))
        return tuple(variants)

    def _variant(self, name: str) -> "TernGrad":
        view = self._views.get(name)
        if view is None:
            # a shallow copy: the random streams, counters and chosen backend are the same objects
            view = copy.copy(self)
            view.collective = cast(Collective, name)  # a declared variant's name is a `collective=` value
            self._views[name] = view
        return view

    def payload_nbytes(self, numel: int) -> int:
        if self.aggregation_for(self.world_size) is Aggregation.SUM:
            return numel
        extra = 4 * self._num_chunks(numel) if self.scaler_share == "per_worker" else 0
        return packed_nbytes(numel, self.packing) + extra

    # -- the maths ------------------------------------------------------------------------------------
    def _num_chunks(self, numel: int) -> int:
        if numel == 0:  # an empty tensor has no chunk: no scaler, nothing on the wire
            return 0
        return 1 if self.bucket_size is None else -(-numel // self.bucket_size)

    def _chunked(self, tensor: Tensor) -> Tensor:
        """The flat float32 tensor as [chunks, chunk_len]; a partial last chunk is padded with zeros."""
        flat = tensor.detach().reshape(-1).float()
        if self.bucket_size is None:
            return flat.unsqueeze(0)
        n, b = flat.numel(), self.bucket_size
        pad = self._num_chunks(n) * b - n
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad)))
        return flat.view(-1, b)

    def _sigma(self, chunks: Tensor, numel: int) -> Tensor:
        if self.bucket_size is None or numel % self.bucket_size == 0:
            return chunks.std(dim=1, correction=0)
        # the padded tail chunk must not count its zeros
        counts = torch.full((chunks.shape[0],), float(self.bucket_size), device=chunks.device)
        counts[-1] = numel - (chunks.shape[0] - 1) * self.bucket_size
        mean = chunks.sum(dim=1) / counts
        mask = torch.ones_like(chunks, dtype=torch.bool)
        mask.view(-1)[numel:] = False
        var = (((chunks - mean[:, None]) ** 2) * mask).sum(dim=1) / counts
        return var.sqrt()

    def _clipped_and_scaler(self, tensor: Tensor) -> tuple[Tensor, Tensor]:
        chunks = self._chunked(tensor)
        if self.clip_factor == 0.0:
            return chunks, chunks.abs().amax(dim=1)
        sigma = self._sigma(chunks, tensor.numel())
        maxabs = chunks.abs().amax(dim=1)
        # a constant chunk (e.g. a one-element bias) has sigma = 0: clipping at c*sigma would zero its gradient
        # forever (as the original code does); such a chunk has no outliers, so it is not clipped
        # (sigma below float32 rounding noise of the mean counts as 0)
        constant = sigma <= _SIGMA_NOISE * maxabs
        threshold = torch.where(constant, maxabs, self.clip_factor * sigma)
        if self.clip_mode == "code":
            return chunks, threshold
        clipped = torch.maximum(torch.minimum(chunks, threshold[:, None]), -threshold[:, None])
        return clipped, clipped.abs().amax(dim=1)

    def local_statistic(self, tensor: Tensor, name: str) -> Optional[Tensor]:
        if self.scaler_share != "max":
            return None
        if tensor.numel() == 0:
            return tensor.new_zeros(0, dtype=torch.float32)
        fused = self._kernels(tensor.device)
        if fused is not None:
            return fused.local_statistic(tensor, name)
        return self._clipped_and_scaler(tensor)[1]

    def ternarize(self, tensor: Tensor, scaler: Optional[Tensor] = None, name: str = "") -> tuple[Tensor, Tensor]:
        """Ternary values (int8, the tensor's flat length) and the scalers used (float32, one per chunk).

        Args:
            tensor: the gradient.
            scaler: scalers shared by all ranks (one per chunk); ``None`` uses this rank's own.
            name: the parameter's name, which selects its random stream.
        """
        if tensor.numel() == 0:
            return tensor.new_zeros(0, dtype=torch.int8), tensor.new_zeros(0, dtype=torch.float32)
        fused = self._kernels(tensor.device)
        if fused is not None:
            return fused.ternarize(tensor, name, scaler)
        chunks, local = self._clipped_and_scaler(tensor)
        s = local if scaler is None else scaler.to(chunks.device, torch.float32)
        rnd = torch.rand(chunks.shape, generator=self._streams.get(name, chunks.device), device=chunks.device)
        # b ~ Bernoulli(|g|/s), drawn as U[0,1)*s < |g|: no division, exact at s == 0 (nothing is sent) and
        # |g| >= s always sent (the original code's implicit clipping)
        keep = rnd.mul_(s[:, None]) < chunks.abs()
        ternary = torch.where(keep, torch.sign(chunks), torch.zeros_like(chunks)).to(torch.int8)
        return ternary.reshape(-1)[: tensor.numel()], s

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        fused = self._kernels(tensor.device)
        if fused is not None and tensor.numel() > 0:
            return fused.compress(tensor, name, shared, self.aggregation_for(self.world_size))
        ternary, s = self.ternarize(tensor, shared if self.scaler_share == "max" else None, name)
        stats = {"sparsity": (ternary == 0).float().mean().nan_to_num(0.0), "scaler": max_or_zero(s)}
        ctx: dict[str, Any] = {}
        if self.aggregation_for(self.world_size) is Aggregation.SUM:
            payload = ternary
            ctx["scale"] = s
        elif self.scaler_share == "max":
            payload = pack_ternary(ternary, self.packing)
            ctx["scale"] = s
        else:
            payload = torch.cat((pack_ternary(ternary, self.packing), s.view(torch.uint8)))
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, ctx=ctx, stats=stats)

    def _values_and_scale(self, packet: Packet) -> tuple[Tensor, Tensor]:
        """Integer values (ternaries, or sums of ternaries) and the scalers of one packet."""
        numel = packet.numel
        if packet.payload.dtype == torch.int8:  # int8 all-reduce form
            return packet.payload, packet.ctx["scale"]
        if "scale" in packet.ctx:
            return unpack_ternary(packet.payload, numel, self.packing), packet.ctx["scale"]
        nbytes = packed_nbytes(numel, self.packing)
        scale = packet.payload[nbytes:].clone().view(torch.float32)
        return unpack_ternary(packet.payload[:nbytes], numel, self.packing), scale

    def _scaled(self, values: Tensor, scale: Tensor, packet: Packet) -> Tensor:
        if self.bucket_size is None:
            out = values.float() * scale
        else:
            per_elem = scale.repeat_interleave(self.bucket_size)[: packet.numel]
            out = values.float() * per_elem
        return out.to(packet.dtype).view(packet.shape)

    def _decoder(self, packets: Sequence[Packet]) -> Optional[FusedTernGrad]:
        """The fused path when it decodes every one of ``packets`` (else the torch ops do)."""
        fused = self._kernels(packets[0].payload.device)
        return fused if fused is not None and all(fused.decodes(p) for p in packets) else None

    def decompress(self, packet: Packet) -> Tensor:
        fused = self._decoder([packet])
        if fused is not None:
            return fused.decompress(packet)
        values, scale = self._values_and_scale(packet)
        return self._scaled(values, scale, packet)

    def decompress_sum(self, packets: Sequence[Packet]) -> Tensor:
        if "scale" not in packets[0].ctx:
            return super().decompress_sum(packets)
        fused = self._decoder(packets)
        if fused is not None:
            return fused.decompress_sum(packets)
        # shared scaler: add the integer ternaries exactly, scale once
        total = self._values_and_scale(packets[0])[0].to(torch.int32)
        for packet in packets[1:]:
            total = total + self._values_and_scale(packet)[0]
        return self._scaled(total, packets[0].ctx["scale"], packets[0])

    def _fused_sums(self, packets: Sequence[Packet]) -> Optional[FusedTernGrad]:
        """The fused path when it sums ``packets`` (one shared scaler, packed payloads it decodes)."""
        return self._decoder(packets) if "scale" in packets[0].ctx else None

    def decompress_sum_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        fused = self._fused_sums(packets)
        if fused is not None:
            return fused.decompress_sum_into(packets, out)
        return super().decompress_sum_into(packets, out)

    def decompress_mean_into(self, packets: Sequence[Packet], out: Tensor) -> Tensor:
        # the fused decoder divides in the pass that writes `out`: one sweep over the bucket instead of two
        fused = self._fused_sums(packets)
        if fused is not None:
            return fused.decompress_sum_into(packets, out, divisor=len(packets))
        return super().decompress_mean_into(packets, out)

    def clipped(self, tensor: Tensor) -> Tensor:
        """``tensor`` after this rank's own c*sigma clipping, as float32 (for monitoring; draws no randomness).

        With ``clip_mode="code"`` the clipping is implicit at the shared scaler; this shows it at this rank's
        own c*sigma.
        """
        chunks, threshold = self._clipped_and_scaler(tensor)
        if self.clip_mode == "code" and self.clip_factor:
            chunks = torch.maximum(torch.minimum(chunks, threshold[:, None]), -threshold[:, None])
        return chunks.reshape(-1)[: tensor.numel()].view(tensor.shape)

    # -- a group of layers in one flat tensor (the hook's batched pipeline) -----------------------------------
    @property
    def batched(self) -> bool:  # type: ignore[override]
        """Whether the ``*_flat`` methods run a fixed number of ops per group (torch ops, or one call of the compiled
        kernels per group): everywhere but the torch backend on the CPU, which keeps the per-layer ``torch.Generator``
        reference (see :meth:`batch_on`). Before ``setup``: as on a CPU, ``"auto"`` counted as fused."""
        chosen = self.chosen_backend or ("torch" if self.backend == "torch" else "fused")
        return chosen == "fused" or self._device_type not in (None, "cpu")

    def batch_on(self, flat: Tensor, segments: Segments) -> bool:
        """Batched everywhere but with the torch backend on the CPU, which takes the default loop over layers: there
        the counter-based stream in torch ops (int64 hashing, ~30 passes) costs an order of magnitude more per
        element than ``torch.rand`` and an op's dispatch costs little; elsewhere (CUDA) every op is a kernel launch."""
        return flat.device.type != "cpu" or self._kernels(flat.device) is not None

    def _native(self, flat: Tensor) -> Optional[ModuleType]:
        """The compiled CPU kernels when the fused backend runs ``flat``'s group with them, else ``None`` (torch ops)."""
        return extension_for(flat) if self._kernels(flat.device) is not None else None

    def flat_statistic(self, flat: Tensor, segments: Segments) -> Optional[SharedStatistic]:
        if not self.batch_on(flat, segments):
            return super().flat_statistic(flat, segments)
        return self._flat.statistic(flat, segments)

    def compress_flat(self, flat: Tensor, segments: Segments, shared: Optional[SharedStatistic] = None) -> FlatPacket:
        if not self.batch_on(flat, segments):
            return super().compress_flat(flat, segments, shared)
        return self._flat.compress(flat, segments, shared, self.aggregation_for(self.world_size))

    def decompress_flat(self, packet: FlatPacket) -> Tensor:
        if packet.layers is not None:
            return super().decompress_flat(packet)
        return self._flat.decompress(packet)

    def decompress_flat_mean_into(self, packets: Sequence[FlatPacket], out: Tensor) -> Tensor:
        if packets[0].layers is not None:
            return super().decompress_flat_mean_into(packets, out)
        return self._flat.decompress_mean_into(packets, out)

    def sent_flat(self, flat: Tensor, packet: FlatPacket) -> Tensor:
        if packet.layers is not None:
            return super().sent_flat(flat, packet)
        return self._flat.decompress(packet)
