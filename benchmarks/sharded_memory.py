"""Memory per rank: the sharded strategy (FSDP2, 2 replicas of 2 shards) against our DDP strategy on the same model,
and the model sharded across 2 nodes of 2 ranks (FSDP2 over all 4 ranks: stock, with the compressed reduce-scatter,
and with the quantized weight all-gather too) against the HSDP engine with the same int8 compressor.

A GPT where the parameters dominate (width 768, 6 blocks: 43M parameters, 2 sequences of 64 tokens per rank),
AdamW, 4 Gloo ranks on the CPU, a few steps; Gradient Dropping (error feedback: a residual per parameter) under
``GradCompStrategy`` (DDP) and ``ShardedGradCompStrategy(shard_size=2)``; int8 between nodes under
``ShardedGradCompStrategy(shard_size=2)`` (HSDP) and ``ShardedGradCompStrategy(compress_across_nodes=True,
node_size=2)`` (with and without ``quantize_weights``), and stock FSDP2 over the 4 ranks (``sharded_fp32`` with
``shard_size=4``: one replica, plain FSDP2). Each run is its own process tree (``--worker``), one after the other. Per rank it measures:

* **held**: the bytes of the tensors the rank holds at its last optimizer step, by kind: parameters (its shards
  under FSDP2), gradients, AdamW's state and the residuals of error feedback. Exact (elements x element size);
  what the 16 bytes per parameter of AdamW in fp32 become per rank. Residuals: the replica exchange's, or the int8
  reduce-scatter's across nodes (two pieces of the unit per rank, the rank's own and the other node's).
* **peak**: what training adds to the process's resident memory: its high-water mark (``VmHWM``) over the training
  steps, minus its resident memory before the model was built (imports and data only). The mark is reset when
  training starts, after freed heap pages went back to the system (``malloc_trim``), so the full model that each
  rank builds before FSDP2 shards it is not counted. It includes what the tensors above leave out: DDP's gradient
  buckets, FSDP2's unsharded parameters and gradients of the unit being computed, activations, the exchange's
  buffers, and the allocator's slack. Linux only.

    python benchmarks/sharded_memory.py            # the 6 runs, then the table (about 10 minutes on 2 cores)
    python benchmarks/sharded_memory.py --saved    # the table of the stored runs
"""

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "sharded_memory"
#: the cross-node runs' nodes: 2 of 2 ranks
ACROSS = {"compress_across_nodes": True, "node_size": 2, "resume_compression": "reset"}
#: label -> (strategy, compressor, the sharded strategy's options)
RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "ddp_graddrop": ("ddp", "graddrop", {}),
    "sharded_graddrop": ("sharded", "graddrop", {"shard_size": 2}),
    "fsdp_over_all_ranks": ("sharded", "fp32", {"shard_size": 4}),
    "hsdp_int8": ("sharded", "int8", {"shard_size": 2}),
    "across_int8": ("sharded", "int8", ACROSS),
    "across_int8_quantized_weights": ("sharded", "int8", {**ACROSS, "quantize_weights": True}),
}
WIDTH, DEPTH, HEADS, CONTEXT, BATCH, STEPS, WORLD = 768, 6, 12, 64, 2, 4, 4
MIB = 2**20


