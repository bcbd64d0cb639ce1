"""Fit recipes for a few steps, one after another in the same process(es) (run as a subprocess by test_recipes.py).

Usage, one process (``devices=1``)::

    python -m tests.integration.recipe_fit DATA_ROOT RECIPE::OVERRIDE::OVERRIDE ...

or N real ranks, the Lightning way (Lightning reads torchrun's environment; Gloo on CPU; ``devices=N``)::

    python -m torch.distributed.run --standalone --nproc_per_node=N -m tests.integration.recipe_fit DATA_ROOT ...

Every fit runs ``--trainer.fast_dev_run=2`` unless its overrides set another count. After each fit, every rank
checks: ``global_step`` equals that count, every parameter is finite, and the recipe's compressor ran (the DDP
hook was called / the towers recorded packets; a WeightGrad fit also ran at least one WAN round when the
count reaches its staleness bound). With several ranks, the ranks compare SHA-1 digests of their parameters:
ranks that must hold bit-identical replicas do (every rank under DDP/GradCompStrategy; every rank of a site
under WeightGradStrategy, and every rank after a WAN round with ``site_view="global"``).

Rank 0 prints ``FIT-OK <recipe> <global_step> <seconds> <replica check>`` per recipe; the first failure raises
(non-zero exit; torchrun then stops the other ranks).
"""

import gc
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from gradcomp_lab.cli import GradCompCLI
from lightning_gradcomp import DiLoCoStrategy, GradCompStrategy, ShardedDiLoCoStrategy, ShardedGradCompStrategy
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.strategies.towers import TowerStrategy
from lightning_gradcomp.weightgrad import WeightGradStrategy
from tests.harness import freeze_imported_objects, memoize_lightning_entry_points
from tests.integration.recipe_data import ROOT, data_overrides

#: every fit: CPU, every rank of this launch on one node, a couple of training and validation batches, quiet
COMMON = [
    "--trainer.accelerator=cpu", f"--trainer.devices={os.environ.get('LOCAL_WORLD_SIZE', '1')}",
    "--trainer.num_nodes=1", "--trainer.fast_dev_run=2",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]  # fmt: skip


def _digest(module: torch.nn.Module) -> str:
    sha = hashlib.sha1()
    for p in module.parameters():
        sha.update(p.detach().contiguous().cpu().numpy().tobytes())
    return sha.hexdigest()


def _compressor_ran(recipe: str, strategy: object, steps: int) -> None:
    # DiLoCo over FSDP2 sites runs no hook at the inner steps (FSDP2's own): its outer rounds are checked below
    if isinstance(strategy, (GradCompStrategy, ShardedGradCompStrategy)) and strategy.hook_every_step:
        state = strategy.comm_state
        assert state is not None and state.ledger.hook_calls >= steps, (recipe, "the gradcomp hook did not run every step")
        if not isinstance(strategy.compressor, Identity):  # what this rank sent is smaller than fp32 DDP's
            assert state.bytes_per_step() < state.dense_bytes_per_step(), (recipe, "nothing was compressed")
    elif isinstance(strategy, TowerStrategy):
        assert strategy.records, (recipe, "the towers exchanged nothing")
    if isinstance(strategy, (DiLoCoStrategy, ShardedDiLoCoStrategy)) and steps >= strategy.sync_every:
        assert strategy.outer is not None and strategy.outer.rounds >= 1, (recipe, "no outer round ran")
    if isinstance(strategy, WeightGradStrategy) and steps >= strategy.staleness_bound:
        assert strategy.synchronizer is not None and strategy.synchronizer.rounds >= 1, (recipe, "no WAN round ran")


def _replicas(recipe: str, cli: GradCompCLI) -> str:
    """Check the replicas that must be bit-identical across ranks; returns what was checked."""
    strategy = cli.trainer.strategy
    if isinstance(strategy, ShardedGradCompStrategy):
        # each rank's shard must equal its copies in the other replicas (the same place in the other meshes' rows)
        shards = [""] * strategy.world_size
        local = hashlib.sha1(b"".join(getattr(p, "to_local", lambda p=p: p)().detach().contiguous().numpy().tobytes()
                                      for p in cli.model.parameters()))
        dist.all_gather_object(shards, local.hexdigest())
        size = strategy.device_mesh["shard"].size()
        # DiLoCo's sites too: the final outer round ran when fit returned
        for r in range(strategy.world_size):
            assert shards[r] == shards[r % size], (recipe, f"rank {r}'s shard differs from rank {r % size}'s", shards)
        return f"{strategy.world_size} ranks: every shard identical in its {strategy.world_size // size} replicas"
    if not isinstance(strategy, DDPStrategy) or strategy.world_size == 1:
        return "1 rank"
    digests: list[str] = [""] * strategy.world_size
    dist.all_gather_object(digests, _digest(cli.model))  # the default (world) group Lightning created
    if isinstance(strategy, WeightGradStrategy):
        assert strategy.groups is not None and strategy.synchronizer is not None
        layout = strategy.groups.layout
        for site in range(layout.num_sites):
            assert len({digests[r] for r in layout.ranks(site)}) == 1, (recipe, f"site {site} replicas differ", digests)
        if strategy.site_view == "global" and strategy.synchronizer.steps_since_round == 0:
            assert len(set(digests)) == 1, (recipe, "sites differ right after a WAN round", digests)
            return f"{layout.world_size} ranks identical after the WAN round (sites {list(layout.sizes)})"
        return f"{layout.world_size} ranks identical within each site (sites {list(layout.sizes)})"
    if isinstance(strategy, DiLoCoStrategy):
        assert strategy.outer is not None
        synced = int(strategy.outer.stats["inner_steps_since_sync"]) == 0
        if synced and strategy.mixing == 0.0 and len(strategy.outer.fragments) == 1:
            assert len(set(digests)) == 1, (recipe, "sites differ right after an outer round", digests)
            return f"{strategy.world_size} ranks identical after the outer round"
        return f"{strategy.world_size} ranks in {len(strategy.outer.fragments)} fragment(s), between rounds"
    assert len(set(digests)) == 1, (recipe, "DDP replicas differ", digests)
    return f"{strategy.world_size} ranks identical"


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    # each fit's Trainer and gc.collect() below: cheap, with the imported modules out of the collector's way
    memoize_lightning_entry_points()
    freeze_imported_objects()
    data_root = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    for spec in argv[1:]:
        recipe, *extra = spec.split("::")
        path = ROOT / recipe
        args = ["--config", str(path), *data_overrides(path, data_root), *COMMON, *extra]
        start = time.perf_counter()
        cli = GradCompCLI(args=args, run=False)  # as `gradcomp fit` parses it
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        steps = int(cli.trainer.fast_dev_run)  # type: ignore[attr-defined]  # set by Lightning's debugging-flag setup
        assert cli.trainer.global_step == steps, (recipe, cli.trainer.global_step, steps)
        for name, p in cli.model.named_parameters():
            assert torch.isfinite(p).all(), (recipe, name)
        _compressor_ran(recipe, cli.trainer.strategy, steps)
        checked = _replicas(recipe, cli)
        if rank == 0:
            print(f"FIT-OK {recipe} {cli.trainer.global_step} {time.perf_counter() - start:.1f}s {checked}", flush=True)
        del cli  # free this fit's model, optimizer and strategy state before the next one is built
        gc.collect()
    if dist.is_initialized():  # Lightning leaves the group up between fits; Gloo's threads must stop before exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
