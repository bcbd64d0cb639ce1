import pytest
import torch

# memoizes Lightning's entry-point scan for every Trainer this process builds (tests/harness.py says why)
import tests.harness  # noqa: F401

# One intra-op thread per test process: spawned ranks use one each too, and on 2 cores more threads only
# contend (a tiny LeNet ran ~40x slower with 2 threads under load).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _compiled_kernels() -> None:
    """Build the fused CPU kernels once, before any test spawns ranks: ranks then load the cached build
    instead of compiling inside a rank's timeout (TernGrad's backend "auto" uses them)."""
    from lightning_gradcomp import kernels

    kernels.fused_available()
