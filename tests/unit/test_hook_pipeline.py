"""Grouping of a bucket's parameters for pipelined collectives (the hook's ``pipeline_bytes``)."""

import ast
import inspect
import re
from pathlib import Path

import torch.distributed as dist

import lightning_gradcomp
from lightning_gradcomp.exchange.groups import HookBucket, pipeline_chunks
from lightning_gradcomp.exchange.hook import gradcomp_hook


def test_one_group_without_a_limit() -> None:
    assert pipeline_chunks([4, 8, 16], None) == [[0, 1, 2]]
    assert pipeline_chunks([], None) == []


def test_groups_close_once_they_reach_the_limit_and_never_split_a_parameter() -> None:
    assert pipeline_chunks([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert pipeline_chunks([100, 1, 1, 100], 8) == [[0], [1, 2, 3]]
    assert pipeline_chunks([100, 100], 1) == [[0], [1]]
    # every index exactly once, in order
    chunks = pipeline_chunks([3, 9, 1, 7, 2, 8], 10)
    assert [i for c in chunks for i in c] == list(range(6))


def test_the_hook_takes_any_hook_bucket_and_no_caller_silences_the_type_checker() -> None:
    """``gradcomp_hook`` is typed for the bucket protocol it reads, so a stand-in bucket (an outer round's, a
    shard's, a worker's outside DDP) is checked by mypy at every call instead of a ``type: ignore``."""
    source = Path(inspect.getsourcefile(gradcomp_hook) or "").read_text()
    (hook,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "gradcomp_hook"]
    assert ast.unparse(hook.args.args[1].annotation or ast.Constant(None)) == HookBucket.__name__
    # while DDP, which checks the annotation at run time, still takes it (its register_comm_hook accepts no other)
    assert inspect.signature(gradcomp_hook).parameters["bucket"].annotation is dist.GradBucket
    root = Path(lightning_gradcomp.__file__).resolve().parent
    silenced = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bgradcomp_hook\(", line) and "type: ignore" in line
    ]
    assert not silenced, f"gradcomp_hook calls under `type: ignore`: {silenced}"
