import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _compiled_kernels() -> None:
    """Build the fused CPU kernels once, before any test spawns ranks: ranks then load the cached build
    instead of compiling inside a rank's timeout (TernGrad's backend "auto" uses them)."""
    from lightning_gradcomp import kernels

    kernels.fused_available()
