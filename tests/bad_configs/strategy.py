"""Invalid GradCompStrategy configurations (constructor, and the hook set-up that runs before step 0)."""

from datetime import timedelta

import torch

from lightning_gradcomp import GradCompStrategy
from tests.bad_configs import BadConfig


def _exclude_matching_nothing() -> None:
    # what _register_ddp_hooks does at DDP wrap time, before the first step
    GradCompStrategy(exclude=["classifier.*"])._float_names({"net.0.weight": torch.nn.Parameter(torch.ones(2))})


def _nccl_on_cpu() -> None:
    # what setup_environment checks first, before any process group exists
    strategy = GradCompStrategy(process_group_backend="nccl", parallel_devices=[torch.device("cpu")])
    strategy.set_world_ranks()
    strategy.setup_environment()


def _custom_hook(state: object, bucket: object) -> None:
    return None


# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig("strategy-compressor-typo", lambda: GradCompStrategy(compressor="terngrd"), "compressor", "'terngrd'"),
    BadConfig("strategy-compressor-int", lambda: GradCompStrategy(compressor=3), "compressor", "3"),
    BadConfig("strategy-compressor-class", lambda: GradCompStrategy(compressor=torch.nn.Linear), "compressor", "Linear"),
    BadConfig("strategy-pipeline-zero", lambda: GradCompStrategy(pipeline_mb=0), "pipeline_mb", "0"),
    BadConfig("strategy-pipeline-str", lambda: GradCompStrategy(pipeline_mb="8"), "pipeline_mb", "'8'"),
    BadConfig("strategy-min-numel-zero", lambda: GradCompStrategy(min_numel=0), "min_numel", "0"),
    BadConfig("strategy-min-numel-float", lambda: GradCompStrategy(min_numel=1.5), "min_numel", "1.5"),
    BadConfig("strategy-min-numel-bool", lambda: GradCompStrategy(min_numel=True), "min_numel", "True"),
    BadConfig("strategy-exclude-str", lambda: GradCompStrategy(exclude="classifier.*"), "exclude", "'classifier.*'"),
    BadConfig("strategy-exclude-int", lambda: GradCompStrategy(exclude=[3]), "exclude", "[3]"),
    BadConfig("strategy-exclude-no-match", _exclude_matching_nothing, "exclude", "'classifier.*'"),
    BadConfig("strategy-comm-hook", lambda: GradCompStrategy(ddp_comm_hook=_custom_hook), "ddp_comm_hook", "_custom_hook"),
    BadConfig("strategy-model-averaging", lambda: GradCompStrategy(model_averaging_period=4), "model_averaging_period", "4"),
    BadConfig("strategy-unknown-option", lambda: GradCompStrategy(clip_factor=2.5), "clip_factor", "clip_factor"),
    BadConfig("strategy-replicas-negative", lambda: GradCompStrategy(check_replicas_every=-1), "check_replicas_every", "-1"),
    BadConfig("strategy-replicas-float", lambda: GradCompStrategy(check_replicas_every=1.5), "check_replicas_every", "1.5"),
    BadConfig("strategy-replicas-str", lambda: GradCompStrategy(check_replicas_every="10"), "check_replicas_every", "'10'"),
    BadConfig("strategy-nonfinite", lambda: GradCompStrategy(nonfinite="nan"), "nonfinite", "'nan'"),
    BadConfig("strategy-nonfinite-bool", lambda: GradCompStrategy(nonfinite=True), "nonfinite", "True"),
    BadConfig("strategy-resume", lambda: GradCompStrategy(resume_compression="strict"), "resume_compression", "'strict'"),
    BadConfig("strategy-timeout-int", lambda: GradCompStrategy(timeout=30), "timeout", "30"),
    BadConfig("strategy-timeout-zero", lambda: GradCompStrategy(timeout=timedelta(0)), "timeout", "timedelta(0)"),
    BadConfig("strategy-bucket-cap-negative", lambda: GradCompStrategy(bucket_cap_mb=-25), "bucket_cap_mb", "-25"),
    BadConfig("strategy-bucket-cap-zero", lambda: GradCompStrategy(bucket_cap_mb=0), "bucket_cap_mb", "0"),
    BadConfig("strategy-bucket-cap-str", lambda: GradCompStrategy(bucket_cap_mb="25"), "bucket_cap_mb", "'25'"),
    BadConfig("strategy-unused-str", lambda: GradCompStrategy(find_unused_parameters="false"),
              "find_unused_parameters", "'false'"),
    BadConfig("strategy-static-graph-str", lambda: GradCompStrategy(static_graph="no"), "static_graph", "'no'"),
    BadConfig("strategy-bucket-view-int", lambda: GradCompStrategy(gradient_as_bucket_view=1),
              "gradient_as_bucket_view", "1"),
    BadConfig("strategy-broadcast-buffers-str", lambda: GradCompStrategy(broadcast_buffers="False"),
              "broadcast_buffers", "'False'"),
    BadConfig("strategy-ddp-kwarg-bool-str", lambda: GradCompStrategy(check_reduction="true"), "check_reduction", "'true'"),
    BadConfig("strategy-link-words", lambda: GradCompStrategy(link="1 gigabit"), "link", "'1 gigabit'"),
    BadConfig("strategy-link-int", lambda: GradCompStrategy(link=1000), "link", "1000"),
    BadConfig("strategy-backend-int", lambda: GradCompStrategy(process_group_backend=1), "process_group_backend", "1"),
    BadConfig("strategy-nccl-on-cpu", _nccl_on_cpu, "process_group_backend", "'nccl'"),
]
