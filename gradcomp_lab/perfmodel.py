"""The TernGrad-style performance model (Wen et al., NIPS 2017, section 5): step time and throughput.

Lightweight profiling on one machine plus an analytical communication model:

* **compute**: forward + backward + update of one worker's batch, profiled here (:func:`profile_compute`) or
  estimated from a FLOP count and a device's effective FLOP/s (:class:`Device`, for GPUs we do not have);
* **codec**: compression and decoding, measured on random tensors of every parameter's shape
  (:func:`lightning_gradcomp.codec.measure_codec`), which also gives the exact bytes on the wire;
* **communication**: :mod:`lightning_gradcomp.costmodel` (ring collectives, alpha-beta, N ranks, one or two
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

The AlexNet, GoogLeNet and VGG-A parameter shapes and FLOP counts are tables in this module (from the
published layer shapes), so predictions need neither the models nor a GPU.
"""

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_gradcomp.codec import Codec, Shapes, measure_codec
from lightning_gradcomp.compressors.base import Aggregation
from lightning_gradcomp.costmodel import (
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
        flops: peak fp32 FLOP/s.
        efficiency: fraction of peak reached by training (cuDNN-era convnets: about 0.4-0.5).
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


DEVICES = {
    "gtx1080": Device(8.9e12, 0.45, 320e9),
    "p100": Device(10.6e12, 0.45, 732e9),
}


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
            the two-level schedule (:func:`~lightning_gradcomp.costmodel.hierarchical_allreduce_seconds`) when it
            is faster. NCCL arranges its inter-node algorithms by node, so the GPU predictions allow it. Gloo
            runs one ring over the ranks whatever the topology; every step of that ring crosses the WAN. Give
            ``False`` to predict Gloo, as the emulated cluster runs it.
    """
    return sum(sum(_bucket_seconds(codec, world_size, network, f, two_level_allreduce))
               for f in bucket_fractions(buckets))


def hierarchical_comm_seconds(codec: Codec, dense_bytes: float, world_size: int, network: Network,
                              buckets: Buckets = 1) -> float:
    """Seconds of one step of the hierarchical exchange (:mod:`lightning_gradcomp.hierarchy`) on a two-level
    ``network`` (``sites`` equal sites joined by ``wan``), bucket by bucket as the hook runs them:

    * a dense reduce of each share to its owner inside each site (``network.link``: the site's mean in) and a
      gather of the decoded shares (out): together the bytes of one ring all-reduce of the bucket, taken at its
      time (for ``k = 2``, the bucket each way; the all-to-alls' latency is one step each, the ring's ``k - 1``);
    * the compressor's collectives between sites (``codec`` measured for ``sites`` workers): the ``k`` local ranks
      each send their share at once over their site's one WAN link, so together they put ``codec.nbytes`` (the
      whole step's payload, as one flat rank would) on it; its statistics rounds cross the WAN once each.
    """
    sites = network.sites
    if sites < 2 or network.wan is None:
        raise ValueError(f"Expected a network of at least 2 sites joined by a WAN, but got {network}. Fix: "
                         f"`Network(lan, sites=2, wan=Link(...))`.")
    k = world_size // sites
    lan, wan = Network(network.link), Network(network.wan)
    total = 0.0
    for f in bucket_fractions(buckets):
        total += ring_allreduce_seconds(dense_bytes * f, k, lan)
        total += sum(_bucket_seconds(codec, sites, wan, f))
    return total


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


def main(argv: Optional[list[str]] = None) -> None:
    """``gradcomp-perf``: predict one configuration, or draw the Fig. 5-style curves."""
    from lightning_gradcomp import registry

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
    args = parser.parse_args(argv)
    workers = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    if args.command == "fig5":
        for path in draw_fig5(args.out, workers):
            print(f"wrote {path}")
        _fig5_table(workers)
        return
    spec = PAPER_MODELS[args.model]
    device = DEVICES[args.device]
    batch = args.batch or spec.batch
    shapes = spec.shapes()
    numel = sum(math.prod(s) for _, s in shapes)
    buckets = ddp_bucket_fractions(shapes)
    compute = device.train_seconds(spec.forward_macs, batch)
    link = Link.parse(args.link)
    print(f"{args.model}: {numel / 1e6:.1f}M parameters, {compute * 1e3:.1f} ms compute per step on {args.device} (batch {batch})")
    print("| N | method | collective | compute ms | codec ms | comm ms | hidden behind backward ms | step ms | img/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    if args.hierarchical and args.gpus_per_node < 2:
        parser.error(f"Expected --gpus-per-node >= 2 with --hierarchical, but got {args.gpus_per_node}. "
                     f"Fix: e.g. --gpus-per-node 4 (one site per node).")
    for n in args.nproc:
        hier = args.hierarchical and n > args.gpus_per_node
        if n <= args.gpus_per_node or args.gpus_per_node == 1:
            net = Network(link if args.gpus_per_node == 1 else Link.parse(args.intra))
        else:
            net = Network(Link.parse(args.intra), sites=n // args.gpus_per_node, wan=link)
        if args.compressor in ("fp32-ddp", "bf16-ddp"):
            codec, name = fp32_codec(numel, 4.0 if args.compressor == "fp32-ddp" else 2.0), "allreduce"
        elif args.compressor == "terngrad":
            # hierarchical: the collective among the sites, over the link between nodes
            name, codec = best_terngrad_codec(numel, n // args.gpus_per_node if hier else n, Network(link) if hier else net,
                                              device.codec_seconds_per_element(), buckets)
        else:
            measured = measure_codec(registry.make_compressor(args.compressor), shapes,
                                     n // args.gpus_per_node if hier else n, timed=False)
            per = device.codec_seconds_per_element() * numel
            codec = Codec(measured.nbytes, measured.aggregation, per, per, measured.rounds)
            name = measured.aggregation.value
        p = predict(compute, codec, n, net, batch, buckets, collective=name + ("+hier" if hier else ""),
                    overlap=args.overlap and not hier, hierarchical_dense_bytes=4.0 * numel if hier else None)
        print(f"| {n} | {args.compressor} | {p.collective} | {p.compute_s * 1e3:.1f} | {p.codec_s * 1e3:.1f} | "
              f"{p.comm_s * 1e3:.1f} | {p.hidden_s * 1e3:.1f} | {p.step_s * 1e3:.1f} | {p.throughput:.0f} |")


if __name__ == "__main__":
    main()
