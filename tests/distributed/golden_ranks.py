"""Rank bodies of the golden tests: every registered compressor through DDP's hook, and every other engine (DiLoCo,
Streaming DiLoCo, WeightGrad, the hierarchical exchange, TowerStrategy) through its strategy, on fixed gradients."""

import hashlib
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_gradcomp.exchange.ledger import ByteReport

#: the environment every golden rank computes in, so that the digests do not depend on the CPU's vector width: torch's
#: vectorised kernels at AVX2 (``ATEN_CPU_CAPABILITY``; on an AVX-512 CPU they would otherwise reduce in other lanes),
#: MKL's BLAS, LAPACK and vector math (PowerSGD's and DeMo's products, QR, Adam's square roots) on its ``COMPATIBLE``
#: code branch (``MKL_CBWR``: SSE2, the same bits on every x86-64 CPU, Intel or AMD), and oneDNN's kernels capped at
#: AVX2. The library's own CPU kernels need none: their AVX-512 and AVX2 clones (``kernels/csrc/common.h``) compute the
#: same bits (fixed 8-lane vectors, no -ffast-math; every kernel-backed compressor's digest recorded on an AVX2 CPU
#: reproduced on an AVX-512 one). torch and MKL read these variables once per process, at the first kernel call,
#: which the fork server's imports never make: a rank sets them first (``run_ranks(..., env=...)``), and
#: :func:`pinned` checks that torch took them.
PINNED_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: what ``torch.backends.cpu.get_cpu_capability()`` reports under :data:`PINNED_CPU`
PINNED_CAPABILITY = "AVX2"


def cpu_environment(rank: int, world_size: int) -> tuple[str, dict[str, str | None]]:
    """The CPU capability torch's kernels run at in this process, and the pinning variables as this process sees them."""
    return torch.backends.cpu.get_cpu_capability(), {k: os.environ.get(k) for k in PINNED_CPU}


def pinned(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, world_size, *args)`` once this rank computes at :data:`PINNED_CAPABILITY` (run it with
    ``env=PINNED_CPU``); fails, saying why, where torch had already chosen its kernels before the rank pinned them."""
    capability, environment = cpu_environment(rank, world_size)
    if capability != PINNED_CAPABILITY or environment != PINNED_CPU:
        raise AssertionError(
            f"Expected golden ranks to compute at {PINNED_CAPABILITY} with {PINNED_CPU} but got {capability} with "
            f"{environment}. Fix: start them with run_ranks(..., env=PINNED_CPU), before anything in the fork server "
            "calls a torch kernel (torch reads ATEN_CPU_CAPABILITY once per process)."
        )
    return fn(rank, world_size, *args)

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


# -- the other engines: DiLoCo, Streaming DiLoCo, WeightGrad, the hierarchical exchange, TowerStrategy -------------

#: per layer (a module: Streaming DiLoCo's fragments and the hierarchy's shares split the model by layer), its
#: parameters' shapes: a matrix and bias, a conv kernel (PowerSGD's 4-D case), a larger matrix and bias
LAYERS = (((32, 16), (16,)), ((8, 4, 3, 3),), ((64, 32), (32,)))


class _Layer(nn.Module):
    def __init__(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(shapes[0]))
        if len(shapes) > 1:
            self.bias = nn.Parameter(0.1 * torch.randn(shapes[1]))


def coefficients(sample: int, shapes: list[torch.Size]) -> list[Tensor]:
    """The coefficient tensors of one sample: fixed by the sample's id alone."""
    gen = torch.Generator().manual_seed(1000 + sample)
    return [torch.randn(s, generator=gen) for s in shapes]


