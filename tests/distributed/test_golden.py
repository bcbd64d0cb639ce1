"""Golden digests: what every registered compressor computes through the hook, and what every other engine (DiLoCo,
Streaming DiLoCo, WeightGrad, the hierarchical exchange, TowerStrategy) computes through its strategy, bit for bit,
stays what it was.

1-bit Adam and 0/1 Adam are pinned through their compressed all-reduce on 2 and 3 ranks (uneven chunks).

A refactor of the exchange (compressor contract, kernels, group step, transports) must leave every decoded mean,
exchanged pseudo-gradient and WAN payload, parameter and residual unchanged; these tests pin them. Float reductions
vectorise by the CPU's instruction set, so every golden rank computes with torch's kernels at AVX2 and MKL on one
code branch (``golden_ranks.PINNED_CPU``), whatever the CPU's vector width: the digests hold on every x86-64 CPU with
AVX2 and the torch version that recorded them (elsewhere the tests skip and say why), except that the engines that
train through MKL compute other bits on AMD than on Intel CPUs: those are recorded per CPU vendor where they differ
(``by_cpu_vendor`` in ``engines.json``; record a vendor's on a checkout whose code is unchanged). After an intended
change, record anew (on each vendor) and say why in the commit:

    GRADCOMP_UPDATE_GOLDEN=1 python -m pytest -q tests/distributed/test_golden.py
"""

import json
import os
import platform
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gradcomp import registry
from tests.distributed.golden_ranks import (
    FROZEN_ADAMS,
    PINNED_CAPABILITY,
    PINNED_CPU,
    TOWERS,
    compressor_digests,
    cpu_environment,
    engine_configs,
    engine_digests,
    frozen_adam_digests,
    pinned,
    tower_digests,
)
from tests.harness import rank_environment, run_ranks

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
COMPRESSORS = GOLDEN / "compressors.json"
#: per engine configuration, per rank (one entry for the towers, which run in one process), the digests of
#: ``golden_ranks.EngineRecorder``'s parts and the bytes per step
ENGINES = GOLDEN / "engines.json"
STEPS = 3
WORLD = 2
#: the engines' world: 2 sites of 2 ranks (in-site exchange, leaders between sites, shares of the hierarchy)
ENGINE_WORLD = 4


def _rank_seed(rank: int, world_size: int) -> str | None:
    return os.environ.get("PL_GLOBAL_SEED")


@pytest.mark.distributed
def test_ranks_do_not_inherit_a_seed_set_in_the_test_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier test in the same process that called ``seed_everything`` leaves ``PL_GLOBAL_SEED`` set; a rank's
    strategy would seed again from it, and every digest here would depend on the tests that ran before."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert "PL_GLOBAL_SEED" not in rank_environment()
    assert run_ranks(_rank_seed, 2, timeout=60.0) == [None, None]


def _run_pinned(fn: Any, world_size: int, *args: Any, timeout: float) -> list[Any]:
    """``run_ranks`` of ``fn`` on ranks that compute in :data:`PINNED_CPU` (and check that they do); skips, saying
    why, on a machine that cannot."""
    if (why := _unpinnable()) is not None:
        pytest.skip(why)
    return run_ranks(pinned, world_size, fn, *args, timeout=timeout, env=PINNED_CPU)


@pytest.mark.distributed
def test_golden_ranks_compute_at_the_pinned_cpu_capability() -> None:
    """What the digests depend on is the pin, not this CPU: a golden rank sees :data:`PINNED_CPU` and torch's kernels
    run at :data:`PINNED_CAPABILITY` there (on an AVX-512 CPU, unpinned, they run at AVX512)."""
    assert _run_pinned(cpu_environment, 1, timeout=60.0) == [(PINNED_CAPABILITY, PINNED_CPU)]


def _machine() -> dict[str, Any]:
    """What the digests depend on: torch's version and the pinned CPU environment, not the CPU that recorded them."""
    return {"torch": torch.__version__, "cpu_capability": PINNED_CAPABILITY, "cpu_environment": PINNED_CPU}


