"""Presets: each compressor's setting measured to reach AdamW DDP's loss on a transformer, by name.

The registered compressor names (``strategy="terngrad"``) keep the papers' defaults, chosen for SGD on CNNs. On the
language-model benchmark (``benchmarks/lm.py --long``: a byte-level GPT, AdamW, 4 ranks, 2000 steps;
``docs/transformers.md``) most of them end far above DDP's validation loss. This module is the one table of what
was measured there:

* :data:`PRESETS`: for each compressor with a setting within 2 % of AdamW DDP (mean of seeds), a strategy name
  ``<compressor>_lm`` that runs it (``Trainer(strategy="terngrad_lm")``), with the measured gap, the bytes saved
  and the stored runs it rests on;
* :data:`PAPER_DEFAULTS`: the measured gap of each paper default that misses DDP by more than 2 %, and the preset
  that closes it (or the best setting found, when none does).

With Adam or AdamW and a paper default from :data:`PAPER_DEFAULTS`, the strategy warns once on rank 0 at setup,
naming the gap and the preset (:func:`paper_default_warning`). ``tests/unit/test_presets.py`` checks every number
here against the stored runs under ``benchmarks/results/lm_long/``, so the warning cannot drift from the data.

Why ``_lm`` and not ``_adamw``: the settings rest on a language model (a transformer), and DeMo's preset is
measured with its own SignSGD, not AdamW; the suffix names where the numbers come from, as the recipes'
``recipes/lm/`` does.
"""

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_gradcomp.validation import check_dense_steps, check_int, resolve_dense_steps
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.demo import DeMo
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.terngrad import TernGrad

__all__ = ["PAPER_DEFAULTS", "PRESETS", "WORKLOAD", "Measurement", "PaperDefault", "Preset", "Workload",
           "embedding_names", "get_preset",
           "measure", "paper_default_name", "paper_default_warning", "preset_compressor", "preset_names", "register",
           "total_bytes"]

#: suffix of every preset's strategy name
SUFFIX = "_lm"


@dataclass(frozen=True)
class Workload:
    """The run every measurement here comes from (the stored runs' model, world and length; checked against them by
    ``tests/unit/test_presets.py``), named in the warning so that a user on another model knows what was measured.

    Attributes:
        model: the model in words, with where it is described.
        parameters: its parameter count.
        ranks: the world size.
        steps: the run's optimizer steps.
    """

    model: str
    parameters: int
    ranks: int
    steps: int

    def describe(self) -> str:
        """``"the byte-level GPT of docs/transformers.md (120,576 parameters, 4 ranks, 2000 steps)"``."""
        return f"{self.model} ({self.parameters:,} parameters, {self.ranks} ranks, {self.steps} steps)"


WORKLOAD = Workload("the byte-level GPT of docs/transformers.md", parameters=120_576, ranks=4, steps=2000)
"""The run every number here was measured on: the LM benchmark's 2000-step grid (``benchmarks/lm.py --long``,
``recipes/diloco/gpt_stdlib_ddp.yaml``). A preset's bytes ratio is about this model and run length."""


@dataclass(frozen=True)
class Measurement:
    """What a setting measured on the 2000-step LM grid against DDP.

    Attributes:
        runs: ``(run, DDP run)`` labels of the stored runs under ``benchmarks/results/lm_long/``, one pair per seed
            (DDP at the same seed and learning-rate warm-up), seed 0 first. A preset's runs include those of the
            settings search with the same options spelt out: its registered name reproduces them bit for bit
            (``benchmarks/results/lm_presets_check/``, checked by ``tests/unit/test_presets.py``).
        gap: the mean over the pairs of ``final_val_loss / DDP's - 1``, in percent, rounded to 0.1.
        bytes_ratio: fp32 DDP's bytes over this setting's, over the whole run (dense steps included), seed 0's run,
            rounded to 0.1.
        setting: the setting in words.
        measured_with: the optimizer it was measured with, where not the recipe's AdamW.
    """

    runs: tuple[tuple[str, str], ...]
    gap: float
    bytes_ratio: float
    setting: str
    measured_with: str = ""

    def describe(self) -> str:
        """``"+10.6 % (1 seed; 15.9x fewer bytes)"``."""
        seeds = len(self.runs)
        spread = "1 seed" if seeds == 1 else f"mean of {seeds} seeds"
        return f"{self.gap:+.1f} % ({spread}; {self.bytes_ratio:.1f}x fewer bytes)"


