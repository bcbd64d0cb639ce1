"""Per-parameter random streams for stochastic compressors.

One ``torch.Generator`` per parameter name, seeded from (seed, rank, name). A single stream consumed in
bucket order would make every draw depend on DDP's bucket layout, which DDP rebuilds after step 0 (reverse
order): a resumed run would not repeat the uninterrupted one, and emulated workers (towers) would not match
real ranks. Distinct ranks must draw distinct streams, or their stochastic rounding would be correlated.

:class:`CounterStreams` keys every draw by (seed, rank, name, counter) instead: a pure function, so a group of
layers laid out in one flat tensor draws in one call exactly what its layers would draw one by one
(:meth:`CounterStreams.uniform_flat`), which a ``torch.Generator`` per name cannot do.
"""

import hashlib
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.kernels import cpu_extension
from lightning_gradcomp.kernels.rng import MASK32, hash_index, stream_id, stream_key, to_uniform, uniform
from lightning_gradcomp.flat import Segments


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

    def uniform(self, name: str, numel: int, device: torch.device) -> Tensor:
        """float32 ``[numel]`` uniforms in [0, 1) (24 random bits, as ``torch.rand``): the next draw of ``name``;
        an empty tensor draws nothing (its counter stays, as in TernGrad's fused kernels)."""
        index = torch.arange(numel, device=device)
        return uniform(index, *self.key(name)) if numel else index.float()

    def keys(self, segments: Segments) -> list[tuple[int, int]]:
        """The next draw's keys of every layer of the group, in order; an empty layer draws nothing (``(0, 0)``, its
        counter stays), as :meth:`uniform` leaves it."""
        return [self.key(name) if n else (0, 0) for name, n in zip(segments.names, segments.numels)]

    def bits_flat(self, segments: Segments, device: torch.device) -> Tensor:
        """int64 ``[segments.total]``: the 32-bit draws (:func:`~lightning_gradcomp.kernels.rng.hash_index`) of every
        layer of the group, in a fixed number of ops: element ``i`` of layer ``s`` hashes ``i`` with that layer's
        :meth:`keys`. The layer's flat offset is folded into its first key, so the flat position indexes the draw.
        """
        table = torch.tensor([[(k0 - offset) & MASK32, k1] for (k0, k1), offset in zip(self.keys(segments),
                                                                                        segments.offsets)],
                             dtype=torch.int64).view(-1, 2)
        if device.type == "cuda":  # a blocking copy from pageable memory would wait for the stream: pin, copy async
            table = table.pin_memory().to(device, non_blocking=True)
        per_element = segments.expand(table.to(device))
        return hash_index(torch.arange(segments.total, device=device), per_element[:, 0], per_element[:, 1])

    def uniform_flat(self, segments: Segments, device: torch.device) -> Tensor:
        """float32 ``[segments.total]``: :meth:`uniform` of every layer of the group, in a fixed number of ops,
        bit-identical to drawing layer after layer (the uniforms of :meth:`bits_flat`).

        On a CPU with the compiled kernels, one call of theirs draws the same bits: the torch ops' 32-bit hash in
        int64 arithmetic costs about 90 ns per element there, most of a QSGD or Int8 step."""
        ext = cpu_extension() if device.type == "cpu" else None
        if ext is not None:
            keys = torch.tensor(self.keys(segments), dtype=torch.int64).view(-1)
            return ext.counter_uniform_flat(segments.bounds(device), keys)
        return to_uniform(self.bits_flat(segments, device))

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counters; ``state`` may hold other keys (a compressor's whole state)."""
        self.counters = dict(state.get("counters", {}))


def check_counters(state: dict[str, Any], owner: str) -> None:
    """Check that ``state`` holds nothing (a fresh start) or :meth:`CounterStreams.state_dict`'s counters.

    Raises:
        ValueError: ``state`` holds per-name ``torch.Generator`` states (a :class:`RandomStreams` checkpoint of
            ``owner`` from before its draws became counter-based): they cannot be turned into counters, and
            starting the streams afresh silently would make the resumed run differ from the uninterrupted one.
    """
    if state and "counters" not in state:
        raise ValueError(
            f"Expected `{owner}`'s random-stream state to be per-name counters but got torch.Generator states for "
            f"{sorted(state)[:3]}... (a checkpoint from before its random draws moved to counter-based "
            "streams). Fix: resume with resume_compression='reset', or with the version that wrote the checkpoint."
        )


def load_counters(streams: CounterStreams, state: dict[str, Any], owner: str) -> None:
    """Restore ``streams`` from what :meth:`CounterStreams.state_dict` saved; ``state`` holds nothing (a fresh
    start) or those counters (else :func:`check_counters` raises)."""
    check_counters(state, owner)
    streams.load_state_dict(state)
