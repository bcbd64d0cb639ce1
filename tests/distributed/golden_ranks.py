"""Rank body of the golden test: every registered compressor through DDP's hook on fixed gradients."""

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

#: a matrix, a bias, a conv kernel (PowerSGD's 4-D case), a small vector, a larger matrix (several chunks and bins)
SHAPES = ((64, 32), (32,), (16, 16, 3, 3), (10,), (128, 64))


class Coefficients(nn.Module):
    """``loss = sum(p * c)``: each parameter's gradient is exactly the coefficient tensor ``c`` of its rank and step,
    so the hook's input does not depend on the CPU's matrix kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(0.1 * torch.randn(s)) for s in SHAPES)

    def forward(self, coefficients: list[Tensor]) -> Tensor:
        return torch.stack([(p * c).sum() for p, c in zip(self.weights, coefficients)]).sum()


def _update(digest: "hashlib._Hash", t: Tensor) -> None:
    digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def compressor_digests(rank: int, world_size: int, names: list[str], steps: int) -> dict[str, str]:
    """Per compressor, a SHA-256 over every step's decoded mean (the gradients after the hook), then the final
    parameters and the residuals by name: a change of any bit of what the exchange computes changes it."""
    from lightning_gradcomp import GradCompState, gradcomp_hook, registry

    dist.init_process_group("gloo")
    digests: dict[str, str] = {}
    for name in names:
        torch.manual_seed(0)
        model = Coefficients()
        ddp = DistributedDataParallel(model)
        compressor = registry.make_compressor(name)
        compressor.setup(rank, world_size, torch.device("cpu"))
        named = dict(model.named_parameters())
        state = GradCompState(compressor=compressor, names={id(p): n for n, p in named.items()}, world_size=world_size)
        ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        digest = hashlib.sha256()
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            optimizer.zero_grad()
            ddp([torch.randn(s, generator=gen) for s in SHAPES]).backward()
            for p in model.parameters():
                assert p.grad is not None
                _update(digest, p.grad)
            optimizer.step()
        for p in model.parameters():
            _update(digest, p)
        residuals: Any = state.memory.residuals
        for key in sorted(residuals):
            digest.update(key.encode())
            _update(digest, residuals[key])
        digests[name] = digest.hexdigest()
    return digests