def _unpinnable() -> str | None:
    """Why this machine cannot compute in :data:`PINNED_CPU` (None when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the digests are of x86-64 kernels (AVX2, MKL), this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the digests are of AVX2 kernels, this CPU runs {torch.backends.cpu.get_cpu_capability()}"
    if not torch.backends.mkl.is_available():
        return "the digests are of MKL's kernels, this torch is built without MKL"
    return None


def _updating() -> bool:
    return os.environ.get("GRADCOMP_UPDATE_GOLDEN") == "1"


def _recorded(path: Path) -> dict[str, Any]:
    """The stored digests; skips (saying why) under another torch version than the one that recorded them."""
    recorded = json.loads(path.read_text())
    if recorded.get("torch") != torch.__version__:
        pytest.skip(f"digests recorded with torch {recorded.get('torch')}, this is {torch.__version__}")
    stored = {k: recorded.get(k) for k in _machine()}
    assert stored == _machine(), f"digests recorded in {stored}, the ranks now compute in {_machine()}: record anew"
    return recorded


def test_every_compressor_computes_what_it_computed() -> None:
    names = registry.compressor_names()
    if _updating():
        digests = _run_pinned(compressor_digests, WORLD, names, STEPS, timeout=300.0)
        COMPRESSORS.write_text(json.dumps({**_machine(), "steps": STEPS, "world_size": WORLD, "digests": digests},
                                          indent=1, sort_keys=True) + "\n")
        return
    recorded = _recorded(COMPRESSORS)
    missing = sorted(set(names) - set(recorded["digests"][0]))
    assert not missing, f"no digest recorded for {missing}: record them (see the module docstring)"
    digests = _run_pinned(compressor_digests, WORLD, names, STEPS, timeout=300.0)
    # per rank: the decoded means and parameters agree between ranks, the residuals are each rank's own
    changed = sorted({n for rank in range(WORLD) for n in names if digests[rank][n] != recorded["digests"][rank][n]})
    assert not changed, f"these compressors now compute other bits: {changed}"


def cpu_vendor() -> str:
    """This CPU's vendor as the kernel names it (``GenuineIntel``, ``AuthenticAMD``; ``unknown`` where it says nothing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _expected_engines(stored: dict[str, Any], vendor: str) -> dict[str, list[dict[str, Any]]]:
    """The digests this CPU's vendor computes: the recording vendor's, with this vendor's own where they differ.

    MKL's ``COMPATIBLE`` branch gives the same bits on Intel CPUs of any vector width, but not on AMD's: the engines
    that train through MKL (DiLoCo, WeightGrad, the frozen Adams) compute other bits there. Those are recorded per
    vendor (``by_cpu_vendor``), only where they differ, so every other entry is still checked against one record."""
    expected = dict(stored["digests"])
    if vendor != stored.get("cpu_vendor", vendor):
        expected.update(stored.get("by_cpu_vendor", {}).get(vendor, {}))
    return expected


def _check_engines(now: dict[str, list[dict[str, Any]]]) -> None:
    """Record ``now`` (updating), or compare it with the stored digests part by part, naming every difference."""
    vendor = cpu_vendor()
    if _updating():
        stored = json.loads(ENGINES.read_text()) if ENGINES.exists() else {}
        if {k: stored.get(k) for k in _machine()} != _machine():
            stored = {**_machine(), "cpu_vendor": vendor, "digests": {}}  # recorded elsewhere: all rerecorded
        stored.setdefault("cpu_vendor", vendor)
        if vendor == stored["cpu_vendor"]:
            stored["digests"].update(now)
        else:  # another vendor's bits, kept only where they differ from the recording vendor's
            own = stored.setdefault("by_cpu_vendor", {}).setdefault(vendor, {})
            for name, ranks in now.items():
                if stored["digests"].get(name) == ranks:
                    own.pop(name, None)
                else:
                    own[name] = ranks
        ENGINES.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        return
    recorded = _expected_engines(_recorded(ENGINES), vendor)
    missing = sorted(set(now) - set(recorded))
    assert not missing, f"no digest recorded for {missing}: record them (see the module docstring)"
    changed = [
        f"{name} rank {rank} {part}: {recorded[name][rank].get(part)} -> {ranks[rank].get(part)}"
        for name, ranks in now.items()
        for rank in range(len(ranks))
        for part in sorted(set(ranks[rank]) | set(recorded[name][rank]))
        if ranks[rank].get(part) != recorded[name][rank].get(part)
    ]
    assert not changed, (f"these engines now compute other bits on this {vendor} CPU:\n" + "\n".join(changed)
                         + "\n(a vendor with no record of its own is checked against the recording vendor's digests: "
                         "record it on an unchanged checkout, see the module docstring)")


@pytest.mark.distributed
def test_every_engine_computes_what_it_computed() -> None:
    """DiLoCo, Streaming DiLoCo, WeightGrad and the hierarchical exchange on 2 sites of 2 Gloo ranks: per rank, the
    gradients, the exchanged pseudo-gradients and means, WeightGrad's WAN messages, the parameters, the error
    feedback and outer state, and the bytes per step are those recorded."""
    names = list(engine_configs())
    digests = _run_pinned(engine_digests, ENGINE_WORLD, names, timeout=300.0)
    _check_engines({name: [digests[rank][name] for rank in range(ENGINE_WORLD)] for name in names})


@pytest.mark.distributed
def test_towers_compute_what_they_computed() -> None:
    """TowerStrategy's emulated workers (one process, a rank of one in the pinned environment): the averaged
    gradients, parameters, each worker's residuals and the bytes per step are those recorded."""
    digests = _run_pinned(tower_digests, 1, list(TOWERS), timeout=120.0)[0]
    _check_engines({name: [value] for name, value in digests.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_adams_compute_what_they_computed(world: int) -> None:
    """1-bit Adam and 0/1 Adam through DDP's hook and their compressed all-reduce on ``world`` Gloo ranks (uneven
    chunks at 3): per rank, every exchange's input and average, the parameters after every step, the worker and
    server errors and the optimizer's moments, and the exchange's bytes are those recorded."""
    names = list(FROZEN_ADAMS)
    digests = _run_pinned(frozen_adam_digests, world, names, timeout=120.0)
    _check_engines({f"{name}_w{world}": [digests[rank][name] for rank in range(world)] for name in names})
