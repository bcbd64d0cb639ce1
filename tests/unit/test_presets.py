"""The presets' table (lightning_gradcomp/strategies/presets.py) against the stored runs it rests on, and which setups warn.

Every number the paper-default warning prints comes from that table; this test recomputes each from the stored
JSON under benchmarks/results/lm_long/, so the warning cannot drift from the data."""

import json
import re
from pathlib import Path
from typing import Any, Union

import pytest
import torch

from lightning_gradcomp import PresetStrategy
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.validation import resolve_dense_steps
from lightning_gradcomp.strategies.presets import (PAPER_DEFAULTS, PRESETS, WORKLOAD, Measurement, embedding_names,
                                                   measure, paper_default_warning)
from lightning_gradcomp.registry import compressor_names, make_compressor, strategy_names

LONG = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "lm_long"


def _runs(measured: Measurement) -> dict[str, Any]:
    return {label: json.loads((LONG / f"{label}.json").read_text()) for pair in measured.runs for label in pair}


def _seed(run: dict[str, Any]) -> int:
    found = re.search(r"--seed_everything=(\d+)", run["command"])
    return int(found.group(1)) if found else 0


def _same_settings(stored: dict[str, Any], compressor: Any) -> bool:
    """A stored run's compressor settings are ``compressor``'s (options added since then kept their defaults)."""
    now = compressor.describe()
    return all(now.get(k) == v for k, v in stored.items())


def _check(measured: Measurement, dense_steps: Union[int, float] = 0) -> dict[str, Any]:
    runs = _runs(measured)
    gap, ratio = measure(runs, measured.runs, dense_steps)
    assert (round(gap, 1), round(ratio, 1)) == (measured.gap, measured.bytes_ratio), measured
    for run, ddp in measured.runs:  # each pair: the same seed, DDP's run plain DDP, 2000 steps on 4 ranks
        assert _seed(runs[run]) == _seed(runs[ddp]), (run, ddp)
        assert runs[ddp]["strategy"] == "DDPStrategy" and runs[run]["steps"] == runs[ddp]["steps"] == 2000
        assert runs[run]["world_size"] == 4
    assert [_seed(runs[run]) for run, _ in measured.runs] == list(range(len(measured.runs)))  # seed 0 first
    return runs


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_numbers_are_the_stored_runs(name: str) -> None:
    preset = PRESETS[name]
    runs = _check(preset.measured, preset.dense_steps)
    for run, _ in preset.measured.runs:
        # the stored run ran this preset's compressor (its settings are in the JSON)
        assert _same_settings(runs[run]["compressor"], preset.make_compressor()), run
        command = runs[run]["command"]
        if f"--trainer.strategy={name}" not in command:  # an earlier run with the same options spelt out
            dense = resolve_dense_steps(preset.dense_steps, runs[run]["steps"])  # a fraction: of the stored run's steps
            assert (f"dense_steps={dense}" in command) == bool(dense), command
            assert ("exclude=[model.token_embedding.weight,model.position_embedding.weight]" in command
                    or "gpt_small_terngrad_b64" in command) == preset.float_embeddings, command
    assert preset.measured.gap <= 2.0  # a preset is within 2 % of DDP, on the mean of its seeds
    assert len(preset.measured.runs) >= 3


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_registered_name_reproduces_the_stored_seed_0_run(name: str) -> None:
    # the first 500 steps through the name (the 2000-step schedule) against the stored run of the same options
    check = json.loads((LONG.parent / "lm_presets_check" / f"{name}.json").read_text())
    stored = json.loads((LONG / f"{PRESETS[name].measured.runs[0][0]}.json").read_text())
    assert f"--trainer.strategy={name}" in check["command"] and check["steps"] == 500
    assert check["val_curve"][0] == stored["val_curve"][0] and check["val_curve"][0][0] == 500  # bit for bit
    assert check["compressor"] == stored["compressor"]


@pytest.mark.parametrize("name", sorted(PAPER_DEFAULTS))
def test_paper_default_numbers_are_the_stored_runs(name: str) -> None:
    entry = PAPER_DEFAULTS[name]
    runs = _check(entry.measured)
    (run, _), *_ = entry.measured.runs
    assert runs[run]["command"].endswith(f"--trainer.strategy={name}") or name == "demo", runs[run]["command"]
    assert _same_settings(runs[run]["compressor"], make_compressor(name))
    assert entry.measured.gap > 2.0
    assert (entry.preset is None) != (entry.best is None)
    if entry.best is not None:
        dense = 100 if "dense100" in entry.best.runs[0][0] else 0
        _check(entry.best, dense)
        assert entry.best.gap > 2.0  # else it would be a preset
    else:
        assert PRESETS[entry.preset].compressor == name  # type: ignore[index]