class CoefficientModule(pl.LightningModule):
    """``loss = sum over the batch's samples of sum(p * c(sample))``: the gradient of each parameter is exactly the
    sum of its coefficients (one sample per rank or tower: exactly ``c``), whatever the weights, so what each
    engine receives does not depend on the CPU's matrix kernels.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"`` (its second moments drive WeightGrad's loss-aware
            ternarization).
        lr: the inner optimizer's learning rate.
    """

    def __init__(self, optimizer: str = "sgd", lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.layers = nn.ModuleList(_Layer(s) for s in LAYERS)
        self.optimizer, self.lr = optimizer, lr

    @override
    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        params = list(self.parameters())
        shapes = [p.shape for p in params]
        terms = [(p * c).sum() for sample in batch[0].tolist() for p, c in zip(params, coefficients(sample, shapes))]
        return torch.stack(terms).sum()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def sample_loader(batch_size: int = 1) -> DataLoader:
    """Sample ids 0..63 in order: under DDP's sampler rank ``r`` of ``W`` takes ``r, r + W, ...``; tower ``r`` of
    ``N`` takes the ``r``-th of each batch of ``N``."""
    return DataLoader(TensorDataset(torch.arange(64)), batch_size=batch_size)


class EngineRecorder(pl.Callback):
    """SHA-256s, one per part, of what an engine computes in a fit:

    * ``grads``: every step's gradients as the optimizer sees them (the inner hook's decoded mean; the towers'
      emulated mean);
    * ``exchanged``: every outer round's pseudo-gradients as launched and the all-site mean as applied, plus this
      site's own decoded contribution where the engine keeps the unsent part (WeightGrad);
    * ``payload``: WeightGrad's WAN messages as encoded (every rank encodes its site's, leaders send it);
    * ``params``: the parameters after every step and after ``fit`` (the final outer round included);
    * ``state``: the error feedback of every exchange (residuals by name, each towers worker's), the global
      weights and the outer optimizer's momentum, WeightGrad's unsent updates and thresholds.

    and ``bytes_per_step``, the engine's own count of bytes on the (slow) wire per step.

    The outer parts are read at the engine's exchange interface (``OuterExchange.launch``/``wait``, wrapped as
    pass-throughs) and at WeightGrad's encoder; a refactor that moves them records the same quantities at their
    new place, and the digests stay.
    """

    def __init__(self) -> None:
        self.digests = {part: hashlib.sha256() for part in ("grads", "exchanged", "payload", "params", "state")}
        self._restore: list[Callable[[], None]] = []

    def _observe(self, owner: Any, attribute: str, record: Callable[..., None]) -> None:
        """Record the arguments and result of ``owner.attribute`` (a pass-through: the engine's call is unchanged)."""
        original = getattr(owner, attribute)

        def observed(*args: Any) -> Any:
            result = original(*args)
            record(result, *args)
            return result

        setattr(owner, attribute, observed)
        self._restore.append(lambda: setattr(owner, attribute, original))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        exchanged = self.digests["exchanged"]
        # DiLoCo's engine, or WeightGrad's synchronizer (the engine and its own exchange)
        outer: Any = getattr(strategy, "outer", None) or getattr(strategy, "synchronizer", None)
        if outer is not None:
            def launched(flight: Any, fragment: int, pseudo_gradients: list[Tensor], step: int) -> None:
                for d in pseudo_gradients:
                    _update(exchanged, d)

            def applied(means: list[Tensor], flight: Any) -> None:
                for m in means + list(flight.sent or []):
                    _update(exchanged, m)

            self._observe(outer.exchange, "launch", launched)
            self._observe(outer.exchange, "wait", applied)
        if getattr(strategy, "synchronizer", None) is not None:
            from lightning_gradcomp.weightgrad import quantize

            # the WAN message as the encoder makes it (WanMessage.compress_flat calls `_encode`)
            self._observe(quantize, "_encode", lambda made, layers: _update(self.digests["payload"], made[0]))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for p in pl_module.parameters():
            assert p.grad is not None
            _update(self.digests["grads"], p.grad)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for p in pl_module.parameters():
            _update(self.digests["params"], p)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the final synchronisation (right after the last step): the parameters every rank leaves fit with
        for restore in self._restore:
            restore()
        for p in pl_module.parameters():
            _update(self.digests["params"], p)
        strategy = trainer.strategy
        state = self.digests["state"]

        def named(tensors: Any) -> None:
            for key in sorted(tensors):
                state.update(key.encode())
                _update(state, tensors[key])

        hook_states = [s for s in [getattr(strategy, "comm_state", None)] if s is not None]
        hook_states += list(getattr(strategy, "_states", []))  # TowerStrategy: one hook state per worker
        outer: Any = getattr(strategy, "outer", None) or getattr(strategy, "synchronizer", None)
        exchange = getattr(outer, "exchange", None)
        if exchange is not None and hasattr(exchange, "state"):
            hook_states.append(exchange.state)  # DiLoCo's outer exchange: error feedback of the leaders
        for hook_state in hook_states:
            named(hook_state.memory.residuals)
        if outer is not None:
            named(outer.anchor)
            named(outer.hidden)
            for anchor in outer.outer_optimizer.param_groups[0]["params"]:
                for key, value in sorted(outer.outer_optimizer.state.get(anchor, {}).items()):
                    if isinstance(value, Tensor):
                        state.update(key.encode())
                        _update(state, value)
        significance = getattr(outer, "significance", None)
        if significance is not None:
            named({n: significance.threshold_of(n) for n in outer.names})
        assert isinstance(strategy, ByteReport)
        self.bytes_per_step = strategy.bytes_per_step()

    def result(self) -> dict[str, Any]:
        """The digests of the parts this engine recorded anything in, and its bytes per step."""
        empty = hashlib.sha256().hexdigest()
        digests = {part: d.hexdigest() for part, d in self.digests.items() if d.hexdigest() != empty}
        return {**digests, "bytes_per_step": self.bytes_per_step}


def engine_configs() -> dict[str, tuple[Callable[[], Any], str, int]]:
    """Each engine configuration: its strategy (built on the rank), the inner optimizer, the steps."""
    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.compressors import TopK
    from lightning_gradcomp.outer import DiLoCoStrategy
    from lightning_gradcomp.weightgrad import WeightGradStrategy

    return {
        # DiLoCo, 2 sites of 2: SparseLoCo's top-k with 2-bit values and error feedback between the leaders,
        # Nesterov outer SGD; rounds at steps 2 and 4, a final round after step 5
        "diloco": (lambda: DiLoCoStrategy(sync_every=2, site_size=2, compressor=TopK(0.05, "int2", dense_1d=False)),
                   "adam", 5),
        # Streaming DiLoCo: 2 strided fragments (layers 0, 2 and layer 1) at steps 2 and 4 of each window of 4,
        # each landing one step after its launch, mixing 0.5; int8 between sites, TernGrad inside them
        "streaming_diloco": (lambda: DiLoCoStrategy(sync_every=4, site_size=2, fragments=2, sync_delay=1, mixing=0.5,
                                                    compressor="int8", inner_compressor="terngrad"), "sgd", 6),
        # WeightGrad, 2 sites of 2: TernGrad inside, loss-aware ternary updates (Adam's moments) between, T = 2
        "weightgrad": (lambda: WeightGradStrategy(site_size=2, staleness_bound=2), "adam", 5),
        # its stochastic ternarization, Gaia's view of the unsent part, rounds also on significance
        "weightgrad_terngrad": (lambda: WeightGradStrategy(site_size=2, staleness_bound=3, wan_quantization="terngrad",
                                                           site_view="gaia", trigger="significance"), "sgd", 5),
        # the hierarchical exchange, 2 sites of 2: a shared-scale all-reduce, gathered sparse packets with error
        # feedback, multi-round PowerSGD
        "hierarchy_terngrad": (lambda: GradCompStrategy("terngrad", site_sizes=[2, 2]), "sgd", 3),
        "hierarchy_dgc": (lambda: GradCompStrategy("dgc", site_sizes=[2, 2]), "sgd", 3),
        "hierarchy_powersgd": (lambda: GradCompStrategy("powersgd", site_sizes=[2, 2]), "sgd", 3),
    }


#: TowerStrategy (one process, emulated workers): 4 workers of TernGrad (a shared max scaler), and of Gradient
#: Dropping with the biases in fp32 (two groups per bucket, each worker's residuals)
TOWERS = {"towers_terngrad": ("terngrad", ()), "towers_graddrop": ("graddrop", ("*.bias",))}
TOWER_WORKERS = 4
TOWER_STEPS = 3


def _fit(strategy: Any, devices: int, optimizer: str, steps: int, batch_size: int = 1,
         lr: float = 0.05) -> dict[str, Any]:
    recorder = EngineRecorder()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder])
    trainer.fit(CoefficientModule(optimizer, lr), sample_loader(batch_size))
    return recorder.result()


