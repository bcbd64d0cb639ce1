import pytest
import torch

# One intra-op thread per test process: spawned ranks use one each too, and on 2 cores more threads only
# contend (a tiny LeNet ran ~40x slower with 2 threads under load).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