def test_warning_names_the_gap_and_the_preset_for_adam_and_adamw_only() -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw, sgd = torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)
    for name, entry in PAPER_DEFAULTS.items():
        for optimizer in (adamw, torch.optim.Adam(params), MyAdamW(params)):
            message = paper_default_warning(make_compressor(name), [optimizer])
            assert message is not None and message.startswith("Expected ") and "Fix:" in message
            assert f"{entry.measured.gap:+.1f} %" in message and type(optimizer).__name__ in message
            if entry.preset is not None:
                assert f"strategy={entry.preset!r}" in message
                assert PRESETS[entry.preset].measured.describe() in message
            else:
                assert entry.best is not None
                assert "No setting within 2 % of DDP was found" in message and entry.best.describe() in message
        assert paper_default_warning(make_compressor(name), [sgd]) is None
        assert paper_default_warning(make_compressor(name), [adamw], customised=True) is None
    # within 2 % at the paper default: nothing to say
    for name in sorted(set(compressor_names()) - set(PAPER_DEFAULTS)):
        assert paper_default_warning(make_compressor(name), [adamw]) is None, name
    # an instance built without arguments is the paper default (a seed is not a setting); other options are not
    assert paper_default_warning(TernGrad(seed=3), [adamw]) is not None
    assert paper_default_warning(TernGrad(bucket_size=64), [adamw]) is None
    for preset in PRESETS.values():
        assert paper_default_warning(preset.make_compressor(), [adamw]) is None


def test_warning_names_the_workload_of_the_stored_runs() -> None:
    """The warning says which model, world and run length its numbers come from, and those are the stored runs'."""
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    for name, entry in PAPER_DEFAULTS.items():
        runs = _runs(entry.measured)
        for run, ddp in entry.measured.runs:
            for label in (run, ddp):
                stored = runs[label]
                assert (stored["parameters"], stored["world_size"], stored["steps"]) == \
                    (WORKLOAD.parameters, WORKLOAD.ranks, WORKLOAD.steps), label
        message = paper_default_warning(make_compressor(name), [adamw])
        assert message is not None
        assert "measured on the byte-level GPT of docs/transformers.md (120,576 parameters, 4 ranks, 2000 steps)" \
            in message, message


def test_embeddings_are_the_stored_runs_fp32_names() -> None:
    from gradcomp_lab.models import GPT

    # the runs under earlier names sent these two in fp32 by `exclude`; the preset finds them by module type
    model = GPT(vocab_size=256, width=16, depth=1, num_heads=2, context=8)  # output projection tied to the embedding
    named = dict(model.named_parameters())
    assert embedding_names(model, named) == {"token_embedding.weight", "position_embedding.weight"}


def test_preset_names_are_registered_and_bad_arguments_name_the_fix() -> None:
    assert set(PRESETS) <= set(strategy_names())
    assert all(name == f"{p.compressor}_lm" for name, p in PRESETS.items())
    assert isinstance(PresetStrategy("qsgd_lm").compressor, type(make_compressor("qsgd")))
    with pytest.raises(ValueError, match=r"Expected `preset` to be one of .*'qsgd_lm'.*did you mean 'qsgd_lm'"):
        PresetStrategy("qsgd_ml")
    with pytest.raises(ValueError, match=r"Expected `compressor` to be unset .* Fix: drop it"):
        PresetStrategy("qsgd_lm", compressor="terngrad")


def test_the_readmes_preset_with_hierarchy_node_builds_the_preset_between_nodes() -> None:
    """The README's snippet of a preset over several nodes, evaluated as written: the preset's compressor, and one
    site per node (2 nodes of 8 ranks: 2 sites of 8); Fabric's preset takes the same option."""
    import lightning_gradcomp
    from lightning_gradcomp import PresetFabricStrategy

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = re.search(r"`(PresetStrategy\([^`]*hierarchy=\"node\"[^`]*\))`", readme)
    assert snippet, "the README shows no preset with hierarchy=\"node\""
    strategy = eval(snippet.group(1), {"PresetStrategy": lightning_gradcomp.PresetStrategy})
    assert isinstance(strategy, PresetStrategy) and strategy.preset.name == "terngrad_lm"
    assert isinstance(strategy.compressor, TernGrad) and strategy.compressor.describe() == \
        PRESETS["terngrad_lm"].make_compressor().describe()
    assert strategy.hierarchy is not None and strategy.hierarchy.layout(16, 2).sizes == (8, 8)
    fabric = PresetFabricStrategy("terngrad_lm", hierarchy="node")
    assert fabric.hierarchy is not None and fabric.hierarchy.layout(16, 2).sizes == (8, 8)


