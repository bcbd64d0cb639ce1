"""``"<name>_notebook"``: fork-started strategies that train from an interactive session (no script file)."""

import os
import subprocess
import sys
import textwrap

import pytest
from lightning.pytorch import Trainer

from lightning_gradcomp import GradCompStrategy, WeightGradStrategy
from lightning_gradcomp.registry import NOTEBOOK_SUFFIX, compressor_names, make_compressor

# run with `python -i -c`: sys.flags.interactive is set (Lightning's notebook check) and __main__ is no file,
# so neither `popen` (re-runs the script) nor `spawn` (imports __main__) could start the ranks
_SESSION = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    import lightning_gradcomp

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(8, 2)
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # a notebook has usually run torch ops before: fork with an intra-op thread pool that has been used
    torch.set_num_threads(2)
    warm = torch.randn(512, 512)
    (warm @ warm).sum()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    try:
        pl.Trainer(strategy="terngrad", accelerator="cpu", devices=2)
    except Exception as error:
        print("PLAIN REFUSED:", type(error).__name__)
    model = Tiny()
    before = model.net.weight.detach().clone()
    trainer = pl.Trainer(strategy="terngrad_notebook", accelerator="cpu", devices=2, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    # the forked ranks send rank 0's weights back (the loop counters stay in the ranks)
    print("TRAINER", type(trainer.strategy).__name__, trainer.strategy._start_method,
          not torch.equal(before, model.net.weight))

    def loop(fabric):
        torch.manual_seed(0)
        net, opt = fabric.setup(nn.Linear(8, 2), torch.optim.SGD(nn.Linear(8, 2).parameters(), lr=0.1))
        for _ in range(3):
            opt.zero_grad()
            fabric.backward(net(x).square().mean())
            opt.step()
        weights = fabric.all_gather(net.weight.detach())
        state = fabric.strategy.comm_state
        return bool(torch.equal(weights[0], weights[1])), state.bytes_per_step() < state.dense_bytes_per_step()

    fabric = Fabric(strategy="terngrad_notebook", accelerator="cpu", devices=2)
    print("FABRIC", type(fabric.strategy).__name__, *fabric.launch(loop))
    """
)


@pytest.mark.distributed
def test_notebook_variant_trains_from_an_interactive_session() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # a session with its default threads
    result = subprocess.run(
        [sys.executable, "-i", "-c", _SESSION], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=300, env=env,
    )
    out = result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PLAIN REFUSED: MisconfigurationException" in out, out  # what the notebook variant is for
    assert "TRAINER GradCompStrategy fork True" in out, out
    assert "FABRIC GradCompFabricStrategy True True" in out, out


@pytest.mark.parametrize("name", compressor_names())
def test_every_compressor_has_a_fork_started_notebook_variant(name: str) -> None:
    trainer = Trainer(strategy=name + NOTEBOOK_SUFFIX, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, GradCompStrategy)
    assert type(trainer.strategy.compressor) is type(make_compressor(name))
    launcher = trainer.strategy.launcher
    assert trainer.strategy._start_method == "fork" and launcher is not None and launcher.is_interactive_compatible


def test_weightgrad_has_a_notebook_variant() -> None:
    trainer = Trainer(strategy="weightgrad" + NOTEBOOK_SUFFIX, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, WeightGradStrategy) and trainer.strategy._start_method == "fork"
