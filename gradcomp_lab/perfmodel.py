"""The TernGrad-style performance model (Wen et al., NIPS 2017, section 5): step time and throughput.

Lightweight profiling on one machine plus an analytical communication model:

* **compute**: forward + backward + update of one worker's batch, profiled here (:func:`profile_compute`) or
  estimated from a FLOP count and a device's effective FLOP/s (:class:`Device`, for GPUs we do not have);
* **codec**: compression and decoding, measured on random tensors of every parameter's shape
  (:func:`lightning_gradcomp.exchange.codec.measure_codec`), which also gives the exact bytes on the wire;
* **communication**: :mod:`lightning_gradcomp.exchange.costmodel` (ring collectives, alpha-beta, N ranks, one or two
  levels), with DDP's buckets each paying the per-message latency.

``step = compute + codec + communication`` (no overlap of communication with backward: an upper bound), and
``throughput = N * batch / step``. With ``overlap=True`` the step follows DDP's timeline instead: each bucket's
hook runs on the backward thread as the bucket fills (its statistics round, then compression), its collective
queues behind the previous bucket's, and the optimizer waits for the last one; the transfer hidden behind
backward is reported as ``hidden_s`` (a lower bound where the ranks share cores, since the hidden transfer's
decoding competes with backward for them). The paper's own formulas are in its supplementary material, which
we could not read (NOTES.md section 1.6), so this is our reconstruction; its error against the emulated
cluster is reported in docs/benchmarks.md.

Command line (``gradcomp-perf`` or ``python -m gradcomp_lab.perfmodel``)::

    gradcomp-perf predict --model alexnet --compressor terngrad --nproc 8 --link 1gbit --device gtx1080
    gradcomp-perf fig5 --out docs/img
    gradcomp-perf transformer --width 4096 --depth 32 --nproc 64 --gpus-per-node 8 --gpu h100
    gradcomp-perf transformer --width 2048 --depth 24 --nproc 16 --kernels benchmarks/results/gpu_h100/kernels.json
    gradcomp-perf validate

The AlexNet, GoogLeNet and VGG-A parameter shapes and FLOP counts are tables in this module (from the
published layer shapes), so predictions need neither the models nor a GPU. A transformer (``transformer``) is the
lab's GPT at any width, depth and context: compute from a GPU's published FLOP/s (or a measured step), each
compressor at the bytes and loss of its best setting on the stored language-model runs, the hierarchical exchange,
DiLoCo, and a model sharded by FSDP2 inside each node (HSDP with compressed shards between nodes, DiLoCo over the
shards); ``validate`` prints the model's error against the emulated cluster's stored step times.
"""

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_gradcomp.exchange.codec import Codec, Shapes, measure_codec
from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.exchange.costmodel import (
    Link,
    Network,
    hierarchical_allreduce_seconds,
    ring_allgather_seconds,
    ring_allreduce_seconds,
)
from lightning_gradcomp.validation import check_int

# -- parameter tables of the paper's models ------------------------------------------------------------------


