"""Per-parameter random streams for stochastic compressors.

One ``torch.Generator`` per parameter name, seeded from (seed, rank, name). A single stream consumed in
bucket order would make every draw depend on DDP's bucket layout, which DDP rebuilds after step 0 (reverse
order): a resumed run would not repeat the uninterrupted one, and emulated workers (towers) would not match
real ranks. Distinct ranks must draw distinct streams, or their stochastic rounding would be correlated.
"""

import hashlib
from typing import Any

import torch

from lightning_gradcomp.kernels.rng import stream_id, stream_key


class RandomStreams:
    """Reproducible, order-independent random generators keyed by parameter name.

    Args:
        seed: the user's seed; rank r and parameter ``name`` derive their own stream from it.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rank = 0
        self._generators: dict[str, torch.Generator] = {}

    def reset(self, rank: int) -> None:
        """Start every stream afresh for this rank."""
        self.rank = rank
        self._generators = {}

    def get(self, name: str, device: torch.device) -> torch.Generator:
        """The generator of parameter ``name`` on ``device`` (created from the seed on first use)."""
        gen = self._generators.get(name)
        if gen is None or gen.device != device:
            gen = torch.Generator(device=device)
            # hashed: the CPU generator keeps only the low 32 bits of a seed, so arithmetic mixing could collide
            digest = hashlib.blake2b(f"{self.seed}/{self.rank}/{name}".encode(), digest_size=8).digest()
            gen.manual_seed(int.from_bytes(digest, "little") >> 1)
            self._generators[name] = gen
        return gen

    def state_dict(self) -> dict[str, Any]:
        return {name: (str(gen.device), gen.get_state()) for name, gen in self._generators.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._generators = {}  # streams absent from the state start afresh from the seed
        for name, (device, gen_state) in state.items():
            self.get(name, torch.device(device)).set_state(gen_state)


class CounterStreams:
    """The fused backends' random streams: draw ``c`` of parameter ``name`` on rank ``r`` is keyed by
    ``(seed, r, name, c)`` (:func:`~lightning_gradcomp.kernels.rng.stream_key`), so the whole state is one
    counter per name. Order-independent and reproducible for the same reasons as :class:`RandomStreams`.

    Args:
        seed: the user's seed.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rank = 0
        #: draws made so far per parameter name
        self.counters: dict[str, int] = {}

    def reset(self, rank: int) -> None:
        """Start every stream afresh for this rank."""
        self.rank = rank
        self.counters = {}

    def key(self, name: str) -> tuple[int, int]:
        """The keys of the next draw of parameter ``name`` (advances its counter)."""
        counter = self.counters.get(name, 0)
        self.counters[name] = counter + 1
        return stream_key(self.seed, self.rank, counter, stream_id(name))

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counters; ``state`` may hold other keys (a compressor's whole state)."""
        self.counters = dict(state.get("counters", {}))