def engine_digests(rank: int, world_size: int, names: list[str], lr: float = 0.05) -> dict[str, dict[str, Any]]:
    """Per engine configuration (:func:`engine_configs`), this rank's digests of one fit (:class:`EngineRecorder`)."""
    engines = engine_configs()
    return {name: _fit(engines[name][0](), world_size, engines[name][1], engines[name][2], lr=lr) for name in names}


def tower_digests(rank: int, world_size: int, names: list[str], lr: float = 0.05) -> dict[str, dict[str, Any]]:
    """Per :data:`TOWERS` configuration, the digests of one fit in this process (single-threaded, as the ranks): a
    rank of one, so that it computes in :data:`PINNED_CPU` as the others."""
    from lightning_gradcomp.strategies.towers import TowerStrategy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: _fit(TowerStrategy(TOWER_WORKERS, TOWERS[name][0], exclude=list(TOWERS[name][1])), 1, "sgd",
                           TOWER_STEPS, batch_size=TOWER_WORKERS, lr=lr) for name in names}
    finally:
        torch.set_num_threads(threads)


# -- 1-bit Adam and 0/1 Adam: the optimizer's compressed all-reduce (worker and server stages) ---------------------

#: per configuration: the method, the optimizer's options, the exchange's ``block_size``, the steps. 1-bit Adam:
#: dense warm-up for 2 steps, then 3 compressed exchanges of the momentum (one scale per piece); 0/1 Adam: variance
#: updates at steps 1, 2, 4, 1-bit gradient averaging at step 3, then local steps synchronised by the compressed
#: exchange (blocks of 16 elements, several per piece)
#: Both with ``deepspeed_compat=True``: the digests pin DeepSpeed's arithmetic, which that option keeps.
FROZEN_ADAMS: dict[str, tuple[str, dict[str, Any], Any, int]] = {
    "onebit_adam": ("onebit", {"lr": 1e-2, "freeze_step": 2, "deepspeed_compat": True}, None, 5),
    "zero_one_adam": ("zero_one", {"lr": 1e-2, "var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2,
                                   "local_step_clipper": 2, "deepspeed_compat": True}, 16, 8),
}


