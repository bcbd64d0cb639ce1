"""Golden digests: what every registered compressor computes through the hook, bit for bit, stays what it was.

A refactor of the exchange (compressor contract, kernels, group step) must leave every decoded mean, parameter and
residual unchanged; this test pins them. The digests are of the machine and torch that recorded them (float
reductions vectorise by the CPU's instruction set), so elsewhere the test skips and says why. After an intended
change, record anew and say why in the commit:

    GRADCOMP_UPDATE_GOLDEN=1 python -m pytest -q tests/distributed/test_golden.py
"""

import json
import os
from pathlib import Path

import pytest
import torch

from lightning_gradcomp import registry
from tests.distributed.golden_ranks import compressor_digests
from tests.harness import run_ranks

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "compressors.json"
STEPS = 3
WORLD = 2


def _machine() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def test_every_compressor_computes_what_it_computed() -> None:
    names = registry.compressor_names()
    if os.environ.get("GRADCOMP_UPDATE_GOLDEN") == "1":
        digests = run_ranks(compressor_digests, WORLD, names, STEPS, timeout=300.0)
        GOLDEN.write_text(json.dumps({**_machine(), "steps": STEPS, "world_size": WORLD, "digests": digests},
                                     indent=1, sort_keys=True) + "\n")
        return
    recorded = json.loads(GOLDEN.read_text())
    if {k: recorded[k] for k in _machine()} != _machine():
        pytest.skip(f"digests recorded with {({k: recorded[k] for k in _machine()})}, this is {_machine()}")
    missing = sorted(set(names) - set(recorded["digests"][0]))
    assert not missing, f"no digest recorded for {missing}: record them (see the module docstring)"
    digests = run_ranks(compressor_digests, WORLD, names, STEPS, timeout=300.0)
    # per rank: the decoded means and parameters agree between ranks, the residuals are each rank's own
    changed = sorted({n for rank in range(WORLD) for n in names if digests[rank][n] != recorded["digests"][rank][n]})
    assert not changed, f"these compressors now compute other bits: {changed}"