@pytest.mark.parametrize(("max_steps", "dense"), [(200, 10), (2000, 100), (1, 1)])
def test_graddrop_lm_warms_up_dense_for_a_share_of_the_run(max_steps: int, dense: int) -> None:
    """The stored runs sent 100 of 2000 steps dense: the preset keeps that share at any length (200 steps: 10, not
    half the run), resolved when training starts from the Trainer's run length, as 1-bit Adam's warm-up fraction is
    (one rule: the nearest step, at least one)."""
    from types import SimpleNamespace

    from lightning_gradcomp.callbacks import CompressionSchedule

    preset = PRESETS["graddrop_lm"]
    assert preset.dense_steps == 0.05 and "the first 5 % of the steps dense" in preset.describe()
    schedule = CompressionSchedule(dense_steps=preset.dense_steps)
    assert schedule.steps_dense is None  # unknown until the run's length is
    trainer = SimpleNamespace(max_steps=max_steps, estimated_stepping_batches=max_steps)
    schedule.on_train_start(trainer, None)  # type: ignore[arg-type]  # only the run's length is read
    assert schedule.steps_dense == dense == resolve_dense_steps(preset.dense_steps, max_steps)
    # a run bounded by epochs: the share of the epochs' steps
    epochs = CompressionSchedule(dense_steps=preset.dense_steps)
    epochs.on_train_start(SimpleNamespace(max_steps=-1, estimated_stepping_batches=max_steps), None)
    assert epochs.steps_dense == dense
    # explicit steps stay steps, whatever the run's length
    explicit = CompressionSchedule(dense_steps=100)
    assert explicit.steps_dense == 100
    explicit.on_train_start(trainer, None)
    assert explicit.steps_dense == 100


@pytest.mark.parametrize("bad", [1.0, 100.0, 1.5, -0.1, 0.0, -3, float("nan"), float("inf"), True, "0.05", None])
def test_bad_dense_steps_are_refused_naming_the_value(bad: Any) -> None:
    from lightning_gradcomp.callbacks import CompressionSchedule
    from lightning_gradcomp.strategies.presets import Preset

    pattern = (r"Expected `dense_steps` to be an int >= 0 \(steps\) or a float in \(0, 1\) \(a fraction of the run\), "
               rf"but got {re.escape(repr(bad))}\. Fix: pass a number of steps")
    with pytest.raises(ValueError, match=pattern):
        CompressionSchedule(dense_steps=bad)
    with pytest.raises(ValueError, match=pattern):
        Preset("x_lm", "x", TernGrad, {}, PRESETS["qsgd_lm"].measured, "", dense_steps=bad)


def test_a_share_of_a_run_without_an_end_is_refused_before_the_first_step() -> None:
    from types import SimpleNamespace

    from lightning_gradcomp.callbacks import CompressionSchedule

    schedule = CompressionSchedule(dense_steps=0.05)
    trainer = SimpleNamespace(max_steps=-1, estimated_stepping_batches=float("inf"))  # Trainer(max_epochs=-1)
    with pytest.raises(ValueError, match=r"Expected a run with a known number of steps for `dense_steps=0.05` .*"
                                         r"but got inf steps .* Fix: set `Trainer\(max_steps=...\)`, or pass the dense "
                                         r"steps as a number of steps"):
        schedule.on_train_start(trainer, None)  # type: ignore[arg-type]
    assert resolve_dense_steps(7, float("inf")) == 7  # steps need no end


