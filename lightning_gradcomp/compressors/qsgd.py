"""QSGD (Alistarh et al., NIPS 2017): stochastic, unbiased quantization to ``s`` levels per bucket.

For each bucket v of ``bucket_size`` consecutive elements: with r_i = s * |v_i| / ||v||_2, the level is
``floor(r_i)`` plus a Bernoulli(r_i - floor(r_i)) draw, and the decoded value is
``||v||_2 * sign(v_i) * level_i / s``; so E[decoded] = v exactly (unbiased), no error feedback needed.

On the wire (exact), fixed-width levels: per element one sign bit and ``ceil(log2(s + 1))`` level bits,
packed end to end, plus one float32 norm per bucket. (The paper's Elias coding of the sparse levels is
denser at small s; fixed width keeps every packet the same size, so no size exchange is needed.)
"""

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.bits import pack_bits, packed_bits_nbytes, unpack_bits
from lightning_gradcomp.compressors.base import Aggregation, Compressor, Packet
from lightning_gradcomp.compressors.streams import RandomStreams
from lightning_gradcomp.validation import check_int


class QSGD(Compressor):
    """Stochastic quantization to ``levels`` levels of each bucket's L2 norm.

    Args:
        levels: s, the number of non-zero levels (s = 7 gives 3 level bits + 1 sign bit = 4 bits/element).
        bucket_size: elements per norm (the paper uses 512); the last bucket of a tensor may be shorter.
        seed: seed of the random stream; rank r draws from seed and r, so ranks differ and runs repeat.
    """

    aggregation = Aggregation.GATHER

    def __init__(self, levels: int = 7, bucket_size: int = 512, seed: int = 0) -> None:
        super().__init__()
        check_int("bucket_size", bucket_size, minimum=1, fix="use 512 (the paper)")
        check_int("seed", seed, minimum=0)
        self.levels = levels
        self.bucket_size = bucket_size
        self.seed = seed
        self._streams = RandomStreams(seed)

    @property
    def levels(self) -> int:
        """s, the number of non-zero levels; settable between steps (identically on every rank)."""
        return self._levels

    @levels.setter
    def levels(self, value: int) -> None:
        check_int("levels", value, minimum=1, fix="use 7 (4 bits per element) or 1 (2 bits per element)")
        if value > 2**15 - 1:
            raise ValueError(f"Expected `levels` to be at most {2**15 - 1}, but got {value}. Fix: use 'fp16' instead.")
        self._levels = value
        #: bits per element on the wire: one sign bit and the level
        self.width = 1 + math.ceil(math.log2(value + 1))

    def setup(self, rank: int, world_size: int, device: torch.device) -> None:
        super().setup(rank, world_size, device)
        self._streams.reset(rank)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self._streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streams.load_state_dict(state.get("streams", {}))

    def payload_nbytes(self, numel: int) -> int:
        """Exact bytes of one packet: packed sign+level codes and one float32 norm per bucket."""
        return packed_bits_nbytes(numel, self.width) + 4 * -(-numel // self.bucket_size)

    def _buckets(self, flat: Tensor) -> Tensor:
        pad = (-flat.numel()) % self.bucket_size
        if pad:  # zero padding changes no norm and decodes to nothing
            flat = torch.cat((flat, flat.new_zeros(pad)))
        return flat.view(-1, self.bucket_size)

    def quantize(self, tensor: Tensor, name: str = "") -> tuple[Tensor, Tensor, Tensor]:
        """Signs (bool, negative), levels (int32 in [0, s]) and bucket norms (float32) of ``tensor``."""
        flat = tensor.detach().reshape(-1).float()
        buckets = self._buckets(flat)
        norms = buckets.norm(dim=1)
        scaled = buckets.abs() * (self.levels / torch.where(norms > 0, norms, 1.0))[:, None]
        lower = scaled.floor()
        rnd = torch.rand(scaled.shape, generator=self._streams.get(name, flat.device), device=flat.device)
        level = (lower + (rnd < scaled - lower).float()).clamp_(max=self.levels)  # float error guard at r == s
        n = flat.numel()
        return (buckets < 0).reshape(-1)[:n], level.reshape(-1)[:n].to(torch.int32), norms

    def compress(self, tensor: Tensor, name: str, shared: Optional[Tensor] = None) -> Packet:
        negative, level, norms = self.quantize(tensor, name)
        codes = level * 2 + negative.to(torch.int32)
        payload = torch.cat((pack_bits(codes, self.width), norms.view(torch.uint8)))
        stats = {"sparsity": (level == 0).float().mean(), "norm": norms.max()}
        return Packet(payload=payload, shape=tensor.shape, dtype=tensor.dtype, stats=stats)

    def decompress(self, packet: Packet) -> Tensor:
        n = packet.numel
        ncodes = packed_bits_nbytes(n, self.width)
        codes = unpack_bits(packet.payload[:ncodes], n, self.width)
        # clone: a slice at an odd byte offset cannot be reinterpreted as float32 in place
        norms = packet.payload[ncodes:].clone().view(torch.float32)
        magnitude = (codes >> 1).float() * (norms.repeat_interleave(self.bucket_size)[:n] / self.levels)
        out = torch.where((codes & 1).bool(), -magnitude, magnitude)
        return out.to(packet.dtype).view(packet.shape)

    def describe(self) -> dict[str, Any]:
        return {"compressor": "QSGD", "levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}