@dataclass(frozen=True)
class Preset:
    """A named compressor setting (``Trainer(strategy=name)``) measured to reach DDP's loss on the LM benchmark.

    Attributes:
        name: the strategy name, ``<compressor>_lm``.
        compressor: the registered compressor name it tunes.
        compressor_class: the compressor built with ``options``.
        options: the compressor's arguments.
        float_embeddings: send the parameters of every ``nn.Embedding`` in fp32 (uncompressed).
        row_levels: compress the parameters of every ``nn.Embedding`` with QSGD at this many levels and one norm per
            embedding row (QSGD's bucket, made a row: a scaler per row), instead of the preset's compressor; 0: the
            preset's compressor compresses them too. With a tied output projection the embedding's gradient is
            dense and, with a large vocabulary, most of the parameters.
        dense_steps: plain fp32 all-reduce for the first steps: a fraction of the run (``float`` in (0, 1), resolved
            from the Trainer's ``max_steps`` when training starts, so the warm-up keeps the share of the run it was
            measured with) or a number of steps (``int``)
            (:class:`~lightning_gradcomp.callbacks.CompressionSchedule`'s ``dense_steps``; Trainer only).
        measured: what it measured.
        recipe: the recipe that runs the same setting on the benchmark's model.
    """

    name: str
    compressor: str
    compressor_class: type[Compressor]
    options: Mapping[str, Any]
    measured: Measurement
    recipe: str
    float_embeddings: bool = False
    dense_steps: Union[int, float] = 0
    row_levels: int = 0

    def __post_init__(self) -> None:
        check_dense_steps("dense_steps", self.dense_steps)
        if self.row_levels and self.float_embeddings:
            raise ValueError(f"Expected one way to send {self.name}'s embeddings, but got float_embeddings=True and "
                             f"row_levels={self.row_levels}. Fix: drop one of them.")

    def embedding_compressors(self, module: nn.Module, named: Mapping[str, nn.Parameter]) -> dict[str, Compressor]:
        """The compressor of each embedding parameter of ``module`` (its name in ``named``) where ``row_levels``
        says so, one per row width (not set up): QSGD with a norm per row. Empty otherwise."""
        if not self.row_levels:
            return {}
        by_width: dict[int, Compressor] = {}
        own: dict[str, Compressor] = {}
        for name in sorted(embedding_names(module, named)):
            width = named[name].shape[-1]
            if width not in by_width:
                by_width[width] = QSGD(levels=self.row_levels, bucket_size=width)
            own[name] = by_width[width]
        return own

    def make_compressor(self) -> Compressor:
        """A fresh compressor with this preset's options."""
        return self.compressor_class(**self.options)

    def describe(self) -> str:
        """The options in words: ``"TernGrad(clip_factor=1.0, bucket_size=64), embeddings in fp32"``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        parts = [f"{self.compressor_class.__name__}({args})"]
        if self.float_embeddings:
            parts.append("embeddings in fp32")
        if self.row_levels:
            parts.append(f"embeddings by QSGD(levels={self.row_levels}) with a norm per row")
        if self.dense_steps:
            parts.append(self.describe_dense())
        return ", ".join(parts)

    def describe_dense(self) -> str:
        """The dense warm-up in words: ``"the first 5 % of the steps dense"``, ``"100 dense steps"`` or ``""``."""
        if isinstance(self.dense_steps, float):
            return f"the first {100 * self.dense_steps:g} % of the steps dense"
        return f"{self.dense_steps} dense steps" if self.dense_steps else ""


@dataclass(frozen=True)
class PaperDefault:
    """A registered compressor name whose paper defaults miss AdamW DDP's loss by more than 2 %.

    Attributes:
        measured: the paper default's measurement.
        preset: the preset that closes the gap, or ``None`` when no setting within 2 % was found.
        best: the best setting found when there is no preset.
    """

    measured: Measurement
    preset: Optional[str] = None
    best: Optional[Measurement] = None


#: DDP at seeds 0-2 with the recipe's 100 warm-up steps, and with 300 (DeMo's runs)
_DDP = ("ddp", "ddp_seed1", "ddp_seed2")
_DDP300 = ("ddp_warm300", "ddp_warm300_seed1", "ddp_warm300_seed2", "ddp_warm300_seed3", "ddp_warm300_seed4")

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("terngrad_lm", "terngrad", TernGrad, {"clip_factor": 1.0, "bucket_size": 64}, float_embeddings=True,
           recipe="recipes/lm/gpt_small_terngrad_b64.yaml",
           measured=Measurement((("terngrad_fp32emb_clip1_b64", _DDP[0]), ("terngrad_fp32emb_clip1_b64_seed1", _DDP[1]),
                                 ("terngrad_fp32emb_clip1_b64_seed2", _DDP[2])), 1.1, 4.3,
                                "a scaler per 64 elements, clipping at 1 sigma, embeddings in fp32")),
    Preset("qsgd_lm", "qsgd", QSGD, {"levels": 31}, recipe="recipes/lm/gpt_small_qsgd31.yaml",
           measured=Measurement((("qsgd_s31", _DDP[0]), ("qsgd_s31_seed1", _DDP[1]), ("qsgd_lm_seed2", _DDP[2])),
                                -0.0, 5.3, "31 levels")),
    # 0.05: the stored runs' 100 dense steps of 2000, as a share of the run (200 steps: 10)
    Preset("graddrop_lm", "graddrop", GradientDropping, {"drop_ratio": 0.8, "scope": "global"}, dense_steps=0.05,
           recipe="recipes/lm/gpt_small_graddrop08.yaml",
           measured=Measurement((("graddrop_0.8_global_dense100", _DDP[0]), ("graddrop_0.8_global_dense100_seed1", _DDP[1]),
                                 ("graddrop_lm_seed2", _DDP[2])), 1.2, 2.3,
                                "drop ratio 0.8, one global threshold, the first 5 % of the run dense (100 of 2000 steps)")),
    Preset("demo_lm", "demo", DeMo, {"chunk": 16, "topk": 8, "index_dtype": "uint8"},
           recipe="recipes/lm/gpt_small_demo_c16_k8.yaml",
           measured=Measurement((("demo_c16_k8", _DDP300[0]), ("demo_c16_k8_u8_lr7e-3_warm300_seed1", _DDP300[1]),
                                 ("demo_c16_k8_u8_lr7e-3_warm300_seed2", _DDP300[2]),
                                 ("demo_c16_k8_seed3", _DDP300[3]), ("demo_c16_k8_seed4", _DDP300[4])), 1.8, 20.9,
                                "16x16 chunks, top-8, one-byte indices",
                                measured_with="SignSGD at lr 0.007 and 300 warm-up steps, against AdamW DDP "
                                              "with the same warm-up")),
]}
"""The ``<compressor>_lm`` presets by strategy name: each compressor's setting measured within 2 % of AdamW DDP."""

