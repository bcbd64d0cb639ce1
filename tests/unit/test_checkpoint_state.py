"""The checkpoint layout of the compression state, without a process group."""

from typing import Optional

import pytest
import torch

from lightning_gradcomp.strategies.checkpoint import CHECKPOINT_KEY, complete_epoch_end, rank_state, restore, select
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.hook import GradCompState
from lightning_gradcomp.exchange.pipeline import LayerTransform
from lightning_gradcomp.compressors.per_tensor import per_tensor


def _state(compressor: Optional[Compressor] = None) -> GradCompState:
    compressor = compressor or TernGrad()
    compressor.setup(0, 2, torch.device("cpu"))
    return GradCompState(compressor=compressor, names={1: "w", 2: "b"}, world_size=2)


def _checkpoint(world_size: int, with_state: bool = True) -> dict:
    entry = rank_state(_state())
    if with_state:
        entry["memory"] = {"w": torch.ones(3)}
    return {CHECKPOINT_KEY: {"version": 1, "world_size": world_size, "ranks": [entry] * world_size}}


def test_each_rank_takes_its_own_entry_and_restores_it() -> None:
    ckpt = _checkpoint(2)
    ckpt[CHECKPOINT_KEY]["ranks"] = [dict(ckpt[CHECKPOINT_KEY]["ranks"][0], memory={"w": torch.full((3,), float(r))})
                                     for r in range(2)]
    state = _state()
    entry = select(ckpt, 1, 2, reset=False)
    assert entry is not None
    restore(state, entry, torch.device("cpu"))
    assert torch.equal(state.memory.residuals["w"], torch.ones(3))


def test_another_world_size_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"resume with devices x num_nodes = 4.*resume_compression='reset'"):
        select(_checkpoint(4), 0, 2, reset=False)
    assert select(_checkpoint(4), 0, 2, reset=True) is None


def test_a_stateless_checkpoint_resumes_on_any_world_size() -> None:
    from lightning_gradcomp.compressors import Identity

    entry = rank_state(_state(Identity()))
    ckpt = {CHECKPOINT_KEY: {"version": 1, "world_size": 4, "ranks": [entry] * 4}}
    assert select(ckpt, 0, 2, reset=False) is None


def test_a_partial_restore_is_refused() -> None:
    entry = select(_checkpoint(2), 0, 2, reset=False)
    assert entry is not None
    from lightning_gradcomp.compressors import Identity

    with pytest.raises(ValueError, match="Expected the compressor to be TernGrad"):
        restore(_state(Identity()), entry, torch.device("cpu"))
    state = _state()
    state.transforms = (LayerTransform(),)
    with pytest.raises(ValueError, match="Expected the gradient transforms"):
        restore(state, entry, torch.device("cpu"))
    state = _state()
    state.names = {1: "other"}
    with pytest.raises(ValueError, match=r"\['w'\] are not among"):
        restore(state, entry, torch.device("cpu"))


def test_another_shard_size_is_refused_naming_both() -> None:
    """The compression state is per shard: a resume must shard the model as the run that wrote it (unsharded
    against sharded included); a checkpoint without per-rank state, or one from before the shard size was
    recorded, resumes."""
    ckpt = _checkpoint(2)
    ckpt[CHECKPOINT_KEY]["shard_size"] = 2
    assert select(ckpt, 0, 2, reset=False, shard_size=2) is not None
    for live, written in ((1, "`shard_size=2`"), (4, "`shard_size=2`"), (None, "`shard_size=2`")):
        with pytest.raises(ValueError) as error:
            select(ckpt, 0, 2, reset=False, shard_size=live)
        message = str(error.value)
        assert f"written with {written}" in message and "the compression state is per shard" in message
        assert f"Fix: resume with {written}" in message and "resume_compression='reset'" in message
    assert "come from `shard_size=1` as this run" in _refusal(ckpt, 1)
    ckpt[CHECKPOINT_KEY]["shard_size"] = None  # written by an unsharded (DDP) run
    assert "written with an unsharded model (`shard_size=None`)" in _refusal(ckpt, 2)
    assert select(ckpt, 0, 2, reset=True, shard_size=2) is None
    del ckpt[CHECKPOINT_KEY]["shard_size"]
    assert select(ckpt, 0, 2, reset=False, shard_size=2) is not None


def _refusal(ckpt: dict, shard_size: int) -> str:
    with pytest.raises(ValueError) as error:
        select(ckpt, 0, 2, reset=False, shard_size=shard_size)
    return str(error.value)


def test_an_unknown_layout_version_is_refused() -> None:
    ckpt = _checkpoint(2)
    ckpt[CHECKPOINT_KEY]["version"] = 99
    with pytest.raises(ValueError, match="version 1"):
        select(ckpt, 0, 2, reset=False)


def test_terngrad_streams_are_per_parameter_and_restorable() -> None:
    """Randomness per parameter name: the draws of one layer do not depend on which layers came before."""
    a, b = TernGrad(), TernGrad()
    for c in (a, b):
        c.setup(0, 2, torch.device("cpu"))
    g = torch.randn(1000)
    per_tensor(a).compress(torch.randn(50), "other")  # a consumed another layer's stream first
    assert torch.equal(per_tensor(a).compress(g, "w").payload, per_tensor(b).compress(g, "w").payload)
    saved = a.state_dict()
    expected = per_tensor(a).compress(g, "w").payload
    c = TernGrad()
    c.setup(0, 2, torch.device("cpu"))
    c.load_state_dict(saved)
    assert torch.equal(per_tensor(c).compress(g, "w").payload, expected)


def _loops(epoch: dict, batch: dict, is_last_batch: bool) -> dict:
    counters = dict(ready=0, started=0, processed=0, completed=0)
    return {"loops": {"fit_loop": {
        "epoch_progress": {"total": dict(counters, **epoch), "current": dict(counters, **epoch)},
        "epoch_loop.batch_progress": {"total": dict(counters, **batch), "current": dict(counters, **batch),
                                      "is_last_batch": is_last_batch},
    }}}


def test_an_end_of_epoch_checkpoint_is_marked_completed_and_nothing_else_is() -> None:
    # written in on_train_epoch_end: epoch processed, not completed; every batch of it done
    end = _loops(dict(ready=1, started=1, processed=1), dict(ready=4, started=4, processed=4, completed=4), True)
    assert complete_epoch_end(end)
    loop = end["loops"]["fit_loop"]
    assert loop["epoch_progress"]["current"]["completed"] == loop["epoch_progress"]["total"]["completed"] == 1
    assert loop["epoch_loop.batch_progress"]["current"] == dict(ready=0, started=0, processed=0, completed=0)
    assert loop["epoch_loop.batch_progress"]["total"]["completed"] == 4 and not loop["epoch_loop.batch_progress"]["is_last_batch"]
    # written in on_train_batch_end at the epoch's last batch, or mid-epoch: left to Lightning
    last_batch = _loops(dict(ready=1, started=1), dict(ready=4, started=4, processed=4, completed=3), True)
    mid = _loops(dict(ready=1, started=1), dict(ready=2, started=2, processed=2, completed=1), False)
    for checkpoint in (last_batch, mid, {}):
        before = repr(checkpoint)
        assert not complete_epoch_end(checkpoint)
        assert repr(checkpoint) == before
