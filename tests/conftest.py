import pytest
import torch

from tests.harness import freeze_imported_objects

# (importing tests.harness also memoizes Lightning's entry-point scan for every Trainer this process builds)

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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported now: keep what they and the library hold out of full garbage collections."""
    freeze_imported_objects()
