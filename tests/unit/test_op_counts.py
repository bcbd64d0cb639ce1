"""The gradcomp hook's dispatched ops and host reads per step do not grow with the number of parameter tensors.

Issue 17's deterministic test (counts, never timings): one step at world size 1 (an in-process 1-rank Gloo group)
of residual MLPs with 40 and 160 parameter tensors (one DDP bucket), counted by :mod:`gradcomp_lab.opcount` as ops
beyond the same step of DDP with torch's own all-reduce hook, on the path a GPU runs. Before
the batched pipeline every compressor grew by 9 to 142 ops per tensor (benchmarks/results/op_counts/before.json).
"""

from functools import cache

import pytest
import torch

from lightning_gradcomp import registry
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.graddrop import GradientDropping
from lightning_gradcomp.compressors.topk import TopK
from gradcomp_lab.opcount import OpCount, count_ops, hook_op_overhead

NAMES = registry.compressor_names()


def gpu_path(name: str) -> Compressor:
    """The registered compressor taking the path a GPU runs, on CPU too (top-k's and DGC's batched selection: on a
    CPU they select with a partial selection per layer, cheaper there than the group's sorts)."""
    compressor = registry.COMPRESSORS[name][0]()
    if isinstance(compressor, TopK):
        compressor.selection = "batched"
    return compressor


@cache
def _overhead(name: str, tensors: int) -> OpCount:
    return hook_op_overhead(lambda: gpu_path(name), tensors)


@pytest.mark.parametrize("name", NAMES)
def test_hook_ops_do_not_grow_with_tensor_count(name: str) -> None:
    assert _overhead(name, 160).total == _overhead(name, 40).total


@pytest.mark.parametrize("name", NAMES)
def test_hook_reads_the_host_once_per_step_whatever_the_tensor_count(name: str) -> None:
    # the one read: the non-finite guard's flag, per bucket (Gradient Dropping read a threshold per tensor before)
    assert _overhead(name, 160).host_reads == _overhead(name, 40).host_reads == 1


@pytest.mark.parametrize("name", NAMES)
def test_hook_data_dependent_ops_do_not_grow_with_tensor_count(name: str) -> None:
    # at most one compaction per group (DGC's survivors); AdaComp and DGC had one or more per tensor before
    assert _overhead(name, 160).data_dependent == _overhead(name, 40).data_dependent <= 1


def test_graddrop_torch_backend_reads_no_scalar_and_compacts_once_per_bucket() -> None:
    # the path CUDA runs: the tie rule is a device mask, not a host branch (one read per bucket: the guard's flag),
    # and the survivors of every layer are compacted by one nonzero for the whole group (40 and 160 before)
    few, many = (hook_op_overhead(lambda: GradientDropping(backend="torch"), n) for n in (40, 160))
    assert few.host_reads == many.host_reads == 1
    assert (few.data_dependent, many.data_dependent) == (1, 1)


def test_graddrop_torch_backend_ops_do_not_grow_with_tensor_count() -> None:
    few, many = (hook_op_overhead(lambda: GradientDropping(backend="torch"), n) for n in (40, 160))
    assert few.total == many.total


def test_counter_sees_scalar_reads_list_reads_and_data_dependent_ops() -> None:
    x = torch.tensor([0.0, 2.0, -1.0])
    with count_ops() as counted:
        x.sum().item()
        bool(x[0] > 0)
        x.tolist()
        torch.nonzero(x)
        x[x > 0]
        x.add(1)
    assert counted.host_reads == 3
    assert counted.data_dependent == 2
    assert counted.ops["add.Tensor"] == 1
    assert counted.total == sum(counted.ops.values()) >= 9


def test_the_fp32_hook_adds_a_few_dozen_ops_per_bucket_and_reads_the_guard_flag_once() -> None:
    # one bucket: the guard's flag (a sum, a test, one read), one concatenation, the all-reduce's bookkeeping and
    # the averaged write-back; 433 ops at 40 tensors before the batched pipeline (benchmarks/results/op_counts/before.json)
    few = _overhead("fp32", 40)
    assert 10 <= few.total <= 40
    assert few.host_reads == 1
