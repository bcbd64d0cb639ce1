"""Compression state is training state: gather every rank's part into the checkpoint and give it back on resume.

Residuals, momentum-correction buffers, a compressor's random generator and its adaptive thresholds are per
rank, but Lightning writes checkpoints from rank 0 only. So at save time every rank's part travels to rank 0
(one ``gather_object``) and is stored under ``checkpoint["gradcomp"]``; at resume each rank takes the entry of
its own rank. A checkpoint written by another number of ranks cannot be split back exactly (residuals are
per-rank quantities), so it is refused unless it holds no state at all or the user asks for a reset. The same
holds between the flat and the hierarchical exchange, or two site layouts: a rank of the hierarchy keeps the state
of its share of the parameters only, and its compressor averages over sites, not ranks. So the checkpoint records
the sites that wrote it (``None``: the flat exchange) and a run with other sites refuses it. Likewise for a sharded
model (FSDP2): each rank's residuals cover its own shard of every parameter, whose extent is set by the shard size, so
the checkpoint records the shard size that wrote it (``None``: an unsharded model) and a run with another refuses it.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from lightning_gradcomp.exchange.hook import GradCompState

#: key of the compression state in a Lightning checkpoint
CHECKPOINT_KEY = "gradcomp"
#: bumped when the layout below changes
FORMAT_VERSION = 1


def _to_cpu(value: Any) -> Any:
    """A copy of nested containers with every tensor detached, cloned and on the CPU (picklable, device-free)."""
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _is_empty(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(_is_empty(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_is_empty(v) for v in value)
    return value is None


def rank_state(state: "GradCompState") -> dict[str, Any]:
    """This rank's compression state, on the CPU: compressor, residuals and every transform, by class name."""
    return {
        "compressor_class": type(state.router.compressor).__qualname__,
        "compressor": _to_cpu(state.router.compressor.state_dict()),
        "memory": state.memory.state_dict(),
        "transforms": [(type(t).__qualname__, _to_cpu(t.state_dict())) for t in state.transforms],
        "extra": {name: _to_cpu(obj.state_dict()) for name, obj in state.extra.items()},
        # the bytes so far, so that a resumed run's bytes_per_step() is still the whole run's mean
        "bytes": state.ledger.run_state(),
    }


def has_state(entry: Mapping[str, Any]) -> bool:
    """Whether one rank's entry carries anything to restore."""
    return not (
        _is_empty(entry["compressor"])
        and not entry["memory"]
        and all(_is_empty(s) for _, s in entry["transforms"])
        and all(_is_empty(s) for s in entry.get("extra", {}).values())
    )


def gather_into(checkpoint: dict[str, Any], state: "GradCompState", rank: int, world_size: int,
                shard_size: Optional[int] = None) -> None:
    """Collect every rank's :func:`rank_state` into ``checkpoint[CHECKPOINT_KEY]`` on rank 0.

    A collective over the default group: every rank must call it (Lightning's ``save_checkpoint`` runs on all).
    ``shard_size``: the ranks that shard one replica of a sharded model (``None``: the model is not sharded), which a
    resume must match (:func:`select`).
    """
    own = rank_state(state)
    if world_size > 1:
        gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
        dist.gather_object(own, gathered, dst=0)
    else:
        gathered = [own]
    if rank == 0:
        assert gathered is not None
        sites = None if state.peers.hierarchy is None else list(state.peers.hierarchy.layout.sizes)
        checkpoint[CHECKPOINT_KEY] = {"version": FORMAT_VERSION, "world_size": world_size, "sites": sites,
                                      "shard_size": shard_size, "ranks": gathered}


def _exchange(sites: Optional[Sequence[int]]) -> str:
    return "the flat exchange" if sites is None else f"the hierarchical exchange with sites {list(sites)}"


def _sites_option(sites: Optional[Sequence[int]]) -> str:
    return "no `hierarchy`/`site_size`/`site_sizes`" if sites is None else f"`site_sizes={list(sites)}`"


def _sharding(shard_size: Optional[int]) -> str:
    return "an unsharded model (`shard_size=None`)" if shard_size is None else f"`shard_size={shard_size}`"


def _refuse_another_layout(saved: Mapping[str, Any], key: str, live: Any, entries: Sequence[Mapping[str, Any]],
                           message: Callable[[Any], str]) -> None:
    """Raise ``message(saved[key])`` when the checkpoint recorded another ``key`` than this run's and holds state."""
    if key in saved and saved[key] != live and any(has_state(e) for e in entries):
        raise ValueError(message(saved[key]))