def _benchmark_gpt() -> torch.nn.Module:
    """The stored runs' model, built from their recipe's arguments (``recipes/diloco/gpt_stdlib_ddp.yaml``)."""
    import yaml
    from gradcomp_lab.models import GPT

    recipe = yaml.safe_load((LONG.parents[2] / "recipes" / "diloco" / "gpt_stdlib_ddp.yaml").read_text())
    return GPT(**recipe["model"]["init_args"]["model"]["init_args"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_bytes_are_the_ratio_it_states(name: str) -> None:
    """Each preset's compressor, fp32 names and dense warm-up through the hook's exchange (one process, 4 ranks'
    loopback) on the model its statement is about: fp32 DDP's bytes over the preset's over a run of the stated length,
    dense steps included, round to the ``bytes_ratio`` it states (and the docs' tables and the warning print)."""
    from lightning_gradcomp.exchange.codec import measure_exchange
    from lightning_gradcomp.strategies.presets import total_bytes

    preset = PRESETS[name]
    torch.manual_seed(0)
    model = _benchmark_gpt()
    named = dict(model.named_parameters())
    assert sum(p.numel() for p in named.values()) == WORKLOAD.parameters
    tokens = torch.randint(0, 256, (8, 65))  # one batch of the benchmark's shape: 8 sequences of 64 bytes
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    names = list(named)[::-1]  # DDP's bucket order: the last layers' gradients first
    compressor = preset.make_compressor()
    compressor.setup(0, WORKLOAD.ranks, torch.device("cpu"))
    floats = embedding_names(model, named) if preset.float_embeddings else frozenset()
    own = preset.embedding_compressors(model, named)
    for row_compressor in own.values():
        row_compressor.setup(0, WORKLOAD.ranks, torch.device("cpu"))
    codec = measure_exchange(compressor, names, [named[n].grad.detach() for n in names],  # type: ignore[union-attr]
                             WORKLOAD.ranks, repeats=0, float_names=floats, layer_compressors=own)
    fp32 = 4 * WORKLOAD.parameters
    step = codec.nbytes + codec.shared_nbytes  # the shared scalers travel too, as the stored runs count them
    run = {"steps": WORKLOAD.steps, "fp32_bytes_per_step": fp32, "bytes_per_step": step}
    ratio = fp32 * WORKLOAD.steps / total_bytes(run, preset.dense_steps)
    assert round(ratio, 1) == preset.measured.bytes_ratio, (name, ratio, step)
    assert f"{preset.measured.bytes_ratio:.1f}x fewer bytes" in preset.measured.describe()


def test_embedding_rows_by_their_own_compressor_send_qsgds_bytes_per_row() -> None:
    """``row_levels``: the embeddings go through QSGD with a norm per row, the rest through the preset's compressor,
    in one bucket: the exchange's bytes are exactly those of the two parts exchanged apart (both 4 ranks' loopback)."""
    from lightning_gradcomp.compressors import QSGD
    from lightning_gradcomp.exchange.codec import measure_exchange
    from lightning_gradcomp.strategies.presets import preset_compressor

    preset, compressor = preset_compressor("terngrad_lm", {}, "PresetStrategy", row_levels=31)
    assert not preset.float_embeddings and "QSGD(levels=31) with a norm per row" in preset.describe()
    torch.manual_seed(0)
    model = _benchmark_gpt()
    named = dict(model.named_parameters())
    logits = model(torch.randint(0, 256, (2, 64)))
    logits.square().mean().backward()
    names = list(named)[::-1]
    own = preset.embedding_compressors(model, named)
    tokens, positions = named["token_embedding.weight"], named["position_embedding.weight"]
    width = tokens.shape[1]
    assert set(own) == {"token_embedding.weight", "position_embedding.weight"}
    assert all(isinstance(c, QSGD) and c.levels == 31 and c.bucket_size == width for c in own.values())
    for c in (compressor, *own.values()):
        c.setup(0, WORKLOAD.ranks, torch.device("cpu"))
    grads = {n: named[n].grad.detach() for n in names}  # type: ignore[union-attr]
    both = measure_exchange(compressor, names, [grads[n] for n in names], WORKLOAD.ranks, repeats=0,
                            layer_compressors=own)
    rest = [n for n in names if n not in own]
    alone = measure_exchange(compressor, rest, [grads[n] for n in rest], WORKLOAD.ranks, repeats=0)
    rows = sum(c.payload_nbytes(named[n].numel()) for n, c in own.items() if isinstance(c, QSGD))
    # 6 bits per element (a sign and 5 level bits) and a 4-byte norm per row of 64: 52 bytes a row
    assert rows == 52 * (tokens.shape[0] + positions.shape[0])
    assert both.nbytes + both.shared_nbytes == alone.nbytes + alone.shared_nbytes + rows


def test_row_levels_below_one_are_refused_naming_the_value() -> None:
    from lightning_gradcomp.strategies.presets import preset_compressor

    with pytest.raises(ValueError, match="row_levels.*0"):
        preset_compressor("terngrad_lm", {}, "PresetStrategy", row_levels=0)