PAPER_DEFAULTS: dict[str, PaperDefault] = {
    "terngrad": PaperDefault(Measurement((("terngrad", "ddp"),), 10.6, 15.9, "the paper's defaults"), "terngrad_lm"),
    "qsgd": PaperDefault(Measurement((("qsgd", "ddp"),), 8.8, 7.9, "the paper's defaults"), "qsgd_lm"),
    "graddrop": PaperDefault(Measurement((("graddrop", "ddp"),), 145.8, 45.8, "the paper's defaults"), "graddrop_lm"),
    "demo": PaperDefault(Measurement((("demo", "ddp"),), 72.8, 44.1, "the paper's defaults",
                                     measured_with="its SignSGD at lr 0.001"), "demo_lm"),
    "onebit": PaperDefault(Measurement((("onebit", "ddp"),), 15.7, 17.9, "the paper's defaults"),
                           best=Measurement((("onebit_fp32emb_dense100", "ddp"),), 6.4, 3.9,
                                            "embeddings in fp32, 100 dense steps")),
    "powersgd": PaperDefault(Measurement((("powersgd", "ddp"),), 98.2, 28.1, "the paper's defaults"),
                             best=Measurement((("powersgd_r16", "ddp"),), 5.0, 2.5, "rank 16")),
    "topk": PaperDefault(Measurement((("topk", "ddp"),), 166.5, 59.0, "the paper's defaults"),
                         best=Measurement((("topk_10pct_dense100", "ddp"),), 6.8, 4.0, "10 % kept, 100 dense steps")),
    "dgc": PaperDefault(Measurement((("dgc", "ddp"),), 165.1, 59.0, "the paper's defaults"),
                        best=Measurement((("dgc_10pct_dense100", "ddp"),), 7.7, 4.1, "10 % kept, 100 dense steps")),
    "adacomp": PaperDefault(Measurement((("adacomp", "ddp"),), 170.3, 195.9, "the paper's defaults"),
                            best=Measurement((("adacomp_bin10_dense100", "ddp"),), 15.6, 9.9,
                                             "bins of 10, 100 dense steps")),
}
"""Each registered compressor name's paper default as measured with AdamW on the LM benchmark, and the preset that
closes its gap (``None`` where no setting within 2 % of DDP was found): what the setup warning says."""


