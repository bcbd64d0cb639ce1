"""``GradCompStrategy``: Lightning's DDP with our compression hook installed on CPU (Gloo) and GPU (NCCL)."""

import fnmatch
import inspect
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning_gradcomp.registry as registry
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.costmodel import CompressionCost, Link, Network
from lightning_gradcomp.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.guard import NonFinite
from lightning_gradcomp.pipeline import LayerTransform
from lightning_gradcomp.planner import CollectivePlanner
from lightning_gradcomp.resilience import ResilienceMixin, ResumeCompression
from lightning_gradcomp.validation import check_bool, check_int, check_number

log = logging.getLogger(__name__)

# DDPStrategy arguments that would replace or bypass our hook; jsonargparse passes them as explicit None
_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "output_device",
    "process_group",
}
# DDP options that take a bool: a string such as "false" is truthy and would silently switch them on
_DDP_SIGNATURE = inspect.signature(DistributedDataParallel.__init__).parameters
_DDP_BOOL_OPTIONS = frozenset(n for n, p in _DDP_SIGNATURE.items() if isinstance(p.default, bool))


def select_float_names(named: dict[str, torch.nn.Parameter], exclude: Sequence[str], min_numel: int) -> frozenset[str]:
    """Names of the parameters sent uncompressed: those matching an ``exclude`` glob or below ``min_numel``.

    Raises:
        ValueError: a pattern matches no parameter (a typo would otherwise silently compress everything).
    """
    chosen: set[str] = set()
    for pattern in exclude:
        matched = {n for n in named if fnmatch.fnmatchcase(n, pattern)}
        if not matched:
            raise ValueError(
                f"Expected every `exclude` pattern to match a parameter, but {pattern!r} matches none. "
                f"Fix: use fnmatch globs over these names: {sorted(named)}."
            )
        chosen |= matched
    chosen |= {n for n, p in named.items() if p.numel() < min_numel}
    return frozenset(chosen)


def _check_ddp_options(options: dict[str, Any], bucket_cap_mb: Any, backend: Any) -> None:
    """Refuse DDP options DDP itself would accept wrongly (truthy strings) or only fail on deep inside."""
    for name, value in options.items():
        if name in _DDP_BOOL_OPTIONS or (value is not None and name in ("broadcast_buffers", "forward_sync_buffers")):
            check_bool(name, value)
    if bucket_cap_mb is not None:
        check_number("bucket_cap_mb", bucket_cap_mb, minimum=0, min_open=True,
                     fix="pass a positive size in MiB, e.g. 25 (DDP's default), or None for DDP's default")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(
            f"Expected `process_group_backend` to be a backend name or None, but got {backend!r}. "
            f"Fix: use 'gloo' on CPU, 'nccl' on CUDA, or None for the device's default."
        )


def check_backend(backend: Optional[str], device: torch.device) -> None:
    """Refuse NCCL on a non-CUDA device (or without NCCL) before any process group exists.

    Raises:
        ValueError: ``backend`` is ``"nccl"`` but the device is not CUDA or this torch has no NCCL.
    """
    if backend == "nccl" and (device.type != "cuda" or not torch.distributed.is_nccl_available()):
        raise ValueError(
            f"Expected `process_group_backend` to name a backend this run can use on {device.type}, but got "
            f"'nccl' (NCCL needs CUDA devices and a torch built with NCCL). Fix: use "
            f"`process_group_backend='gloo'` on CPU, or None for the device's default."
        )