def select(
    checkpoint: Mapping[str, Any],
    rank: int,
    world_size: int,
    reset: bool,
    sites: Optional[Sequence[int]] = None,
    option: Optional[str] = None,
    shard_size: Optional[int] = None,
) -> Optional[dict[str, Any]]:
    """This rank's entry of a checkpoint, or ``None`` when there is nothing to restore.

    Args:
        checkpoint: the loaded checkpoint.
        rank: this rank's global rank.
        world_size: this run's world size.
        reset: whether the user asked to start the compression state afresh.
        sites: this run's site sizes under the hierarchical exchange, ``None`` for the flat exchange.
        option: how this run chose its sites (e.g. ``"`site_size=2`"``), for the error message.
        shard_size: this run's ranks per replica of a sharded model, ``None`` for an unsharded model.

    Raises:
        ValueError: the checkpoint was written by another number of ranks, by another exchange (flat against
            hierarchical, or other sites), or with another shard size (sharded against unsharded included), and
            holds per-rank state, and ``reset`` is not set; or its layout version is unknown.
    """
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None or reset:
        return None
    if saved.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"Expected the checkpoint's `{CHECKPOINT_KEY}` state to have version {FORMAT_VERSION}, but got "
            f"{saved.get('version')!r}. Fix: resume with the lightning_gradcomp version that wrote it, or pass "
            f"`GradCompStrategy(resume_compression='reset')` to start the compression state afresh."
        )
    entries = saved["ranks"]
    if saved["world_size"] != world_size:
        if not any(has_state(e) for e in entries):
            return None  # nothing per-rank was saved (e.g. fp32): any world size resumes exactly
        raise ValueError(
            f"Expected to resume on the {saved['world_size']} ranks that wrote the checkpoint's compression state "
            f"(residuals, generators, transform buffers are per rank and cannot be split exactly), but the world size "
            f"is {world_size}. Fix: resume with devices x num_nodes = {saved['world_size']}, or pass "
            f"`GradCompStrategy(resume_compression='reset')` to start the compression state afresh."
        )
    # absent in checkpoints written before the exchange or the shard size was recorded: not checked
    live_sites = None if sites is None else list(sites)
    _refuse_another_layout(saved, "sites", live_sites, entries, lambda saved_sites: (
        f"Expected the checkpoint's compression state to come from {_exchange(live_sites)}, as this run "
        f"({option or _sites_option(live_sites)}), but got one written by {_exchange(saved_sites)}: residuals, "
        f"generators and transform buffers are kept per rank for the parameters that rank exchanges, which "
        f"differ between the two. Fix: resume with {_sites_option(saved_sites)} as the run that wrote it, or "
        f"pass `GradCompStrategy(resume_compression='reset')` to start the compression state afresh."))
    _refuse_another_layout(saved, "shard_size", shard_size, entries, lambda saved_shard: (
        f"Expected the checkpoint's compression state to come from {_sharding(shard_size)} as this run, but "
        f"got one written with {_sharding(saved_shard)}: the compression state is per shard (each rank's "
        f"residuals, generators and statistics cover its own shard of every parameter, whose extent the shard "
        f"size sets), so it cannot be split into other shards exactly. Fix: resume with "
        f"{_sharding(saved_shard)} as the run that wrote it, or pass `resume_compression='reset'` to start the "
        f"compression state afresh."))
    return entries[rank]


def restore(state: "GradCompState", entry: Mapping[str, Any], device: torch.device) -> None:
    """Load one rank's entry into the live hook state, refusing anything that would restore only in part.

    Raises:
        ValueError: the compressor class, the transforms or the parameter names differ from the checkpoint's.
    """
    fix = "resume with the same compressor, callbacks and model, or pass `GradCompStrategy(resume_compression='reset')`"
    compressor = type(state.router.compressor).__qualname__
    if entry["compressor_class"] != compressor:
        raise ValueError(
            f"Expected the compressor to be {entry['compressor_class']} as in the checkpoint, but got {compressor}. "
            f"Fix: {fix}."
        )
    saved_transforms = [name for name, _ in entry["transforms"]]
    live_transforms = [type(t).__qualname__ for t in state.transforms]
    if saved_transforms != live_transforms:
        raise ValueError(
            f"Expected the gradient transforms {saved_transforms} as in the checkpoint, but got {live_transforms}. "
            f"Fix: {fix}."
        )
    unknown = sorted(set(entry["memory"]) - set(state.names.values()))
    if unknown:
        raise ValueError(
            f"Expected the checkpoint's residuals to belong to this model's parameters, but {unknown} are not among "
            f"them. Fix: {fix}."
        )
    saved_extra = sorted(entry.get("extra", {}))
    if saved_extra != sorted(state.extra):
        raise ValueError(
            f"Expected the further compression state {saved_extra} as in the checkpoint, but got {sorted(state.extra)}. "
            f"Fix: {fix}."
        )
    state.router.compressor.load_state_dict(entry["compressor"])
    state.memory.load_state_dict(entry["memory"], device)
    for transform, (_, saved) in zip(state.transforms, entry["transforms"]):
        transform.load_state_dict(saved)
    for name, obj in state.extra.items():
        obj.load_state_dict(entry["extra"][name])
    if "bytes" in entry:  # a checkpoint written before the run's bytes were kept starts counting afresh
        state.ledger.load_run_state(entry["bytes"])


def complete_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Make a checkpoint written at the end of an epoch (``on_train_epoch_end``) resume at the next epoch's start.

    Such a checkpoint records the epoch as processed but not completed. With ``max_steps`` set (Lightning's
    iteration-based training) Lightning resumes it as a restart *inside* that epoch: it runs one more batch there
    (drawn from the next epoch's sampler order) and then sets every later epoch's sampler one epoch ahead, so the
    resumed run sees other batches than the uninterrupted one. Epoch-based training resumes it at the next epoch's
    start; this marks the epoch completed and its batch counters fresh, so iteration-based training does the same.
    Returns whether the checkpoint was such a one (and was changed).
    """
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(loop, dict):
        return False
    epochs = loop.get("epoch_progress", {})
    batches = loop.get("epoch_loop.batch_progress", {})
    total, current = epochs.get("total"), epochs.get("current")
    if not (isinstance(total, dict) and isinstance(current, dict) and batches.get("is_last_batch")):
        return False
    at_epoch_end = all(
        c["ready"] == c["started"] == c["processed"] == c["completed"] + 1 for c in (total, current)
    )
    if not at_epoch_end:
        return False
    for counters in (total, current):
        counters["completed"] = counters["processed"]
    batches["current"] = {key: 0 for key in batches["current"]}
    batches["is_last_batch"] = False
    return True