def preset_names() -> list[str]:
    """Every preset's strategy name."""
    return sorted(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset registered as ``name``.

    Raises:
        ValueError: no preset has that name.
    """
    from lightning_gradcomp.registry import did_you_mean

    if name not in PRESETS:
        raise ValueError(f"Expected `preset` to be one of {preset_names()}, but got {name!r}. "
                         f"Fix: {did_you_mean(name, preset_names())}use one of those names.")
    return PRESETS[name]


# -- the measurements, recomputed from stored runs (the test and the docs' table; no file I/O here) ----------------
def total_bytes(run: Mapping[str, Any], dense_steps: Union[int, float] = 0) -> float:
    """A stored run's bytes over the whole run: its ``total_bytes``, or, for runs stored before it was recorded,
    ``dense_steps`` (steps, or a fraction of the run's) at fp32 and the rest at its ``bytes_per_step``."""
    if "total_bytes" in run:
        return float(run["total_bytes"])
    steps = run["steps"]
    dense = resolve_dense_steps(dense_steps, steps)
    return dense * run["fp32_bytes_per_step"] + (steps - dense) * run["bytes_per_step"]


def measure(runs: Mapping[str, Mapping[str, Any]], pairs: Sequence[tuple[str, str]],
            dense_steps: Union[int, float] = 0) -> tuple[float, float]:
    """``(gap, bytes_ratio)`` of :class:`Measurement` from the stored runs (label -> the run's JSON), unrounded."""
    gaps = [runs[run]["final_val_loss"] / runs[ddp]["final_val_loss"] - 1 for run, ddp in pairs]
    first = runs[pairs[0][0]]
    ratio = first["fp32_bytes_per_step"] * first["steps"] / total_bytes(first, dense_steps)
    return 100 * statistics.mean(gaps), ratio


# -- which setups warn ---------------------------------------------------------------------------------------------
def _settings(compressor: Compressor) -> dict[str, Any]:
    # a seed picks other random draws of the same method: not another setting
    return {k: v for k, v in compressor.describe().items() if k != "seed"}


def paper_default_name(compressor: Compressor) -> Optional[str]:
    """The registered name whose paper defaults ``compressor`` has (an instance built with no arguments counts as
    the default too), or ``None`` for a customised compressor."""
    from lightning_gradcomp.registry import COMPRESSORS

    for name in PAPER_DEFAULTS:
        default = COMPRESSORS[name][0]()
        if type(default) is type(compressor) and _settings(default) == _settings(compressor):
            return name
    return None


def _is_adam(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def paper_default_warning(compressor: Compressor, optimizers: Sequence[torch.optim.Optimizer],
                          customised: bool = False) -> Optional[str]:
    """The warning for a paper default trained with Adam or AdamW, or ``None``.

    ``None`` unless an optimizer is ``torch.optim.Adam``/``AdamW`` (or a subclass), the compressor has the paper's
    defaults of a name in :data:`PAPER_DEFAULTS`, and the exchange is not ``customised`` (``exclude``,
    ``min_numel``: a setting nobody measured). Presets never have the paper's defaults.
    """
    adams = sorted({type(o).__name__ for o in optimizers if _is_adam(o)})
    name = None if customised or not adams else paper_default_name(compressor)
    if name is None:
        return None
    entry = PAPER_DEFAULTS[name]
    paper = entry.measured
    with_what = f" (with {paper.measured_with})" if paper.measured_with else ""
    head = (f"Expected a compressor setting measured to reach DDP's loss with {' and '.join(adams)}, but got "
            f"strategy={name!r}: {type(compressor).__name__} at the paper's defaults{with_what}, which ended "
            f"{paper.describe()} above AdamW DDP's validation loss, measured on {WORKLOAD.describe()}.")
    if entry.preset is not None:
        preset = PRESETS[entry.preset]
        with_what = f" with {preset.measured.measured_with}" if preset.measured.measured_with else ""
        fix = (f"Fix: strategy={preset.name!r} ({preset.describe()}{with_what}): {preset.measured.describe()} above "
               f"DDP; or pass a customised Compressor instance.")
    else:
        assert entry.best is not None
        fix = (f"No setting within 2 % of DDP was found; the best measured is {entry.best.setting}: "
               f"{entry.best.describe()} above DDP. Fix: try that setting (a Compressor instance with its options), or "
               f"another compressor with a preset: {preset_names()}.")
    return f"{head} {fix}"


# -- the strategies --------------------------------------------------------------------------------------------------
def embedding_names(module: nn.Module, named: Mapping[str, nn.Parameter]) -> frozenset[str]:
    """The names in ``named`` of the parameters of every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``module`` (a
    weight tied to an output projection keeps the name ``named`` gives it)."""
    ids = {id(p) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}
    return frozenset(n for n, p in named.items() if id(p) in ids)


def preset_compressor(preset: str, kwargs: Mapping[str, Any], strategy: str,
                      row_levels: Optional[int] = None) -> tuple[Preset, Compressor]:
    """The preset named ``preset`` and a fresh compressor of it, for a strategy built with ``kwargs``; with
    ``row_levels``, its embeddings compressed by QSGD at that many levels with a norm per row instead
    (:attr:`Preset.row_levels`; the preset's measurement is of its own setting).

    Raises:
        ValueError: an unknown preset, a ``compressor`` in ``kwargs`` (the preset's is the point), or ``row_levels``
            below 1.
    """
    chosen = get_preset(preset)
    if row_levels is not None:
        check_int("row_levels", row_levels, minimum=1, fix="use e.g. 31 (QSGD's levels per embedding row), or None")
        chosen = replace(chosen, float_embeddings=False, row_levels=row_levels)
    if kwargs.get("compressor") is not None:
        raise ValueError(
            f"Expected `compressor` to be unset for {strategy}(preset={preset!r}), but got {kwargs['compressor']!r}. "
            f"Fix: drop it (the preset's compressor is {chosen.describe()}), or use GradCompStrategy for another one."
        )
    return chosen, chosen.make_compressor()


def register(strategy_cls: type, strategy_registry: Any = None) -> None:
    """Register every preset's name (and its ``<name>_notebook``) for ``strategy_cls`` (``PresetStrategy``, or
    ``PresetFabricStrategy`` with Fabric's ``STRATEGY_REGISTRY``, where a preset with dense steps fails at
    construction, naming the Trainer: they need its ``CompressionSchedule``) in the Trainer's ``StrategyRegistry``
    (default) or the one given. The caller passes the class: the strategies import this module."""
    from lightning_gradcomp.registry import register_preset

    for preset in PRESETS.values():
        register_preset(preset.name, strategy_cls, _description(preset), strategy_registry, preset=preset.name)


def _description(preset: Preset) -> str:
    with_what = f", with {preset.measured.measured_with}" if preset.measured.measured_with else ""
    return (f"{preset.describe()}: {preset.measured.describe()} over AdamW DDP on the LM benchmark{with_what} "
            f"(lightning_gradcomp.strategies.presets)")