class GradCompStrategy(ResilienceMixin, DDPStrategy):
    """Data-parallel training with compressed gradient exchange inside DDP's communication hook.

    Args:
        compressor: a :class:`~lightning_gradcomp.compressors.Compressor` instance, or a registered name
            (``"terngrad"``, ``"fp32"``, ...).
        exclude: parameter-name patterns (``fnmatch`` globs, e.g. ``"classifier.*"``) sent uncompressed in
            fp32; every pattern must match at least one parameter.
        min_numel: parameters with fewer elements are sent uncompressed (the TernGrad AlexNet script's
            ``size_to_binarize``; 1 compresses everything).
        find_unused_parameters: as in ``DistributedDataParallel``.
        static_graph: as in ``DistributedDataParallel``.
        gradient_as_bucket_view: as in ``DistributedDataParallel``.
        bucket_cap_mb: DDP bucket size in MiB (``None``: DDP's default).
        broadcast_buffers: as in ``DistributedDataParallel``.
        accelerator: see :class:`~lightning.pytorch.strategies.DDPStrategy`.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy``.
        precision_plugin: see ``DDPStrategy``.
        process_group_backend: ``"gloo"``, ``"nccl"``, or ``None`` for the device's default.
        timeout: collective timeout (a positive ``timedelta``): how long a rank waits for a peer that stopped
            answering before it fails. A peer that dies is usually detected at once (Gloo: connection closed).
        start_method: how Lightning launches local processes (``"popen"``, ``"spawn"``, ...).
        check_replicas_every: every k optimizer steps, compare a checksum of all parameters across ranks and
            stop with an error naming the first diverging parameter (0: never). Costs one all-gather of
            16 bytes per parameter tensor.
        nonfinite: a NaN/Inf gradient on any rank: ``"skip"`` the step on every rank (residuals untouched),
            ``"raise"`` on every rank naming the parameter, or ``"ignore"`` (no check). See
            :mod:`lightning_gradcomp.guard`.
        resume_compression: ``"exact"`` restores every rank's compression state from the checkpoint (and refuses
            a checkpoint written by another world size); ``"reset"`` starts it afresh.
        link: the network between ranks (``"1gbit"``, ``"100mbit@2ms"``, a
            :class:`~lightning_gradcomp.costmodel.Link` or ``Network``); when given, a cost model picks per
            bucket between plain fp32 all-reduce and the compressor's collectives (logged at INFO, counted in
            ``comm_state.collectives``). ``None`` (default): always compress.
        compression_cost: compress/decode seconds per element for that choice; ``None`` measures them on the
            first step (max over ranks).
        pipeline_mb: MiB of gradient per pipelined group inside a bucket: the hook compresses a group and
            launches its collectives before compressing the next, so compression overlaps the transfer of the
            previous group (a parameter is never split). ``None``: one group per bucket. Results are identical
            either way; each extra group costs one collective's latency.
        **kwargs: further ``DistributedDataParallel`` options.
    """

    strategy_name = "gradcomp"

    def __init__(
        self,
        compressor: Union[Compressor, str] = "terngrad",
        exclude: Optional[Sequence[str]] = None,
        min_numel: int = 1,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: Optional[float] = None,
        broadcast_buffers: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        check_replicas_every: int = 0,
        nonfinite: NonFinite = "skip",
        resume_compression: ResumeCompression = "exact",
        link: Optional[Union[str, Link, Network]] = None,
        compression_cost: Optional[CompressionCost] = None,
        pipeline_mb: Optional[float] = 8.0,
        **kwargs: Any,
    ) -> None:
        # reliability options (lightning_gradcomp.resilience), validated before anything else is built
        self._init_resilience(check_replicas_every, nonfinite, resume_compression, timeout)
        for key in _HOOK_ARGUMENTS:
            value = kwargs.pop(key, None)
            if value is not None:
                raise ValueError(
                    f"Expected `{key}` to be None (GradCompStrategy installs its own communication hook), but got "
                    f"{value!r}. "
                    f"Fix: use `strategy='ddp'` for a custom DDP hook, or a Compressor for custom compression."
                )
        unknown = sorted(set(kwargs) - _DDP_OPTIONS)
        if unknown:
            raise ValueError(
                f"Unknown option(s) {unknown} for GradCompStrategy. Fix: compressor options go to the compressor, "
                f"e.g. `GradCompStrategy(compressor=TernGrad(clip_factor=2.5))`; DDP options are "
                f"{sorted(_DDP_OPTIONS)}."
            )
        _check_ddp_options(
            dict(
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
                gradient_as_bucket_view=gradient_as_bucket_view,
                broadcast_buffers=broadcast_buffers,
                **kwargs,
            ),
            bucket_cap_mb,
            process_group_backend,
        )
        self.compressor = registry.make_compressor(compressor) if isinstance(compressor, str) else compressor
        if not isinstance(self.compressor, Compressor):
            raise ValueError(
                f"Expected `compressor` to be a Compressor or a registered name, but got {compressor!r}. "
                f"Fix: use one of {registry.compressor_names()}."
            )
        if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude or ()):
            raise ValueError(
                f"Expected `exclude` to be a list of parameter-name patterns, but got {exclude!r}. "
                f"Fix: wrap a single pattern in a list, e.g. `exclude=['classifier.*']`."
            )
        self.exclude = list(exclude or [])
        check_int("min_numel", min_numel, minimum=1, fix="use 1 to compress every parameter")
        self.min_numel = min_numel
        if pipeline_mb is not None:
            check_number("pipeline_mb", pipeline_mb, minimum=0, min_open=True,
                         fix="pass a positive size in MiB, or None for one group per bucket")
        self.pipeline_mb = pipeline_mb
        # parsed now so a bad spec fails before any process group exists
        self.planner = None if link is None else CollectivePlanner(link, compression_cost)
        ddp_kwargs: dict[str, Any] = dict(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            **kwargs,
        )
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self._transforms: list[LayerTransform] = []
        self.comm_state: Optional[GradCompState] = None

    @override
    def setup_environment(self) -> None:
        check_backend(self._process_group_backend, self.root_device)
        super().setup_environment()

    def add_transform(self, transform: LayerTransform) -> None:
        """Attach a per-layer transform (called by callbacks at setup, before DDP wraps the model)."""
        if self.comm_state is not None:
            raise RuntimeError(
                "Transforms must be attached before the model is wrapped in DDP. Fix: attach it from a callback's "
                "`setup` hook, or add the callback to the Trainer's `callbacks`."
            )
        if any(type(t) is type(transform) for t in self._transforms):
            raise ValueError(
                f"A {type(transform).__name__} transform is already attached. Fix: pass one such callback to the Trainer."
            )
        self._transforms.append(transform)

    @property
    def transforms(self) -> tuple[LayerTransform, ...]:
        """The per-layer transforms, in the order they run."""
        return tuple(self._transforms)

    def _float_names(self, named: dict[str, torch.nn.Parameter]) -> frozenset[str]:
        return select_float_names(named, self.exclude, self.min_numel)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours must run on CPU/Gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        named = {n: p for n, p in self.lightning_module.named_parameters() if p.requires_grad}
        float_names = self._float_names(named)
        group = self.model.process_group
        world_size = self.world_size
        self.compressor.setup(self.global_rank, world_size, self.root_device)
        for transform in self._transforms:
            transform.setup(sorted(named), self.global_rank, world_size)
        self.comm_state = GradCompState(
            compressor=self.compressor,
            names={id(p): n for n, p in named.items()},
            float_names=float_names,
            transforms=tuple(self._transforms),
            process_group=group,
            world_size=world_size,
            planner=self.planner,
            pipeline_bytes=None if self.pipeline_mb is None else int(self.pipeline_mb * 2**20),
        )
        log.info(
            "gradcomp: %s on %d ranks, %d of %d tensors kept in fp32",
            self.compressor.describe(),
            world_size,
            len(float_names),
            len(named),
        )
        self._attach_resilience(self.comm_state)  # non-finite mode, pending checkpoint restore
        self.model.register_comm_hook(self.comm_state, gradcomp_hook)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        registry.register_strategies(cls, strategy_registry)
