"""A probe for 1-bit Adam / 0/1 Adam runs: which parameters get the largest Adam steps once the variance freezes.

Rank 0 prints, every ``every`` optimizer steps from step ``start`` on, the training loss and the three parameters
with the largest ``max |m / (sqrt(v) + eps)|`` (the size of an Adam step in units of the learning rate), with
their smallest ``v``. A coordinate whose variance froze near zero while the 1-bit exchange hands its momentum a
piece's mean magnitude shows up here first (``docs/onebit_adam.md``). Add it to a benchmark run::

    python benchmarks/lm.py --long --out /tmp/probe --run 'probe=recipes/diloco/gpt_stdlib_ddp.yaml::--model.init_args.optimizer=onebit_adam::--trainer.strategy=onebit_adam::--model.init_args.optimizer_options={freeze_step: 300}::--trainer.max_steps=400::--model.init_args.max_steps=2000::--trainer.callbacks+=benchmarks.frozen_adam_probe.Probe'
"""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from typing_extensions import override


class Probe(Callback):
    """Print the largest Adam steps per parameter on rank 0 (see the module docstring).

    Args:
        start: the first optimizer step printed.
        every: print every this many steps.
    """

    def __init__(self, start: int = 290, every: int = 10) -> None:
        self.start, self.every = start, every

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if trainer.global_rank != 0 or step < self.start or step % self.every:
            return
        optimizer = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        largest = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if "exp_avg_sq" in state:
                    v, m = state["exp_avg_sq"], state["exp_avg"]
                    ratio = float((m / (v.sqrt() + group["eps"])).abs().max())
                    largest.append((ratio, names[id(p)], float(v.min())))
        largest.sort(reverse=True)
        loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
        shown = "; ".join(f"{name} {ratio:.3g} (min v {v_min:.2g})" for ratio, name, v_min in largest[:3])
        print(f"probe: step {step} loss {loss:.4f} largest |m / (sqrt(v) + eps)|: {shown}", flush=True)