def rss_kib(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its high-water mark (``VmHWM``), in KiB."""
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None, f"no {field} in /proc/self/status (Linux only)"
    return int(match.group(1))


def reset_peak() -> None:
    """Free what can be freed, return the heap's free pages to the system, and restart the high-water mark there."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def worker(label: str, out: Path) -> None:
    """One run; every rank executes it (Lightning's launcher re-runs this command for ranks 1..3)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from gradcomp_lab.models import GPT
    from lightning_gradcomp import GradCompStrategy, ShardedGradCompStrategy

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (BATCH * STEPS, CONTEXT + 1), generator=gen)
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH)
    before_model = rss_kib()

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(256, WIDTH, DEPTH, HEADS, CONTEXT)

        def configure_model(self) -> None:
            # as the lab's tasks shard (gradcomp_lab/tasks/base.py): each block, then the root; DDP: nothing
            mesh = self._device_mesh
            if mesh is None:
                return
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block, mesh=mesh["shard"])
            fully_shard(self.model, mesh=mesh["shard"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (seq,) = batch
            logits = self.model(seq[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    class Meter(pl.Callback):
        def __init__(self) -> None:
            self.held: dict[str, int] = {}
            self.start_kib = 0

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            reset_peak()
            self.start_kib = rss_kib()

        def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
            if trainer.global_step != STEPS - 1:
                return
            params = [p for p in module.parameters() if p.requires_grad]
            state = getattr(trainer.strategy, "comm_state", None)
            across = getattr(trainer.strategy, "reduce_scatter", None)
            self.held = {
                "parameters": nbytes(local(p) for p in params),
                "gradients": nbytes(local(p.grad) for p in params if p.grad is not None),
                "optimizer": nbytes(local(v) for s in optimizer.state.values() for v in s.values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0),
                "residuals": (0 if state is None else nbytes(state.memory.residuals.values()))
                + (0 if across is None else nbytes(c.residual for c in across.comms if c.residual is not None)),
            }

    kind, compressor, options = RUNS[label]
    strategy = (GradCompStrategy(compressor=compressor) if kind == "ddp"
                else ShardedGradCompStrategy(compressor=compressor, **options))
    meter = Meter()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[meter])
    module = LM()
    trainer.fit(module, loader)
    mine = {"rank": trainer.global_rank, "held": meter.held, "rss_before_model_mib": before_model / 1024,
            "rss_at_train_start_mib": meter.start_kib / 1024, "peak_rss_mib": rss_kib("VmHWM") / 1024}
    everyone: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(everyone, mine)
    if trainer.global_rank == 0:
        from benchmarks.lm import machine, provenance

        numel = sum(p.numel() for p in GPT(256, WIDTH, DEPTH, HEADS, CONTEXT).parameters())
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "label": label, "strategy": type(strategy).__name__, "compressor": compressor, "world_size": WORLD,
            "shard_size": options.get("shard_size", WORLD) if kind == "sharded" else None,
            "options": options, "parameters": numel,
            "model": f"GPT width {WIDTH}, depth {DEPTH}, vocab 256, context {CONTEXT}; AdamW; {BATCH} x {CONTEXT} "
                     f"tokens per rank; {STEPS} steps",
            "ranks": sorted(everyone, key=lambda r: r["rank"]), "command": "python benchmarks/sharded_memory.py",
            "machine": machine(), "torch": torch.__version__, **provenance(),
        }, indent=1))


def summarize(runs: list[dict[str, Any]]) -> str:
    """Per rank (the mean over the 4 ranks), MiB: the tensors held by kind, and what training added to the
    resident memory (peak)."""
    lines = ["| run | parameters | gradients | AdamW state | residuals | held in all | peak above no-model RSS |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        ranks = run["ranks"]
        held = {k: sum(r["held"][k] for r in ranks) / len(ranks) / MIB for k in ranks[0]["held"]}
        peak = sum(r["peak_rss_mib"] - r["rss_before_model_mib"] for r in ranks) / len(ranks)
        lines.append(f"| {run['label']} | {held['parameters']:.0f} | {held['gradients']:.0f} | {held['optimizer']:.0f} | "
                     f"{held['residuals']:.0f} | {sum(held.values()):.0f} | {peak:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], Path(argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="*", default=None, help="labels of the runs")
    parser.add_argument("--force", action="store_true", help="rerun runs whose JSON exists")
    parser.add_argument("--saved", action="store_true", help="run nothing: the table of the stored runs")
    args = parser.parse_args(argv)
    runs = []
    for label in RUNS:
        if args.only is not None and label not in args.only:
            continue
        path = args.out / f"{label}.json"
        if not args.saved and (args.force or not path.exists()):
            print(f"[memory] {label}", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", label, str(path)], check=True,
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if path.exists():
            runs.append(json.loads(path.read_text()))
    print(f"{runs[0]['model']}; {runs[0]['world_size']} ranks; MiB per rank, mean over the ranks\n")
    print(summarize(runs))


if __name__ == "__main__":
    main()