def _conv(name: str, cin: int, cout: int, k: int, groups: int = 1) -> Shapes:
    return [(f"{name}.weight", (cout, cin // groups, k, k)), (f"{name}.bias", (cout,))]


def _fc(name: str, cin: int, cout: int) -> Shapes:
    return [(f"{name}.weight", (cout, cin)), (f"{name}.bias", (cout,))]


def alexnet_shapes() -> Shapes:
    """Krizhevsky et al. 2012 (two towers: conv2, conv4, conv5 grouped), 1000 classes: 61.0M parameters."""
    return (
        _conv("conv1", 3, 96, 11) + _conv("conv2", 96, 256, 5, 2) + _conv("conv3", 256, 384, 3)
        + _conv("conv4", 384, 384, 3, 2) + _conv("conv5", 384, 256, 3, 2)
        + _fc("fc6", 9216, 4096) + _fc("fc7", 4096, 4096) + _fc("fc8", 4096, 1000)
    )


def vgg_a_shapes() -> Shapes:
    """VGG configuration A (11 weight layers), 1000 classes: 132.9M parameters."""
    shapes: Shapes = []
    cin = 3
    for i, cout in enumerate((64, 128, 256, 256, 512, 512, 512, 512)):
        shapes += _conv(f"conv{i + 1}", cin, cout, 3)
        cin = cout
    return shapes + _fc("fc6", 512 * 7 * 7, 4096) + _fc("fc7", 4096, 4096) + _fc("fc8", 4096, 1000)


_INCEPTION = {  # in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj (Szegedy et al. 2015, Table 1)
    "3a": (192, 64, 96, 128, 16, 32, 32), "3b": (256, 128, 128, 192, 32, 96, 64),
    "4a": (480, 192, 96, 208, 16, 48, 64), "4b": (512, 160, 112, 224, 24, 64, 64),
    "4c": (512, 128, 128, 256, 24, 64, 64), "4d": (512, 112, 144, 288, 32, 64, 64),
    "4e": (528, 256, 160, 320, 32, 128, 128), "5a": (832, 256, 160, 320, 32, 128, 128),
    "5b": (832, 384, 192, 384, 48, 128, 128),
}


def googlenet_shapes() -> Shapes:
    """GoogLeNet (Inception v1) without auxiliary classifiers, 1000 classes: 7.0M parameters."""
    shapes = _conv("conv1", 3, 64, 7) + _conv("conv2_reduce", 64, 64, 1) + _conv("conv2", 64, 192, 3)
    for name, (cin, b1, r3, b3, r5, b5, bp) in _INCEPTION.items():
        p = f"inception{name}"
        shapes += _conv(f"{p}.1x1", cin, b1, 1) + _conv(f"{p}.3x3_reduce", cin, r3, 1) + _conv(f"{p}.3x3", r3, b3, 3)
        shapes += _conv(f"{p}.5x5_reduce", cin, r5, 1) + _conv(f"{p}.5x5", r5, b5, 5) + _conv(f"{p}.pool_proj", cin, bp, 1)
    return shapes + _fc("fc", 1024, 1000)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the performance model sees it: parameter shapes, forward MACs per image, the paper's batch."""

    shapes: Callable[[], Shapes]
    forward_macs: float
    batch: int


#: the models of the paper's Fig. 5; MACs per 224x224 (AlexNet 227x227) image, per-GPU batch of Fig. 5
PAPER_MODELS: dict[str, ModelSpec] = {
    "alexnet": ModelSpec(alexnet_shapes, 0.72e9, 128),
    "googlenet": ModelSpec(googlenet_shapes, 1.5e9, 64),
    "vgg_a": ModelSpec(vgg_a_shapes, 7.6e9, 32),
}


@dataclass(frozen=True)
class Device:
    """A GPU for FLOP-count compute estimates (we cannot profile it here: an assumption, not a measurement).

    Attributes:
        flops: published peak FLOP/s at the precision training runs at: fp32 for the GPUs without tensor cores
            (``gtx1080``, ``p100``), dense (not sparse) bf16/fp16 tensor-core FLOP/s for the others.
        efficiency: fraction of peak reached by training (cuDNN-era convnets: about 0.4-0.5; a transformer's
            model FLOP utilisation: about 0.3-0.5, 0.4 assumed).
        memory_bandwidth: bytes/s, bounds the compression kernels (read 4 bytes, write a fraction, per element).
    """

    flops: float
    efficiency: float = 0.45
    memory_bandwidth: float = 300e9

    def train_seconds(self, forward_macs: float, batch: int) -> float:
        # 2 FLOP per MAC, backward about twice the forward
        return 3 * 2 * forward_macs * batch / (self.flops * self.efficiency)

    def codec_seconds_per_element(self) -> float:
        return 8.0 / self.memory_bandwidth  # read the fp32 gradient, write/read the packed codes


#: the vendors' data-sheet numbers (SXM parts for A100/H100/H200; A100 80 GB)
DEVICES = {
    "gtx1080": Device(8.9e12, 0.45, 320e9),
    "p100": Device(10.6e12, 0.45, 732e9),
    "t4": Device(65e12, 0.4, 320e9),
    "v100": Device(125e12, 0.4, 900e9),
    "a100": Device(312e12, 0.4, 2.0e12),
    "l4": Device(121e12, 0.4, 300e9),
    "rtx4090": Device(165e12, 0.4, 1.0e12),
    "h100": Device(989e12, 0.4, 3.35e12),
    "h200": Device(989e12, 0.4, 4.8e12),
}


#: each compressor's group compress and group decode rows in a stored ``benchmarks/kernels.py`` run (what the hook
#: runs per bucket); the compressors not named have no kernel rows
KERNEL_ROWS: dict[str, tuple[str, str]] = {
    "terngrad": ("group compress packed", "group decode packed"),
    "graddrop": ("graddrop group compress", "graddrop group decode"),
    "adacomp": ("adacomp group compress", "adacomp group decode"),
    "topk": ("topk compress", "topk decode"),
    "dgc": ("dgc compress", "dgc decode"),
}
#: the hook compresses one DDP bucket at a time (25 MB of fp32): the stored size nearest it is used
_BUCKET_ELEMENTS = 25 * 2**20 // 4


@dataclass(frozen=True)
class KernelThroughput:
    """Codec seconds per element measured on a device, from a stored ``benchmarks/kernels.py`` run.

    Attributes:
        source: the stored run's file.
        device: what ran the kernels: the GPU a CUDA run names, else the run's machine.
        size: elements of the group whose rows are used (the stored size nearest a 25 MB DDP bucket).
        seconds: compressor -> (compress, decode) seconds per fp32 element, for the compressors with both rows.
    """

    source: str
    device: str
    size: int
    seconds: dict[str, tuple[float, float]]

    def per_element(self, compressor: str, assumed_s: float) -> tuple[float, float]:
        """(compress, decode) seconds per element of ``compressor``: measured, or ``assumed_s`` for both where the
        run has no rows for it (:meth:`assumed` names those)."""
        return self.seconds.get(compressor, (assumed_s, assumed_s))

    def assumed(self, compressors: Sequence[str]) -> list[str]:
        """The compressors of ``compressors`` the run has no rows for (their cost stays the memory-bound one)."""
        return [name for name in compressors if name not in self.seconds]


def load_kernels(path: Union[str, Path]) -> KernelThroughput:
    """The codec throughput of a stored kernel run (``benchmarks/kernels.py --json``), for ``gradcomp-perf``.

    Each compressor of :data:`KERNEL_ROWS` takes its group compress and group decode rows' measured GB/s (GB of
    fp32 gradient per second, the column the kernel column of the run reports) at the stored size nearest a DDP
    bucket of 25 MB. A compressor without both rows at that size is left out (its cost stays the memory-bound
    assumption; :meth:`KernelThroughput.assumed`).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a kernel run (no ``rows``), or holds none of the rows of :data:`KERNEL_ROWS`.
    """
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Expected `--kernels` to name a stored kernel run, but got {str(path)!r}, which does "
                                f"not exist. Fix: e.g. benchmarks/results/gpu_h100/kernels.json.")
    run = json.loads(path.read_text())
    rows = run.get("rows") if isinstance(run, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"Expected `--kernels` to be the JSON of `benchmarks/kernels.py --json`, with `rows`, but got "
                         f"{str(path)!r} without them. Fix: give a stored kernel run.")
    gbps: dict[tuple[str, int], float] = {(row["kernel"], int(row["size"])): float(row["fused"]["gbps"])
                                          for row in rows if row.get("fused")}
    wanted = {name for pair in KERNEL_ROWS.values() for name in pair}
    sizes = sorted({size for name, size in gbps if name in wanted})
    if not sizes:
        raise ValueError(f"Expected `--kernels` {str(path)!r} to hold a compressor's group rows "
                         f"({', '.join(sorted(wanted))}), but got none of them. Fix: run benchmarks/kernels.py "
                         f"without --only.")
    size = min(sizes, key=lambda n: abs(math.log(n / _BUCKET_ELEMENTS)))
    seconds = {compressor: (4.0 / (gbps[encode, size] * 1e9), 4.0 / (gbps[decode, size] * 1e9))
               for compressor, (encode, decode) in KERNEL_ROWS.items()
               if (encode, size) in gbps and (decode, size) in gbps}
    machine = str(run.get("machine", "unknown"))
    # a CUDA run's machine ends with the GPU's name (benchmarks/kernels.py)
    device = machine.rsplit(", ", 1)[-1] if "--device cuda" in str(run.get("command", "")) else machine
    return KernelThroughput(str(path), device, size, seconds)


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs per node joined inside a node by ``intra`` and across nodes by ``inter`` (one NIC per node)."""

    gpus_per_node: int
    intra: Link
    inter: Link
    device: str

    def network(self, world_size: int) -> Network:
        if world_size <= self.gpus_per_node:
            return Network(self.intra)
        return Network(self.intra, sites=max(1, world_size // self.gpus_per_node), wan=self.inter)


#: Fig. 5: (a) 4x GTX 1080 per node on one PCI switch, 1 Gbps Ethernet; (b) 4x P100 per node, NVLink, 100 Gbps
#: InfiniBand (NOTES.md section 1.6). Link latencies and the PCIe/NVLink rates are our assumptions.
PAPER_CLUSTERS: dict[str, ClusterSpec] = {
    "a": ClusterSpec(4, Link(80e9, 10e-6), Link(1e9, 50e-6), "gtx1080"),
    "b": ClusterSpec(4, Link(320e9, 5e-6), Link(100e9, 5e-6), "p100"),
}


# -- measurements on this machine ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ComputeTime:
    """One worker's compute per step, split where DDP's communication can hide behind it.

    Attributes:
        forward_s: zeroing the gradients and the forward pass (nothing to send yet).
        backward_s: the backward pass, during which buckets fill and their collectives start.
        update_s: the optimizer step, after the last collective.
    """

    forward_s: float
    backward_s: float
    update_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s

    @classmethod
    def from_total(cls, total_s: float, like: Optional["ComputeTime"] = None) -> "ComputeTime":
        """``total_s`` split in the proportions of ``like`` (a profile), else as FLOP counts split a step:
        backward twice the forward, no update (:meth:`Device.train_seconds`)."""
        if like is None or like.total_s <= 0:
            return cls(total_s / 3, 2 * total_s / 3)
        k = total_s / like.total_s
        return cls(like.forward_s * k, like.backward_s * k, like.update_s * k)

    def scaled(self, factor: float) -> "ComputeTime":
        return ComputeTime(self.forward_s * factor, self.backward_s * factor, self.update_s * factor)


def profile_compute(
    model: nn.Module, batch: int, input_shape: Sequence[int], classes: int = 10, steps: int = 3, warmup: int = 1
) -> ComputeTime:
    """Median seconds of forward, backward and SGD update of ``model`` on one batch, on this machine's threads."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *input_shape, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    parts: list[tuple[float, float, float]] = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    timed = parts[warmup:]
    return ComputeTime(*(statistics.median(p[k] for p in timed) for k in range(3)))


def fp32_codec(numel: int, bytes_per_element: float = 4.0) -> Codec:
    """Plain all-reduce (DDP): no compute, ``bytes_per_element`` per gradient element (2 for bf16)."""
    return Codec(bytes_per_element * numel, Aggregation.SUM)


def measure_cast_codec(numel: int, world_size: int, dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> Codec:
    """DDP's cast-compression hook (e.g. a bf16 all-reduce), timed here on ``numel`` elements.

    Encoding is the cast of the fp32 bucket; decoding is the cast back with the division by N, plus the
    ``(N - 1) / N * numel`` additions in ``dtype`` that each rank of the ring all-reduce computes on the CPU
    (Gloo sums bf16 in software; they run during the collective, as the decoding does, after the payload).
    """
    check_int("numel", numel, minimum=1)
    check_int("world_size", world_size, minimum=1)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen)
    summed = numel * (world_size - 1) // world_size
    received = torch.randn(summed, generator=gen).to(dtype)  # the peers' chunks, in Gloo's receive buffers
    bucket = grad.clone()  # DDP's bucket, already touched: the hook writes the average back into it
    encode, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        half = grad.to(dtype)
        encode.append(time.perf_counter() - start)
        start = time.perf_counter()
        if summed:
            half[:summed].add_(received)
        bucket.copy_(half.float().div_(world_size))
        decode.append(time.perf_counter() - start)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return Codec(float(itemsize * numel), Aggregation.SUM, statistics.median(encode), statistics.median(decode))


# -- prediction ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """Predicted step of one configuration.

    ``step_s = compute_s + codec_s + comm_s - hidden_s``: ``hidden_s`` is the communication and decoding that
    overlap backward on DDP's timeline (0 for the serial model).
    """

    world_size: int
    compute_s: float
    codec_s: float
    comm_s: float
    batch: int
    collective: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    hidden_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.codec_s + self.comm_s - self.hidden_s

    @property
    def throughput(self) -> float:
        """Samples per second over all workers."""
        return self.world_size * self.batch / self.step_s


Buckets = Union[int, Sequence[float]]


def bucket_fractions(buckets: Buckets) -> list[float]:
    """``buckets`` as each bucket's fraction of the step's gradient, in the order backward fills them: a count
    means that many equal buckets; fractions (e.g. from :func:`ddp_bucket_fractions`) are normalised."""
    if isinstance(buckets, int):
        return [1.0 / max(1, buckets)] * max(1, buckets)
    fractions = [float(f) for f in buckets]
    if not fractions or min(fractions) < 0 or sum(fractions) <= 0:
        raise ValueError(f"buckets={list(buckets)!r}: give a count or non-negative fractions with a positive sum")
    total = sum(fractions)
    return [f / total for f in fractions]


def ddp_bucket_fractions(shapes: Shapes, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                         bytes_per_element: int = 4) -> list[float]:
    """DDP's bucket assignment of ``shapes`` (given in the model's parameter order): parameters are taken in
    reverse, the order backward produces their gradients, and a bucket closes once it holds ``first_bucket_mb``
    (the first) or ``bucket_cap_mb`` (the others), so a parameter larger than the cap ends a bucket of its own
    making. Returns each bucket's fraction of the parameters, first-filled first."""
    sizes, current, limit = [], 0, first_bucket_mb * 2**20
    for _, shape in reversed(shapes):
        current += math.prod(shape)
        if current * bytes_per_element >= limit:
            sizes.append(current)
            current, limit = 0, bucket_cap_mb * 2**20
    if current:
        sizes.append(current)
    return bucket_fractions(sizes)


def _bucket_seconds(codec: Codec, world_size: int, network: Network, fraction: float,
                    two_level_allreduce: bool = True) -> tuple[float, float]:
    """Seconds of one bucket's payload collective (``fraction`` of the step's bytes) and of its blocking
    statistics rounds."""
    if world_size <= 1:
        return 0.0, 0.0
    nbytes = codec.nbytes * fraction
    if codec.aggregation is Aggregation.SUM:
        payload = ring_allreduce_seconds(nbytes, world_size, network)
        if two_level_allreduce:
            payload = min(payload, hierarchical_allreduce_seconds(nbytes, world_size, network))
    else:
        payload = ring_allgather_seconds(nbytes, world_size, network)
    return payload, codec.rounds * ring_allreduce_seconds(4.0, world_size, network)


def comm_seconds(codec: Codec, world_size: int, network: Network, buckets: Buckets = 1,
                 two_level_allreduce: bool = True) -> float:
    """Seconds to exchange one step's payloads in ``buckets`` collectives (each pays the latency terms).

    Args:
        codec: the step's payload: bytes, aggregation, statistics rounds.
        world_size: ranks in the flat process group.
        network: one link class, or sites joined by a WAN.
        buckets: DDP's buckets (a count, or each bucket's share of the step's bytes).
        two_level_allreduce: on a network of sites, whether the backend's all-reduce over the flat group may run
            the two-level schedule (:func:`~lightning_gradcomp.exchange.costmodel.hierarchical_allreduce_seconds`) when it
            is faster. NCCL arranges its inter-node algorithms by node, so the GPU predictions allow it. Gloo
            runs one ring over the ranks whatever the topology; every step of that ring crosses the WAN. Give
            ``False`` to predict Gloo, as the emulated cluster runs it.
    """
    return sum(sum(_bucket_seconds(codec, world_size, network, f, two_level_allreduce))
               for f in bucket_fractions(buckets))


def hierarchical_comm_seconds(codec: Codec, dense_bytes: float, world_size: int, network: Network,
                              buckets: Buckets = 1) -> float:
    """Seconds of one step of the hierarchical exchange (:mod:`lightning_gradcomp.sites.hierarchy`) on a two-level
    ``network`` (``sites`` equal sites joined by ``wan``), bucket by bucket as the hook runs them:

    * a dense reduce of each share to its owner inside each site (``network.link``: the site's mean in) and a
      gather of the decoded shares (out): together the bytes of one ring all-reduce of the bucket, taken at its
      time (for ``k = 2``, the bucket each way; the all-to-alls' latency is one step each, the ring's ``k - 1``);
    * the compressor's collectives between sites (``codec`` measured for ``sites`` workers): the ``k`` local ranks
      each send their share at once over their site's one WAN link, so together they put ``codec.nbytes`` (the
      whole step's payload, as one flat rank would) on it; its statistics rounds cross the WAN once each.
    """
    k = world_size // _sites(network)
    lan = Network(network.link)
    fractions = bucket_fractions(buckets)
    return sum(ring_allreduce_seconds(dense_bytes * f, k, lan) for f in fractions) + _between_sites_seconds(
        codec, network, fractions)


def _sites(network: Network) -> int:
    """The sites of a two-level ``network``, refusing a flat one."""
    if network.sites < 2 or network.wan is None:
        raise ValueError(f"Expected a network of at least 2 sites joined by a WAN, but got {network}. Fix: "
                         f"`Network(lan, sites=2, wan=Link(...))`.")
    return network.sites


def _between_sites_seconds(codec: Codec, network: Network, fractions: Sequence[float]) -> float:
    """The compressor's collectives between the sites, bucket by bucket, over the WAN (``codec``: the whole step's
    payload measured for ``network.sites`` workers, the share of every rank of a site together on its one link)."""
    assert network.wan is not None
    wan = Network(network.wan)
    return sum(sum(_bucket_seconds(codec, network.sites, wan, f)) for f in fractions)


def fsdp_unit_fractions(shapes: Shapes, block_prefix: str = "blocks.") -> list[float]:
    """The FSDP2 units of a model sharded as the lab's tasks shard it (``fully_shard`` on each block, then on the
    root: ``gradcomp_lab/tasks/base.py``), as each unit's share of the parameters in the order backward
    reduce-scatters them: the last block first, the root (embeddings, final norm: the parameters outside the
    blocks) last."""
    blocks: dict[str, int] = {}
    root = 0
    for name, shape in shapes:
        if name.startswith(block_prefix):
            unit = name[len(block_prefix):].split(".")[0]
            blocks[unit] = blocks.get(unit, 0) + math.prod(shape)
        else:
            root += math.prod(shape)
    return bucket_fractions([*reversed(blocks.values()), root])


def sharded_comm_seconds(codec: Codec, dense_bytes: float, world_size: int, network: Network, units: Buckets = 1,
                         sync_every: int = 1, regather: bool = True) -> float:
    """Seconds per step of the sharded exchange on a two-level ``network`` whose sites are the replicas
    (``network.sites`` replicas of ``world_size / sites`` shards): ``ShardedGradCompStrategy`` (HSDP), or with
    ``sync_every`` = H > 1 DiLoCo over the shards (``ShardedDiLoCoStrategy``). Unit by unit as FSDP2 runs them:

    * inside a replica, every step, FSDP2's dense collectives over ``network.link`` on each unit's fp32 bytes: the
      all-gather of its parameters (forward) and the reduce-scatter of its gradient (backward), together one ring
      all-reduce's time (its two halves); with ``regather`` (FSDP2's default ``reshard_after_forward``) every unit
      but the last (the root, reduced last, keeps its parameters) all-gathers them once more in backward;
    * between replicas, every ``sync_every`` steps, each rank's shard through the compressor: ``codec`` is the
      whole model's payload measured for ``network.sites`` workers, since the replica's ranks each send their shard
      at once over its one link (the same between-sites term as :func:`hierarchical_comm_seconds`).

    Serial: nothing hidden behind compute (FSDP2 prefetches the next unit's all-gather, so an upper bound). With
    ``sync_every=1`` and no ``regather`` it equals :func:`hierarchical_comm_seconds`: the hierarchical exchange
    moves the same bytes (a reduce to each share's owner, the shares between sites, a gather).
    """
    check_int("sync_every", sync_every, minimum=1)
    k = world_size // _sites(network)
    lan = Network(network.link)
    fractions = bucket_fractions(units)
    inside = sum(ring_allreduce_seconds(dense_bytes * f, k, lan) for f in fractions)
    if regather:
        inside += sum(ring_allgather_seconds(dense_bytes * f / k, k, lan) for f in fractions[:-1])
    return inside + _between_sites_seconds(codec, network, fractions) / sync_every


def cross_node_fsdp_comm_seconds(between_bytes: float, dense_bytes: float, world_size: int, network: Network,
                                 units: Buckets = 1, reduce_scatter: bool = False, all_gather: bool = False,
                                 regather: bool = True) -> float:
    """Seconds per step of FSDP2 over every rank of ``network.sites`` nodes (a model sharded across nodes), unit by
    unit, serial (FSDP2's prefetching hides some of it: an upper bound):

    * stock (``reduce_scatter`` and ``all_gather`` False): each unit's reduce-scatter of its fp32 gradient and
      all-gather of its parameters are flat rings over every rank, at the slowest link they cross (the WAN); with
      ``regather`` every unit but the last (the root) all-gathers once more in backward;
    * ``reduce_scatter`` (``compress_across_nodes=True``): the reduce-scatter is dense over the node's ranks on the
      fast link, then between nodes; ``all_gather`` (``quantize_weights=True``): the all-gather is between nodes,
      then dense over the node's ranks. What crosses between nodes is ``between_bytes`` per rank and step (the
      ledgers' ``bytes_per_step``, measured), the node's ranks sharing its one WAN link, one message per
      collective; a collective not compressed stays the stock flat ring.
    """
    k = world_size // _sites(network)
    lan = Network(network.link)
    fractions = bucket_fractions(units)
    seconds, messages = 0.0, 0
    for i, f in enumerate(fractions):
        gathers = 1 + (regather and i < len(fractions) - 1)
        if reduce_scatter:  # half a ring all-reduce over the node: the reduce-scatter
            seconds += ring_allreduce_seconds(dense_bytes * f, k, lan) / 2
            messages += 1
        else:
            seconds += ring_allreduce_seconds(dense_bytes * f, world_size, network) / 2
        if all_gather:  # the node's pieces (one per node) of each rank, gathered over the node
            seconds += gathers * ring_allgather_seconds(dense_bytes * f / k, k, lan)
            messages += gathers
        else:
            seconds += gathers * ring_allgather_seconds(dense_bytes * f / world_size, world_size, network)
    if messages:
        assert network.wan is not None
        seconds += messages * (_sites(network) - 1) * network.wan.latency + 8.0 * k * between_bytes / network.wan.bandwidth
    return seconds


def _timeline_seconds(compute: ComputeTime, encode_s: float, decode_s: float, codec: Codec, world_size: int,
                      network: Network, fractions: list[float]) -> float:
    """DDP's step, buckets filling over backward in proportion to their parameters (exact for fully connected
    layers; behind convolutions, which hold more compute per parameter, fully connected layers are ready
    earlier than this assumes, so for convolutional networks the hidden share is a lower estimate).

    The hook blocks backward for the bucket's statistics round and compression; the collective then waits for
    the previous bucket's (one communication queue per process group) and its payloads are decoded as they
    arrive; the update starts when backward and the last decode are done.
    """
    backward = compute.forward_s  # the backward thread's clock
    queue = 0.0  # when the communication queue is free
    for f in fractions:
        payload, stat = _bucket_seconds(codec, world_size, network, f)
        backward += compute.backward_s * f + stat + encode_s * f
        queue = max(queue, backward) + payload + decode_s * f
    return max(backward, queue) + compute.update_s


def predict(
    compute_s: Union[float, ComputeTime],
    codec: Codec,
    world_size: int,
    network: Network,
    batch: int,
    buckets: Buckets = 1,
    cpu_share: float = 1.0,
    collective: str = "",
    overlap: bool = False,
    hierarchical_dense_bytes: Optional[float] = None,
) -> Prediction:
    """Step time and throughput of one configuration.

    Args:
        compute_s: forward + backward + update of one worker's batch, alone on its device: seconds, or a
            :class:`ComputeTime` (a total is split as :meth:`ComputeTime.from_total` does).
        codec: the compressor's bytes and compute per step.
        world_size: N workers.
        network: the links between them.
        batch: samples per worker per step.
        buckets: DDP's buckets (each collective pays the latency): a count of equal buckets, or each bucket's
            share of the gradient in the order backward fills them (:func:`ddp_bucket_fractions`).
        cpu_share: fraction of a device each worker gets (N ranks emulated on fewer cores: cores / N).
        collective: a label for the report.
        overlap: follow DDP's timeline (communication behind backward) instead of adding it to compute.
        hierarchical_dense_bytes: the hierarchical exchange (:func:`hierarchical_comm_seconds`) of a gradient of
            this many fp32 bytes, on ``network``'s sites; ``codec`` is then measured for the number of sites. Its
            hook blocks on every bucket, so nothing is hidden behind backward (``overlap`` is refused).
    """
    if hierarchical_dense_bytes is not None and overlap:
        raise ValueError("Expected `overlap=False` with `hierarchical_dense_bytes` (the hierarchical hook blocks on "
                         "every bucket), but got overlap=True. Fix: drop `overlap`.")
    slow = 1.0 / cpu_share
    compute = compute_s if isinstance(compute_s, ComputeTime) else ComputeTime.from_total(compute_s)
    compute = compute.scaled(slow)
    encode, decode = codec.encode_s * slow, codec.decode_s * slow
    fractions = bucket_fractions(buckets)
    if hierarchical_dense_bytes is not None:
        comm = hierarchical_comm_seconds(codec, hierarchical_dense_bytes, world_size, network, fractions)
    else:
        comm = comm_seconds(codec, world_size, network, fractions)
    hidden = 0.0
    if overlap:
        serial = compute.total_s + encode + decode + comm
        hidden = serial - _timeline_seconds(compute, encode, decode, codec, world_size, network, fractions)
    return Prediction(world_size, compute.total_s, encode + decode, comm, batch, collective or codec.aggregation.value,
                      hidden_s=hidden)


def best_terngrad_codec(
    numel: int, world_size: int, network: Network, per_element_s: float, buckets: Buckets, wide_sums: bool = False
) -> tuple[str, Codec]:
    """TernGrad's cheapest collective, as the planner picks it: packed all-gather, int8 all-reduce (N <= 127),
    or plain fp32 all-reduce where compression would not pay.

    ``wide_sums`` adds an int16 all-reduce of the ternary sums beyond 127 ranks: a what-if (the library's hook
    has no int16 form), to show what the paper's large-scale points need.
    """
    packed = Codec(numel / 4 + 0.0, Aggregation.GATHER, per_element_s * numel, per_element_s * numel * world_size / 4, 1)
    options = {"allgather": packed, "allreduce_fp32": fp32_codec(numel)}
    if world_size <= 127:
        options["allreduce_int8"] = Codec(float(numel), Aggregation.SUM, per_element_s * numel, per_element_s * numel, 1)
    elif wide_sums:
        options["allreduce_int16"] = Codec(2.0 * numel, Aggregation.SUM, per_element_s * numel, per_element_s * numel, 1)
    name = min(options, key=lambda k: comm_seconds(options[k], world_size, network, buckets) + options[k].encode_s + options[k].decode_s)
    return name, options[name]


def paper_curve(model: str, cluster: str, workers: Sequence[int], method: str) -> list[Prediction]:
    """Fig. 5 points: throughput of ``method`` for each number of GPUs.

    ``method``: ``"fp32"``, ``"terngrad"`` (the library's collectives, as the planner picks them) or
    ``"terngrad_int16"`` (the same plus int16 sums beyond 127 ranks, a what-if).
    """
    spec = PAPER_MODELS[model]
    setting = PAPER_CLUSTERS[cluster]
    device = DEVICES[setting.device]
    numel = sum(math.prod(s) for _, s in spec.shapes())
    compute = device.train_seconds(spec.forward_macs, spec.batch)
    buckets = max(1, math.ceil(4 * numel / (25 * 2**20)))  # DDP's 25 MiB buckets
    points = []
    for n in workers:
        net = setting.network(n)
        if method == "fp32":
            codec, name = fp32_codec(numel), "allreduce_fp32"
        else:
            wide = method == "terngrad_int16"
            name, codec = best_terngrad_codec(numel, n, net, device.codec_seconds_per_element(), buckets, wide)
        points.append(predict(compute, codec, n, net, spec.batch, buckets, collective=name))
    return points


def draw_fig5(out_dir: str, workers: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)) -> list[str]:
    """Fig. 5-style plots (throughput vs GPUs, fp32 vs TernGrad) for both clusters; returns the PNG paths."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for cluster, title in (("a", "(a) 4x GTX 1080 per node, PCIe, 1 Gbps Ethernet"), ("b", "(b) 4x P100 per node, NVLink, 100 Gbps IB")):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for ax, model in zip(axes, PAPER_MODELS):
            labels = {"fp32": "FP32", "terngrad": "TernGrad", "terngrad_int16": "TernGrad + int16 sums (what-if)"}
            for method, style in (("fp32", "o-"), ("terngrad_int16", "^:"), ("terngrad", "s--")):
                pts = paper_curve(model, cluster, workers, method)
                ax.plot(list(workers), [p.throughput for p in pts], style, label=labels[method])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(model)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("images/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"Predicted throughput {title} (gradcomp_lab.perfmodel)")
        fig.tight_layout()
        path = os.path.join(out_dir, f"fig5{cluster}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _fig5_table(workers: Sequence[int]) -> None:
    print("| cluster | model | GPUs | FP32 img/s | TernGrad img/s | speed-up | TernGrad collective | +int16 what-if speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for cluster in PAPER_CLUSTERS:
        for model in PAPER_MODELS:
            fp = paper_curve(model, cluster, workers, "fp32")
            tg = paper_curve(model, cluster, workers, "terngrad")
            wide = paper_curve(model, cluster, workers, "terngrad_int16")
            for a, b, c in zip(fp, tg, wide):
                print(f"| {cluster} | {model} | {a.world_size} | {a.throughput:.0f} | {b.throughput:.0f} | "
                      f"{b.throughput / a.throughput:.2f} | {b.collective} | {c.throughput / a.throughput:.2f} |")


# -- transformers ------------------------------------------------------------------------------------------------
def gpt_shapes(width: int, depth: int, vocab: int = 50257, context: int = 2048) -> Shapes:
    """Parameter shapes of ``gradcomp_lab.models.GPT`` (GPT-2 layout: pre-norm blocks, a 4x MLP, tied embeddings).

    ``gpt_shapes(64, 2, 256, 64)`` is the stored language-model runs' model: 120,576 parameters.
    """
    for name, value in (("width", width), ("depth", depth), ("vocab", vocab), ("context", context)):
        check_int(name, value, minimum=1)
    # in the model's parameter order, which DDP's bucket assignment follows
    shapes: Shapes = [("token_embedding.weight", (vocab, width)), ("position_embedding.weight", (context, width))]
    for i in range(depth):
        b = f"blocks.{i}"
        shapes += [(f"{b}.{norm}.{p}", (width,)) for norm in ("ln1", "ln2") for p in ("weight", "bias")]
        shapes += _fc(f"{b}.attn.qkv", width, 3 * width) + _fc(f"{b}.attn.proj", width, width)
        shapes += _fc(f"{b}.mlp.0", width, 4 * width) + _fc(f"{b}.mlp.2", 4 * width, width)
    return shapes + [("ln_f.weight", (width,)), ("ln_f.bias", (width,))]


def transformer_train_flops(width: int, depth: int, seq_len: int, batch: int, vocab: int = 50257) -> float:
    """FLOPs of one worker's training step (forward and backward) on ``batch`` sequences of ``seq_len`` tokens.

    PaLM's count (Chowdhery et al. 2022, appendix B): ``6 N`` per token for the weights' matrix products, the
    tied output projection included and the position embeddings not (a lookup), plus ``12 depth seq_len width``
    per token for the attention scores and their weighted sum.
    """
    shapes = gpt_shapes(width, depth, vocab, seq_len)
    matmul_params = sum(math.prod(shape) for name, shape in shapes if name != "position_embedding.weight")
    tokens = seq_len * batch
    return tokens * (6.0 * matmul_params + 12.0 * depth * seq_len * width)


def results_dir() -> Path:
    """The stored benchmark results (the run files the tables and this model read) in this checkout."""
    root = Path(__file__).resolve().parents[1]
    for candidate in (root / "benchmarks" / "results", root / "docs" / "data"):
        if (candidate / "lm_long").is_dir():
            return candidate
    raise FileNotFoundError(f"Expected the stored results under {root / 'benchmarks' / 'results'}, but found none. "
                            f"Fix: run from a checkout of the repository (the results are not in the wheel).")


def _load_run(directory: Path, label: str) -> dict[str, Any]:
    import json

    path = directory / f"{label}.json"
    if not path.is_file():
        raise FileNotFoundError(f"Expected the stored run {path}, but it does not exist. Fix: restore it from git.")
    run: dict[str, Any] = json.loads(path.read_text())
    return run


@dataclass(frozen=True)
class StoredSetting:
    """One way to train the transformer, as measured on 4 CPU ranks (the language-model benchmark's 2000 steps).

    Attributes:
        name: the registered compressor (``"ddp"``: DDP in fp32, the reference).
        run: the stored run (under ``lm_long/``) whose bytes and loss the model reports.
        setting: what the run sets beyond the registered defaults.
        reference: the DDP run its loss is compared with (the same warm-up).
    """

    name: str
    run: str
    setting: str
    reference: str = "ddp"


#: each compressor at its best setting found on the language-model benchmark (docs/transformers.md)
LM_SETTINGS: tuple[StoredSetting, ...] = (
    StoredSetting("ddp", "ddp", "fp32 all-reduce"),
    StoredSetting("bf16", "bf16", "bf16 all-reduce"),
    StoredSetting("int8", "int8", "shared scale, int8 all-reduce"),
    StoredSetting("qsgd", "qsgd_s31", "31 levels"),
    StoredSetting("terngrad", "terngrad_fp32emb_clip1_b64", "scaler per 64, clip 1 sigma, fp32 embeddings"),
    StoredSetting("graddrop", "graddrop_0.8_global_dense100", "drop 0.8, global threshold, 100 dense steps"),
    StoredSetting("powersgd", "powersgd_r16", "rank 16 (width / 4)"),
    StoredSetting("onebit", "onebit_fp32emb_dense100", "fp32 embeddings, 100 dense steps"),
    StoredSetting("topk", "topk_10pct_dense100", "10 %, 100 dense steps"),
    StoredSetting("dgc", "dgc_10pct_dense100", "10 %, 100 dense steps"),
    StoredSetting("adacomp", "adacomp_bin10_dense100", "bin 10, 100 dense steps"),
    StoredSetting("demo", "demo_c16_k8_u8_lr7e-3_warm300", "16x16 chunks, top-8, SignSGD lr 0.007, 300 warm-up",
                  "ddp_warm300"),
)


@dataclass(frozen=True)
class StoredMethod:
    """A stored setting's measured numbers.

    Attributes:
        setting: what was run.
        bytes_ratio: fp32 DDP's bytes per step over the run's.
        loss_vs_ddp: the run's final validation loss over its reference DDP run's, minus 1.
        measured_ranks: the run's world size.
        bytes_per_element: bytes per step per compressed parameter element (the layers sent in fp32 taken out).
        fp32_names: parameters the run sent uncompressed (``exclude``), by their name in the model.
    """

    setting: StoredSetting
    bytes_ratio: float
    loss_vs_ddp: float
    measured_ranks: int
    bytes_per_element: float
    fp32_names: tuple[str, ...] = ()


def _excluded(run: dict[str, Any]) -> tuple[str, ...]:
    for override in run.get("overrides", []):
        if override.startswith("--trainer.strategy.init_args.exclude="):
            names = override.partition("=")[2].strip("[]").split(",")
            return tuple(name.strip().removeprefix("model.") for name in names)  # the task holds the GPT as .model
    return ()


def stored_methods(directory: Optional[Path] = None) -> list[StoredMethod]:
    """:data:`LM_SETTINGS` with the bytes and the final validation loss against DDP of their stored runs."""
    long = (directory or results_dir()) / "lm_long"
    methods = []
    for setting in LM_SETTINGS:
        run, ref = _load_run(long, setting.run), _load_run(long, setting.reference)
        shapes = _recipe_gpt_shapes(run["recipe"])
        names = _excluded(run)
        dense = sum(math.prod(shape) for name, shape in shapes if name in names)
        per_element = (float(run["bytes_per_step"]) - 4.0 * dense) / (int(run["parameters"]) - dense)
        methods.append(StoredMethod(setting, run["fp32_bytes_per_step"] / run["bytes_per_step"],
                                    run["final_val_loss"] / ref["final_val_loss"] - 1.0, int(run["world_size"]),
                                    per_element, names))
    return methods


_STAND_IN: Shapes = [("w", (256, 256))]  # a layer on which each compressor shows its collective at N ranks


def stored_codec(method: StoredMethod, shapes: Shapes, world_size: int, per_element_s: float,
                 kernels: Optional[KernelThroughput] = None) -> Codec:
    """The step's payload of ``method`` for a model of ``shapes`` on ``world_size`` ranks.

    Bytes: the layers the stored run kept in fp32 (its embeddings) at 4 bytes an element, the others at the stored
    run's bytes per element, scaled by how the compressor's own bytes on a stand-in layer change from the measured
    ranks to ``world_size`` (TernGrad's planner turns to an int8 all-reduce from 8 ranks). Collective and
    statistics rounds: the compressor's at ``world_size``. Compute: the measured group compress and decode of
    ``kernels`` where it has the compressor's rows, else ``per_element_s`` per element to encode and as much to
    decode (memory-bound kernels: an assumption, low for PowerSGD's and DeMo's matrix products).
    """
    from lightning_gradcomp import registry

    numel = sum(math.prod(shape) for _, shape in shapes)
    if method.setting.name == "ddp":
        return fp32_codec(numel)
    at = measure_codec(registry.make_compressor(method.setting.name), _STAND_IN, world_size, timed=False)
    was = measure_codec(registry.make_compressor(method.setting.name), _STAND_IN, method.measured_ranks, timed=False)
    dense = sum(math.prod(shape) for name, shape in shapes if name in method.fp32_names)
    nbytes = 4.0 * dense + method.bytes_per_element * (numel - dense) * at.nbytes / was.nbytes
    if method.setting.name == "bf16":  # a cast, in the all-reduce's own kernels
        return Codec(nbytes, at.aggregation, 0.0, 0.0, at.rounds)
    encode, decode = (per_element_s, per_element_s) if kernels is None else \
        kernels.per_element(method.setting.name, per_element_s)
    return Codec(nbytes, at.aggregation, encode * numel, decode * numel, at.rounds)


def diloco_comm_seconds(codec: Codec, dense_bytes: float, world_size: int, network: Network, sync_every: int,
                        buckets: Buckets = 1) -> float:
    """Seconds per step of DiLoCo's communication: a dense all-reduce inside each site every step (DDP over
    ``network.link``), and every ``sync_every`` steps one exchange of the pseudo-gradients (``codec``) between
    sites: the hierarchical exchange where sites hold several ranks, the compressor's collective where each rank
    is a site. Blocking DiLoCo; Streaming DiLoCo hides part of the outer exchange behind the next inner steps,
    so this is its upper bound."""
    check_int("sync_every", sync_every, minimum=1)
    if network.sites == 1:  # every rank is a site: no inner exchange
        return comm_seconds(codec, world_size, network, buckets) / sync_every
    inner = comm_seconds(Codec(dense_bytes, Aggregation.SUM), world_size // network.sites, Network(network.link), buckets)
    return inner + hierarchical_comm_seconds(codec, dense_bytes, world_size, network, buckets) / sync_every


@dataclass(frozen=True)
class TransformerRow:
    """One method's projected step on one link, against DDP's on the same link."""

    method: str
    setting: str
    bytes_ratio: float
    loss_vs_ddp: float
    link: str
    prediction: Prediction
    speedup: float


def transformer_projection(
    width: int, depth: int, seq_len: int, batch: int, world_size: int, links: Sequence[str], device: str = "h100",
    vocab: int = 50257, step_s: Optional[float] = None, mfu: Optional[float] = None, gpus_per_node: int = 1,
    intra: str = "900gbit@5us", sync_every: Sequence[int] = (100,), directory: Optional[Path] = None,
    overlap: bool = False, kernels: Optional[KernelThroughput] = None,
) -> list[TransformerRow]:
    """Step time of DDP, each compressor at its stored setting, the hierarchical exchange and DiLoCo for a GPT on
    ``world_size`` GPUs, for each link in ``links`` (between nodes when ``gpus_per_node`` > 1, else per GPU).

    Args:
        width: the model's width.
        depth: its blocks.
        seq_len: tokens per sequence (also the context).
        batch: sequences per GPU per step.
        world_size: GPUs in all.
        links: link specs (``"100mbit"``, ``"1gbit"``, ``"10gbit@50us"``), one projection each.
        device: a :data:`DEVICES` name; its published FLOP/s times ``mfu`` give the compute.
        vocab: vocabulary size (tied embeddings).
        step_s: one GPU's measured compute step (forward, backward, update, no communication), which replaces the
            FLOP estimate.
        mfu: the model FLOP utilisation (default: the device's ``efficiency``).
        gpus_per_node: GPUs joined by ``intra`` inside a node; 2 or more adds the hierarchical rows and the
            sharded ones (FSDP2 over a node's GPUs, each compressor on the shards between nodes, DiLoCo over the
            shards: ``sharded ...``).
        intra: the link between the GPUs of a node.
        sync_every: DiLoCo's H values (one row each, fp32 and int8 pseudo-gradients).
        directory: the stored results (default: :func:`results_dir`).
        overlap: DDP's timeline for the flat rows (each bucket's exchange behind the rest of backward) instead of
            communication after compute; the hierarchical hook blocks on every bucket and DiLoCo's rows stay serial.
        kernels: a device's measured codec throughput (:func:`load_kernels`) for the compressors it has rows for;
            the others (and without it, all) assume memory-bound kernels at the device's ``memory_bandwidth``.

    Returns:
        One row per method and link; ``speedup`` is DDP's step over the method's on the same link. The hierarchical
        and sharded rows carry no loss (not measured on the language model).
    """
    check_int("world_size", world_size, minimum=2)
    check_int("gpus_per_node", gpus_per_node, minimum=1)
    if world_size % gpus_per_node:
        raise ValueError(f"Expected `world_size` to be a multiple of gpus_per_node={gpus_per_node}, but got "
                         f"{world_size}. Fix: give whole nodes.")
    gpu = DEVICES[device]
    if step_s is None:
        efficiency = gpu.efficiency if mfu is None else mfu
        if not 0 < efficiency <= 1:
            raise ValueError(f"Expected `mfu` in (0, 1], but got {mfu}. Fix: e.g. 0.4.")
        step_s = transformer_train_flops(width, depth, seq_len, batch, vocab) / (gpu.flops * efficiency)
    elif not step_s > 0:
        raise ValueError(f"Expected `step_s` (a measured step) > 0 seconds, but got {step_s}. Fix: give the step time.")
    shapes = gpt_shapes(width, depth, vocab, seq_len)
    numel = sum(math.prod(shape) for _, shape in shapes)
    buckets = ddp_bucket_fractions(shapes)
    per_element = gpu.codec_seconds_per_element()
    methods = stored_methods(directory)
    diloco_runs = _diloco_stored(directory or results_dir())
    rows: list[TransformerRow] = []
    for spec in links:
        link = Link.parse(spec)
        hier = gpus_per_node > 1
        net = Network(Link.parse(intra), sites=world_size // gpus_per_node, wan=link) if hier else Network(link)
        cases: list[tuple[str, StoredMethod, Prediction]] = []
        for method in methods:
            codec = stored_codec(method, shapes, world_size, per_element, kernels)
            at_n = replace(method, bytes_ratio=4.0 * numel / codec.nbytes)  # the collective at N may differ from 4's
            cases.append((method.setting.name, at_n,
                          predict(step_s, codec, world_size, net, batch, buckets, overlap=overlap)))
            if hier and method.setting.name != "ddp":
                site_codec = stored_codec(method, shapes, world_size // gpus_per_node, per_element, kernels)
                unmeasured = replace(method, bytes_ratio=4.0 * numel / site_codec.nbytes, loss_vs_ddp=math.nan)
                cases.append((f"hierarchical {method.setting.name}", unmeasured,
                              predict(step_s, site_codec, world_size, net, batch, buckets,
                                      hierarchical_dense_bytes=4.0 * numel)))
        ddp = cases[0][2]
        sites = world_size // gpus_per_node if hier else world_size
        for h in sync_every:
            for outer, ratio in (("ddp", 1.0), ("int8", 4.0)):  # DiLoCo's fp32 and INTELLECT-1's int8 rounds
                encoding = StoredMethod(StoredSetting(outer, "", ""), ratio, math.nan, 4, 4.0 / ratio)
                comm = diloco_comm_seconds(stored_codec(encoding, shapes, sites, per_element, kernels), 4.0 * numel,
                                           world_size, net, h, buckets)
                label = "fp32" if outer == "ddp" else outer
                setting = StoredSetting(f"diloco H={h} {label}", "", f"{label} pseudo-gradients every {h} steps")
                loss = diloco_runs.get((h, label), math.nan)
                # bytes between sites per step: one round's over H (the inner steps' dense traffic stays in a node)
                cases.append((setting.name, StoredMethod(setting, ratio * h, loss, 4, 4.0 / ratio),
                              Prediction(world_size, step_s, 0.0, comm, batch, "outer")))
        if hier:
            cases += _sharded_cases(methods, shapes, world_size, gpus_per_node, net, step_s, batch, per_element,
                                    sync_every, kernels)
        for name, method, p in cases:
            rows.append(TransformerRow(name, method.setting.setting, method.bytes_ratio, method.loss_vs_ddp, spec, p,
                                       ddp.step_s / p.step_s))
    return rows


def _sharded_cases(methods: Sequence[StoredMethod], shapes: Shapes, world_size: int, shard_size: int, net: Network,
                   step_s: float, batch: int, per_element: float, sync_every: Sequence[int],
                   kernels: Optional[KernelThroughput] = None) -> list[tuple[str, StoredMethod, Prediction]]:
    """The sharded rows of :func:`transformer_projection`: FSDP2 over each node's ``shard_size`` GPUs (the lab's
    units: each block, then the root) with each compressor on the shards between nodes (``sharded fp32``: stock
    HSDP's dense all-reduce), and DiLoCo over the shards (:func:`sharded_comm_seconds`). Each rank encodes and
    decodes only its shard. Compute as DDP's: FSDP2's own overhead is not modelled. No loss: not measured on the
    language model."""
    numel = sum(math.prod(shape) for _, shape in shapes)
    units, sites, cases = fsdp_unit_fractions(shapes), world_size // shard_size, []
    for method in methods:
        codec = stored_codec(method, shapes, sites, per_element, kernels)
        name = "fp32" if method.setting.name == "ddp" else method.setting.name
        unmeasured = replace(method, bytes_ratio=4.0 * numel / codec.nbytes, loss_vs_ddp=math.nan)
        comm = sharded_comm_seconds(codec, 4.0 * numel, world_size, net, units)
        cases.append((f"sharded {name}", unmeasured, Prediction(world_size, step_s, (codec.encode_s + codec.decode_s)
                                                                / shard_size, comm, batch, "sharded")))
    for h in sync_every:
        for outer, ratio in (("ddp", 1.0), ("int8", 4.0)):
            encoding = StoredMethod(StoredSetting(outer, "", ""), ratio, math.nan, 4, 4.0 / ratio)
            codec = stored_codec(encoding, shapes, sites, per_element, kernels)
            label = "fp32" if outer == "ddp" else outer
            setting = StoredSetting(f"sharded diloco H={h} {label}", "",
                                    f"{label} pseudo-gradient shards every {h} steps")
            comm = sharded_comm_seconds(codec, 4.0 * numel, world_size, net, units, sync_every=h)
            cases.append((setting.name, StoredMethod(setting, ratio * h, math.nan, 4, 4.0 / ratio),
                          Prediction(world_size, step_s, 0.0, comm, batch, "outer")))
    return cases


def _diloco_stored(directory: Path) -> dict[tuple[int, str], float]:
    """DiLoCo's stored loss against DDP by (H, pseudo-gradient encoding), from the DiLoCo benchmark's runs."""
    found: dict[tuple[int, str], float] = {}
    folder = directory / "diloco"
    if not (folder / "ddp.json").is_file():
        return found
    ddp = _load_run(folder, "ddp")["final_val_loss"]
    for path in folder.glob("*.json"):
        for prefix, outer in (("diloco_h", "fp32"), ("int8_h", "int8")):
            if path.stem.startswith(prefix) and path.stem[len(prefix):].isdigit():
                found[(int(path.stem[len(prefix):]), outer)] = _load_run(folder, path.stem)["final_val_loss"] / ddp - 1
    return found


# -- validation against the emulated cluster ---------------------------------------------------------------------
@dataclass(frozen=True)
class Validation:
    """One stored emulated run re-predicted on another link from its own step on the first (the ``--step-ms`` use)."""

    benchmark: str
    run: str
    given_s: float
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Predicted over measured, minus 1."""
        return self.predicted_s / self.measured_s - 1.0


def _recipe_gpt_shapes(recipe: str) -> Shapes:
    import yaml

    model = yaml.safe_load((Path(__file__).resolve().parents[1] / recipe).read_text())["model"]["init_args"]["model"]
    args = model["init_args"]
    return gpt_shapes(args["width"], args["depth"], args["vocab_size"], args["context"])


def _strategy_arg(run: dict[str, Any], name: str) -> Any:
    """A strategy argument of a stored run: its command's override, else its recipe's value (``None``: neither)."""
    import yaml

    for override in run.get("overrides", []):
        if override.startswith(f"--trainer.strategy.init_args.{name}="):
            return yaml.safe_load(override.partition("=")[2])
    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / run["recipe"]).read_text())
    return recipe["trainer"]["strategy"].get("init_args", {}).get(name)


