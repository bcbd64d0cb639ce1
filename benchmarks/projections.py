"""The performance model's projections that ``docs/choosing.md`` shows beside the measured numbers, stored as JSON.

Not a measurement: ``gradcomp-perf``'s model (``gradcomp_lab.perfmodel``) for two GPU clusters, each 16 GPUs as
2 nodes of 8, the link between the nodes at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s:

* transformer: a 1.3B-parameter GPT (width 2048, depth 24, 8 x 2048 tokens per GPU) on H100s, every row of
  ``gradcomp-perf transformer --width 2048 --depth 24 --seq-len 2048 --batch 8 --nproc 16 --gpus-per-node 8
  --gpu h100 --link 100mbit 1gbit 10gbit --diloco-h 50 100 --kernels benchmarks/results/gpu_h100/kernels.json``
  (each compressor at its best stored setting; the codec cost of the compressors with kernel rows from the H100's
  stored kernel run, ``--kernels``);
* cnn: AlexNet (batch 128 per GPU) on A100s, ``gradcomp-perf predict --model alexnet --device a100 --nproc 16
  --gpus-per-node 8 --intra 900gbit@5us`` for fp32 DDP and the flat rows on DDP's timeline (``--overlap``) and
  the hierarchical rows (``--hierarchical``).

The model reads the stored language-model runs (their bytes), so rerun this after those change; storing the
projection keeps the docs' tables cheap to check (the AlexNet codecs take seconds to build).

Usage: python benchmarks/projections.py [--out benchmarks/results/projections/choosing.json] [--kernels PATH]
"""

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lm import provenance  # noqa: E402
from gradcomp_lab.perfmodel import (  # noqa: E402
    LM_SETTINGS,
    KernelThroughput,
    gpt_shapes,
    load_kernels,
    predict_paper_model,
    transformer_projection,
)

LINKS = ["100mbit", "1gbit", "10gbit"]
#: the stored kernel run of the transformer's GPU (its codec cost for the compressors it has rows for)
KERNELS = ROOT / "benchmarks/results/gpu_h100/kernels.json"
TRANSFORMER: dict[str, Any] = {"width": 2048, "depth": 24, "seq_len": 2048, "batch": 8, "world_size": 16, "device": "h100",
               "gpus_per_node": 8, "sync_every": [50, 100]}
CNN: dict[str, Any] = {"model": "alexnet", "device": "a100", "world_size": 16, "gpus_per_node": 8, "intra": "900gbit@5us"}
#: (compressor, hierarchical): fp32 DDP and the flat rows on DDP's timeline, the hierarchical rows serial
CNN_CASES = [("fp32-ddp", False), ("terngrad", False), ("terngrad", True), ("adacomp", False), ("adacomp", True)]


def transformer_rows(kernels: KernelThroughput) -> list[dict[str, Any]]:
    """Every method of ``gradcomp-perf transformer`` on each link: step, its parts, speed-up over DDP."""
    spec = TRANSFORMER
    rows = transformer_projection(spec["width"], spec["depth"], spec["seq_len"], spec["batch"], spec["world_size"],
                                  LINKS, spec["device"], gpus_per_node=spec["gpus_per_node"],
                                  sync_every=spec["sync_every"], kernels=kernels)
    return [{"method": r.method, "setting": r.setting, "link": r.link, "bytes_ratio": r.bytes_ratio,
             "loss_vs_ddp": None if math.isnan(r.loss_vs_ddp) else r.loss_vs_ddp, "step_s": r.prediction.step_s,
             "compute_s": r.prediction.compute_s, "comm_s": r.prediction.comm_s, "speedup": r.speedup} for r in rows]


def cnn_rows() -> list[dict[str, Any]]:
    """AlexNet's projected step per compressor, exchange and link, with the speed-up over fp32 DDP's."""
    spec = CNN
    rows = []
    for link in LINKS:
        steps = {}
        for compressor, hierarchical in CNN_CASES:
            p = predict_paper_model(spec["model"], compressor, spec["world_size"], link, spec["device"],
                                    gpus_per_node=spec["gpus_per_node"], intra=spec["intra"],
                                    overlap=not hierarchical, hierarchical=hierarchical)
            steps[compressor, hierarchical] = p.step_s
            rows.append({"compressor": compressor, "hierarchical": hierarchical, "link": link, "step_s": p.step_s,
                         "collective": p.collective, "speedup": steps["fp32-ddp", False] / p.step_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/projections/choosing.json")
    parser.add_argument("--kernels", type=Path, default=KERNELS,
                        help="the transformer GPU's stored kernel run (benchmarks/kernels.py --json)")
    args = parser.parse_args()
    kernels = load_kernels(args.kernels)
    compressors = [s.name for s in LM_SETTINGS if s.name not in ("ddp", "bf16")]
    codec = {"file": Path(kernels.source).resolve().relative_to(ROOT).as_posix(), "device": kernels.device,
             "size": kernels.size, "measured": sorted(kernels.seconds), "assumed": kernels.assumed(compressors)}
    stamp = provenance()  # the code that runs: the tree may change before the run ends
    numel = sum(math.prod(shape) for _, shape in gpt_shapes(TRANSFORMER["width"], TRANSFORMER["depth"],
                                                             context=TRANSFORMER["seq_len"]))
    result = {"command": shlex.join(["python", "benchmarks/projections.py", *sys.argv[1:]]),
              "machine": "none: a projection of the performance model", **stamp,
              "transformer": {**TRANSFORMER, "links": LINKS, "parameters": numel, "kernels": codec,
                              "rows": transformer_rows(kernels)},
              "cnn": {**CNN, "links": LINKS, "rows": cnn_rows()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"stored {args.out}")


if __name__ == "__main__":
    main()