def frozen_adam_digests(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per :data:`FROZEN_ADAMS` configuration, DDP with the strategy's hook and the optimizer bound to its
    :class:`~lightning_gradcomp.onebit_adam.CompressedAllReduce` (a 67-parameter model cut in uneven chunks): SHA-256s
    of every exchange's input and average (``exchanged``), the parameters after every step (``params``), the worker
    and server errors and the optimizer's moments at the end (``state``), and the exchange's bytes."""
    from lightning_gradcomp import GradCompState
    from lightning_gradcomp.compressors import Identity
    from lightning_gradcomp.onebit_adam.strategy import LINK_KEY, FrozenAdamLink, frozen_adam_hook
    from tests.distributed.onebit_adam_ranks import Small, batch, make_optimizer

    dist.init_process_group("gloo")
    out: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            method, options, block_size, steps = FROZEN_ADAMS[name]
            model = Small()
            named: dict[str, Tensor] = dict(model.named_parameters())
            state = GradCompState(compressor=Identity(), names={id(p): n for n, p in named.items()},
                                  world_size=world_size)
            link = FrozenAdamLink(rank, world_size, None, torch.device("cpu"), block_size)
            state.attach(LINK_KEY, link)
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)
            ddp.register_comm_hook(state, frozen_adam_hook)
            optimizer = make_optimizer(method, model.parameters(), options)
            link.bind(optimizer, named)
            exchange = link.exchange
            assert exchange is not None
            digests = {part: hashlib.sha256() for part in ("exchanged", "params", "state")}
            nbytes: list[int] = []
            average = exchange.average

            def recorded(flat: Tensor, average: Any = average, exchange: Any = exchange,
                         digests: Any = digests, nbytes: list[int] = nbytes) -> Tensor:
                _update(digests["exchanged"], flat)
                mean = average(flat)
                _update(digests["exchanged"], mean)
                nbytes.append(exchange.last_nbytes)
                return mean

            exchange.average = recorded  # type: ignore[method-assign]  # a pass-through: the optimizer's call is unchanged
            for step in range(steps):
                x, y = batch(rank, step)
                optimizer.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
                for p in model.parameters():
                    _update(digests["params"], p)
            for memory in (exchange.worker, exchange.server):
                for key in sorted(memory.residuals):
                    digests["state"].update(key.encode())
                    _update(digests["state"], memory.residuals[key])
            for p in model.parameters():
                for key, value in sorted(optimizer.state[p].items()):
                    digests["state"].update(key.encode())
                    _update(digests["state"], value)
            del ddp
            out[name] = {**{part: d.hexdigest() for part, d in digests.items()}, "exchanges": len(nbytes),
                         "nbytes": sum(nbytes), "expected_nbytes": exchange.expected_nbytes()}
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()