def _sharded_run_comm_seconds(run: dict[str, Any], network: Network) -> float:
    """:func:`sharded_comm_seconds` of a stored sharded run (``ShardedGradCompStrategy``, ``ShardedDiLoCoStrategy``):
    its bytes per rank (its shard's payload) times the shard size on each replica's link, over the FSDP2 units of
    its recipe's GPT."""
    import lightning_gradcomp.compressors as compressors

    n, numel, shard = int(run["world_size"]), int(run["parameters"]), int(_strategy_arg(run, "shard_size"))
    units = fsdp_unit_fractions(_recipe_gpt_shapes(run["recipe"]))
    if run["strategy"] == "ShardedDiLoCoStrategy":  # one outer round's bytes every H = steps / rounds steps
        sync_every = int(run["steps"]) // int(run["outer_rounds"])
        outer = Codec(float(run["bytes_per_step"]) * sync_every * shard, Aggregation.SUM, rounds=1)
        return sharded_comm_seconds(outer, 4.0 * numel, n, network, units, sync_every)
    compressor = getattr(compressors, run["compressor"]["compressor"])()
    shape = measure_codec(compressor, _STAND_IN, n // shard, timed=False)
    codec = Codec(float(run["bytes_per_step"]) * shard, shape.aggregation, rounds=shape.rounds)
    return sharded_comm_seconds(codec, 4.0 * numel, n, network, units)


def _cross_node_run_comm_seconds(run: dict[str, Any], network: Network) -> float:
    """:func:`cross_node_fsdp_comm_seconds` of a stored run of a model sharded over every rank: stock FSDP2
    (``shard_size`` the world size), or ``compress_across_nodes`` (with ``quantize_weights``: the all-gather too),
    its measured bytes between nodes per rank, over the FSDP2 units of its recipe's GPT."""
    across = bool(_strategy_arg(run, "compress_across_nodes"))
    return cross_node_fsdp_comm_seconds(
        float(run["bytes_per_step"]) if across else 0.0, 4.0 * int(run["parameters"]), int(run["world_size"]),
        network, fsdp_unit_fractions(_recipe_gpt_shapes(run["recipe"])), reduce_scatter=across,
        all_gather=across and bool(_strategy_arg(run, "quantize_weights")))


def stored_run_comm_seconds(run: dict[str, Any], network: Network, buckets: Buckets) -> float:
    """Seconds of communication per step of a stored run (its bytes, its compressor's collective) on ``network``,
    with Gloo's flat ring, as the emulated cluster runs it (a sharded run: FSDP2's units, not ``buckets``)."""
    import lightning_gradcomp.compressors as compressors

    if run["strategy"] == "ShardedGradCompStrategy" and (
            _strategy_arg(run, "compress_across_nodes") or _strategy_arg(run, "shard_size") == run["world_size"]):
        return _cross_node_run_comm_seconds(run, network)
    if run["strategy"] in ("ShardedGradCompStrategy", "ShardedDiLoCoStrategy"):
        return _sharded_run_comm_seconds(run, network)
    n, numel = int(run["world_size"]), int(run["parameters"])
    if run["strategy"] == "DiLoCoStrategy":  # one outer round's bytes every H = steps / rounds steps
        sync_every = int(run["steps"]) // int(run["outer_rounds"])
        outer = Codec(float(run["bytes_per_step"]) * sync_every, Aggregation.SUM, rounds=1)
        return diloco_comm_seconds(outer, 4.0 * numel, n, network, sync_every, buckets)
    if run["compressor"] is None:
        return comm_seconds(fp32_codec(numel), n, network, buckets, two_level_allreduce=False)
    compressor = getattr(compressors, run["compressor"]["compressor"])()
    shape = measure_codec(compressor, _STAND_IN, n, timed=False)
    codec = Codec(float(run["bytes_per_step"]), shape.aggregation, rounds=shape.rounds)
    return comm_seconds(codec, n, network, buckets, two_level_allreduce=False)


def predict_from_stored(given: dict[str, Any], given_wan: str, target: dict[str, Any], target_wan: str,
                        lan: str = "10gbit") -> float:
    """The step of a stored emulated run (4 ranks as 2 sites of 2, ``lan`` inside a site) on ``target_wan``,
    predicted from the same run's measured step on ``given_wan``: that step is the step time a user gives
    (compute, codec and communication on this machine), and the model swaps its communication for
    ``target_wan``'s (``target``: the run on that link, for its bytes)."""

    def net(wan: str) -> Network:
        return Network(Link.parse(lan), sites=2, wan=Link.parse(wan))

    buckets = ddp_bucket_fractions(_recipe_gpt_shapes(given["recipe"]))
    return (float(given["median_step_seconds"]) - stored_run_comm_seconds(given, net(given_wan), buckets)
            + stored_run_comm_seconds(target, net(target_wan), buckets))


#: the emulated benchmarks whose runs ``validate`` re-predicts: the DDP engines' and the sharded engine's
EMULATED_DDP = ("lm_emulated", "diloco_emulated")
EMULATED_SHARDED = ("sharded_emulated",)


def validate_emulated(directory: Optional[Path] = None, given: str = "1gbit", target: str = "100mbit",
                      lan: str = "10gbit", benchmarks: Sequence[str] = EMULATED_DDP) -> list[Validation]:
    """Every stored emulated run of ``benchmarks`` (``lm_emulated``, ``diloco_emulated``, ``sharded_emulated``:
    4 ranks as 2 sites of 2) measured on both WAN links: its step on ``target`` predicted from its step on
    ``given`` (:func:`predict_from_stored`), against the step measured on ``target``."""
    import json

    root = directory or results_dir()
    rows = []
    for benchmark in benchmarks:
        for path in sorted((root / benchmark / given).glob("*.json")):
            other = root / benchmark / target / path.name
            if not other.is_file():
                continue
            fast, slow = json.loads(path.read_text()), json.loads(other.read_text())
            predicted = predict_from_stored(fast, given, slow, target, lan)
            rows.append(Validation(benchmark, path.stem, float(fast["median_step_seconds"]), predicted,
                                   float(slow["median_step_seconds"])))
    return rows


def codec_source(kernels: Optional[KernelThroughput], gpu: str) -> str:
    """One sentence: where a projection's encoding and decoding costs come from (which device's kernels, and which
    compressors fall back to the memory-bound assumption)."""
    bandwidth = f"memory-bound kernels at {gpu}'s {DEVICES[gpu].memory_bandwidth / 1e9:,.0f} GB/s (an assumption)"
    if kernels is None:
        return f"Codec cost: {bandwidth} for every compressor."
    assumed = kernels.assumed([s.name for s in LM_SETTINGS if s.name not in ("ddp", "bf16")] + ["int8 pseudo-gradients"])
    return (f"Codec cost: measured group compress and decode of {', '.join(sorted(kernels.seconds))} on "
            f"{kernels.device} ({kernels.source}, groups of {kernels.size / 2**20:g}M elements); {bandwidth} for "
            f"{', '.join(assumed)}, which the run has no rows for.")


def _print_transformer(args: argparse.Namespace) -> None:
    kernels = None if args.kernels is None else load_kernels(args.kernels)
    rows = transformer_projection(
        args.width, args.depth, args.seq_len, args.batch, args.nproc, args.link, args.gpu, args.vocab,
        None if args.step_ms is None else args.step_ms / 1e3, args.mfu, args.gpus_per_node, args.intra,
        args.diloco_h, overlap=args.overlap, kernels=kernels)
    numel = sum(math.prod(shape) for _, shape in gpt_shapes(args.width, args.depth, args.vocab, args.seq_len))
    compute = rows[0].prediction.compute_s
    source = (f"measured {args.step_ms:g} ms" if args.step_ms is not None
              else f"{args.gpu} at {DEVICES[args.gpu].flops / 1e12:g} TFLOP/s x MFU "
                   f"{args.mfu if args.mfu is not None else DEVICES[args.gpu].efficiency:g}")
    nodes = f", {args.gpus_per_node} per node joined by {args.intra}" if args.gpus_per_node > 1 else ""
    nodes += "; flat rows on DDP's timeline (--overlap)" if args.overlap else "; communication after compute"
    print(f"PROJECTION (a model, not a measurement): GPT width {args.width}, depth {args.depth}, "
          f"{numel / 1e6:.1f}M parameters, {args.batch} x {args.seq_len} tokens per GPU, {args.nproc} GPUs{nodes}; "
          f"compute {compute * 1e3:.1f} ms per step ({source}).")
    print(codec_source(kernels, args.gpu))
    print("Bytes ratio: fp32 DDP's bytes per step over the method's, on the links between nodes; loss vs DDP: "
          "final validation loss of the stored CPU run (4 ranks, GPT width 64, 2000 steps), not of this model.")
    if args.gpus_per_node > 1:
        print("Sharded rows: FSDP2 over each node's GPUs (shard_size = --gpus-per-node; each block, then the root), "
              "dense inside the node (the blocks all-gathered again in backward), each GPU's shard through the "
              "compressor between nodes; compute as DDP's (FSDP2's own overhead not modelled).")
    print()
    links = list(dict.fromkeys(row.link for row in rows))
    print("| method | setting | bytes ratio | loss vs DDP (measured, CPU) | "
          + " | ".join(f"{link}: step ms, speed-up" for link in links) + " |")
    print("|---" * (4 + len(links)) + "|")
    for method in dict.fromkeys(row.method for row in rows):
        mine = [row for row in rows if row.method == method]
        loss = "n/a" if math.isnan(mine[0].loss_vs_ddp) else f"{mine[0].loss_vs_ddp:+.1%}"
        cells = " | ".join(f"{row.prediction.step_s * 1e3:,.0f}, {row.speedup:.2f}x" for row in mine)
        print(f"| {method} | {mine[0].setting} | {mine[0].bytes_ratio:.1f}x | {loss} | {cells} |")


def _print_validation() -> None:
    print("Each run's measured step on the 1gbit WAN given as the step time; the model swaps in the 100mbit WAN's "
          "communication (4 Gloo ranks as 2 sites of 2, 10gbit inside a site).")
    for benchmarks, what in ((EMULATED_DDP, "DDP engines"), (EMULATED_SHARDED, "sharded engine (FSDP2 in each site)")):
        rows = validate_emulated(benchmarks=benchmarks)
        if not rows:
            continue
        print(f"\nThe {what}:\n")
        print("| benchmark | run | given step (1gbit) s | predicted (100mbit) s | measured (100mbit) s | error |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row.benchmark} | {row.run} | {row.given_s:.3f} | {row.predicted_s:.3f} | {row.measured_s:.3f} | "
                  f"{row.error:+.1%} |")
        errors = [abs(row.error) for row in rows]
        print(f"\nmean absolute error {statistics.mean(errors):.1%}, largest {max(errors):.1%} ({len(rows)} runs)")


def main(argv: Optional[list[str]] = None) -> None:
    """``gradcomp-perf``: predict one configuration, or draw the Fig. 5-style curves."""

    parser = argparse.ArgumentParser(prog="gradcomp-perf", description="TernGrad-style performance model")
    sub = parser.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("predict", help="step time and throughput of one configuration")
    pr.add_argument("--model", choices=sorted(PAPER_MODELS), required=True)
    pr.add_argument("--compressor", default="terngrad", help="a registered compressor name, or fp32-ddp / bf16-ddp")
    pr.add_argument("--nproc", type=int, nargs="+", default=[8])
    pr.add_argument("--link", default="1gbit", help="link per worker, e.g. 1gbit or 1gbit@50us")
    pr.add_argument("--gpus-per-node", type=int, default=1, help="workers behind one node link (intra: --intra)")
    pr.add_argument("--intra", default="80gbit@10us", help="link between workers of a node")
    pr.add_argument("--device", choices=sorted(DEVICES), default="gtx1080")
    pr.add_argument("--batch", type=int, default=None, help="per worker (default: the paper's)")
    pr.add_argument("--overlap", action="store_true",
                    help="DDP's timeline: communication of each bucket behind the rest of backward (default: serial)")
    pr.add_argument("--hierarchical", action="store_true",
                    help="the hierarchical exchange: dense inside a node (--intra), compressed between nodes (--link)")
    fg = sub.add_parser("fig5", help="Fig. 5-style curves for AlexNet, GoogLeNet and VGG-A")
    fg.add_argument("--out", default="docs/img")
    tr = sub.add_parser("transformer", help="a GPT on named GPUs and links: DDP, each compressor at its measured "
                        "bytes, the hierarchical exchange, DiLoCo (a projection, not a measurement)")
    tr.add_argument("--width", type=int, required=True)
    tr.add_argument("--depth", type=int, required=True)
    tr.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    tr.add_argument("--batch", type=int, default=8, help="sequences per GPU per step")
    tr.add_argument("--vocab", type=int, default=50257)
    tr.add_argument("--gpu", choices=sorted(DEVICES), default="h100", help="compute from its published FLOP/s")
    tr.add_argument("--mfu", type=float, default=None, help="model FLOP utilisation (default: 0.4)")
    tr.add_argument("--step-ms", type=float, default=None,
                    help="one GPU's measured step without communication (replaces --gpu's FLOP estimate)")
    tr.add_argument("--nproc", type=int, default=16, help="GPUs in all")
    tr.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (inside: --intra); >= 2 adds the "
                    "hierarchical rows and the sharded ones (FSDP2 inside a node, shards compressed between nodes)")
    tr.add_argument("--intra", default="900gbit@5us", help="link between the GPUs of a node (NVLink: 900gbit)")
    tr.add_argument("--link", nargs="+", default=["100mbit", "1gbit", "10gbit", "100gbit"],
                    help="link per GPU, or per node with --gpus-per-node")
    tr.add_argument("--diloco-h", type=int, nargs="+", default=[50, 100], help="DiLoCo's H values")
    tr.add_argument("--overlap", action="store_true",
                    help="DDP's timeline for the flat rows: each bucket's exchange behind the rest of backward")
    tr.add_argument("--kernels", type=Path, default=None,
                    help="a stored kernel run (benchmarks/kernels.py --json, e.g. "
                         "benchmarks/results/gpu_h100/kernels.json): its measured group compress/decode replace the "
                         "memory-bound codec cost for the compressors it has rows for")
    sub.add_parser("validate", help="the model against the emulated cluster's stored step times, with the error")
    args = parser.parse_args(argv)
    workers = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    if args.command == "transformer":
        _print_transformer(args)
        return
    if args.command == "validate":
        _print_validation()
        return
    if args.command == "fig5":
        for path in draw_fig5(args.out, workers):
            print(f"wrote {path}")
        _fig5_table(workers)
        return
    spec = PAPER_MODELS[args.model]
    batch = args.batch or spec.batch
    numel = sum(math.prod(s) for _, s in spec.shapes())
    compute = DEVICES[args.device].train_seconds(spec.forward_macs, batch)
    print(f"{args.model}: {numel / 1e6:.1f}M parameters, {compute * 1e3:.1f} ms compute per step on {args.device} (batch {batch})")
    print("| N | method | collective | compute ms | codec ms | comm ms | hidden behind backward ms | step ms | img/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    if args.hierarchical and args.gpus_per_node < 2:
        parser.error(f"Expected --gpus-per-node >= 2 with --hierarchical, but got {args.gpus_per_node}. "
                     f"Fix: e.g. --gpus-per-node 4 (one site per node).")
    for n in args.nproc:
        p = predict_paper_model(args.model, args.compressor, n, args.link, args.device, batch, args.gpus_per_node,
                                args.intra, args.overlap, args.hierarchical)
        print(f"| {n} | {args.compressor} | {p.collective} | {p.compute_s * 1e3:.1f} | {p.codec_s * 1e3:.1f} | "
              f"{p.comm_s * 1e3:.1f} | {p.hidden_s * 1e3:.1f} | {p.step_s * 1e3:.1f} | {p.throughput:.0f} |")


def predict_paper_model(model: str, compressor: str, world_size: int, link: str, device: str = "gtx1080",
                        batch: Optional[int] = None, gpus_per_node: int = 1, intra: str = "80gbit@10us",
                        overlap: bool = False, hierarchical: bool = False) -> Prediction:
    """``gradcomp-perf predict``'s projection of one configuration of a paper model (AlexNet, GoogLeNet, VGG-A).

    Args:
        model: a :data:`PAPER_MODELS` name.
        compressor: a registered compressor name, or ``"fp32-ddp"`` / ``"bf16-ddp"``.
        world_size: workers in all.
        link: the link per worker, or between nodes with ``gpus_per_node`` > 1 (``"1gbit"``, ``"1gbit@50us"``).
        device: a :data:`DEVICES` name (its compute per step).
        batch: samples per worker (default: the paper's).
        gpus_per_node: workers behind one node link, joined by ``intra``.
        intra: the link between the workers of a node.
        overlap: DDP's timeline (each bucket's exchange behind the rest of backward) instead of after compute.
        hierarchical: dense inside a node, compressed between nodes (needs ``gpus_per_node`` >= 2).

    Returns:
        The prediction; its ``step_s`` over DDP's is the speed-up the docs' tables show.
    """
    from lightning_gradcomp import registry

    spec = PAPER_MODELS[model]
    batch = batch or spec.batch
    shapes = spec.shapes()
    numel = sum(math.prod(s) for _, s in shapes)
    buckets = ddp_bucket_fractions(shapes)
    compute = DEVICES[device].train_seconds(spec.forward_macs, batch)
    per_element = DEVICES[device].codec_seconds_per_element()
    between = Link.parse(link)
    hier = hierarchical and world_size > gpus_per_node
    if world_size <= gpus_per_node or gpus_per_node == 1:
        net = Network(between if gpus_per_node == 1 else Link.parse(intra))
    else:
        net = Network(Link.parse(intra), sites=world_size // gpus_per_node, wan=between)
    ranks = world_size // gpus_per_node if hier else world_size  # hierarchical: the collective among the sites
    if compressor in ("fp32-ddp", "bf16-ddp"):
        codec, name = fp32_codec(numel, 4.0 if compressor == "fp32-ddp" else 2.0), "allreduce"
    elif compressor == "terngrad":
        # hierarchical: the collective among the sites, over the link between nodes
        name, codec = best_terngrad_codec(numel, ranks, Network(between) if hier else net, per_element, buckets)
    else:
        measured = measure_codec(registry.make_compressor(compressor), shapes, ranks, timed=False)
        codec = Codec(measured.nbytes, measured.aggregation, per_element * numel, per_element * numel, measured.rounds)
        name = measured.aggregation.value
    return predict(compute, codec, world_size, net, batch, buckets, collective=name + ("+hier" if hier else ""),
                   overlap=overlap and not hier, hierarchical_dense_bytes=4.0 * numel if hier else None)


if __name__ == "__main__":
    main()
