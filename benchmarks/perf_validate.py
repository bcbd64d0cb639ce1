"""Validate the performance model (gradcomp_lab.perfmodel) against the emulated-cluster step times.

Reads the JSON written by ``benchmarks/step_time.py``, profiles each model's compute (one process, one thread,
one worker's batch) and TernGrad's codec on this machine, predicts every measured configuration and prints
measured vs predicted step time with the relative error: the serial model (communication after compute) and
DDP's timeline (``overlap=True``: each of DDP's buckets, as DDP assigns them for the model, sent behind the
rest of backward). Where the step-time JSON holds compute and codec timed on the cluster itself
(``--profile-compute``), those totals are used, split into forward / backward / update and encode / decode in
the proportions profiled here.

    python benchmarks/perf_validate.py benchmarks/results/step_time.json
    python benchmarks/perf_validate.py benchmarks/results/step_time_target_default_{1..8}.json   # several runs, one table
"""

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from benchmarks.step_time import BATCH, MALLOC_REUSE_ENV, build_model, input_shape

from gradcomp_lab.perfmodel import (
    ComputeTime,
    ddp_bucket_fractions,
    fp32_codec,
    measure_cast_codec,
    predict,
    profile_compute,
)
from lightning_gradcomp import registry
from lightning_gradcomp.exchange.codec import Codec, measure_codec
from lightning_gradcomp.exchange.costmodel import Link, Network, parse_rate


def _same_allocator_as(reports: dict[str, dict]) -> None:
    """Profile with the allocator setting the measured ranks ran with: glibc reads it at process start, so runs
    measured with ``--malloc-reuse`` make this process start again with the same environment."""
    reuse = {path: "--malloc-reuse" in r.get("command", "").split() for path, r in reports.items()}
    if len(set(reuse.values())) > 1:
        raise SystemExit("measured files mix --malloc-reuse runs " + str([p for p, v in reuse.items() if v]) +
                         " with default-allocator runs: validate each group in its own call")
    if any(reuse.values()) and any(os.environ.get(k) != v for k, v in MALLOC_REUSE_ENV.items()):
        print("the measured run used --malloc-reuse: profiling with " + " ".join(f"{k}={v}" for k, v in MALLOC_REUSE_ENV.items()))
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_REUSE_ENV})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measured", nargs="+", help="JSON from benchmarks/step_time.py (one or more runs)")
    parser.add_argument("--json", default=None, help="write predictions here")
    parser.add_argument("--mlp-width", type=int, default=4096, help="as given to step_time.py")
    args = parser.parse_args()
    reports = {path: json.loads(Path(path).read_text()) for path in args.measured}
    _same_allocator_as(reports)
    torch.set_num_threads(1)  # each emulated rank runs with OMP_NUM_THREADS=1
    cores = os.cpu_count() or 1
    width = args.mlp_width
    shapes = {name: [(n, tuple(p.shape)) for n, p in build_model(name, width).named_parameters()] for name in ("mlp", "lenet")}
    profiled: dict[tuple[str, int], ComputeTime] = {}

    def compute(name: str, batch: int) -> ComputeTime:
        """One worker's forward + backward + update, profiled alone once per (model, per-rank batch)."""
        if (name, batch) not in profiled:
            profiled[name, batch] = profile_compute(build_model(name, width), batch, input_shape(name), steps=3, warmup=1)
            c = profiled[name, batch]
            print(f"profiled {name}: {c.total_s * 1e3:.1f} ms = {c.forward_s * 1e3:.1f} forward + {c.backward_s * 1e3:.1f} "
                  f"backward + {c.update_s * 1e3:.1f} update (batch {batch}, 1 thread)")
        return profiled[name, batch]

    codecs: dict[tuple[str, str, int], Codec] = {}
    rows = []
    runs = []
    for path, report in reports.items():
        words = report.get("command", "").split()
        cap_mb = float(words[words.index("--bucket-cap-mb") + 1]) if "--bucket-cap-mb" in words else 25.0
        runs += [(Path(path).stem, cap_mb, run) for run in report["runs"]]
    for source, cap_mb, run in runs:
        n = run["nproc"]
        probe = run["link_probe"]
        nominal = parse_rate(run["link"])
        # the link's rate, or what the host moves through a veth when that is lower (CPU-bound at high rates)
        bandwidth = min(nominal, probe["bandwidth_bit_s"])
        network = Network(Link(bandwidth, probe["latency_s"]))
        share = min(1.0, cores / n)
        in_situ = {r["model"]: r["compute_s"] for r in run["results"] if "compute_s" in r}
        in_situ_codec = {r["model"]: r["codec_s"] for r in run["results"] if "codec_s" in r}
        for r in run["results"]:
            model, strategy = r["model"], r["strategy"]
            batch = r.get("batch", BATCH[model])  # older step_time.py JSON ran the default batch only
            numel = r["params"]
            if numel != sum(math.prod(s) for _, s in shapes[model]):
                raise SystemExit(f"{model} has {numel} parameters in {source}: pass the --mlp-width it ran with")
            buckets = ddp_bucket_fractions(shapes[model], bucket_cap_mb=cap_mb)
            planned_off = r.get("plans") == ["allreduce_fp32"]
            if strategy in ("ddp", "fp32") or planned_off:
                codec = fp32_codec(numel)
            elif strategy == "ddp_bf16":
                if ("bf16", model, n) not in codecs:  # the casts and Gloo's software bf16 sums, timed here
                    codecs["bf16", model, n] = measure_cast_codec(numel, n)
                codec = codecs["bf16", model, n]
            elif strategy.split("+")[0] == "terngrad":
                if ("terngrad", model, n) not in codecs:
                    codecs["terngrad", model, n] = measure_codec(registry.make_compressor("terngrad"), shapes[model], n)
                codec = codecs["terngrad", model, n]
            else:
                continue
            # profiled alone on one machine, scaled by the ranks' share of the cores
            alone = compute(model, batch)
            p = predict(alone, codec, n, network, batch, buckets, cpu_share=share)
            po = predict(alone, codec, n, network, batch, buckets, cpu_share=share, overlap=True)
            measured = r["median_s"]
            row = {"source": source, "nproc": n, "link": run["link"], "model": model, "strategy": strategy, "measured_s": measured,
                   "profiled_s": p.step_s, "profiled_error": (p.step_s - measured) / measured,
                   "profiled_overlapped_s": po.step_s, "profiled_overlapped_error": (po.step_s - measured) / measured}
            basis, basis_share = alone, share
            if model in in_situ:
                # compute (and codec) timed on the cluster itself, under the same load: isolates the comm model
                basis, basis_share = ComputeTime.from_total(in_situ[model], like=alone), 1.0
                codec_s = codec.encode_s + codec.decode_s
                if codec_s > 0:
                    # TernGrad's codec timed on the cluster (its total, split as timed here); others scaled like
                    # the profiled-alone compute
                    timed = in_situ_codec.get(model) if strategy.startswith("terngrad") else None
                    k = timed / codec_s if timed is not None else 1.0 / share
                    codec = Codec(codec.nbytes, codec.aggregation, codec.encode_s * k, codec.decode_s * k, codec.rounds)
                p = predict(basis, codec, n, network, batch, buckets)
            q = predict(basis, codec, n, network, batch, buckets, cpu_share=basis_share, overlap=True)
            row.update(predicted_s=p.step_s, error=(p.step_s - r["median_s"]) / r["median_s"],
                       compute_s=p.compute_s, codec_s=p.codec_s, comm_s=p.comm_s,
                       overlapped_s=q.step_s, overlapped_error=(q.step_s - r["median_s"]) / r["median_s"],
                       hidden_s=q.hidden_s)
            rows.append(row)
    print()
    print("command: python benchmarks/perf_validate.py " + " ".join(sys.argv[1:]))
    print("| run | N | link | model | strategy | measured ms | predicted ms (error) | overlapped ms (error) | "
          "compute / codec / comm / hidden ms | profiled alone ms (error) | profiled alone, overlapped ms (error) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def cell(row: dict, key: str) -> str:
        return f"{row[key + '_s'] * 1e3:.0f} ({row[key + '_error'] * 100:+.0f}%)"

    for row in rows:
        print(f"| {row['source']} | {row['nproc']} | {row['link']} | {row['model']} | {row['strategy']} | {row['measured_s'] * 1e3:.0f} | "
              f"{row['predicted_s'] * 1e3:.0f} ({row['error'] * 100:+.0f}%) | {cell(row, 'overlapped')} | "
              f"{row['compute_s'] * 1e3:.0f} / {row['codec_s'] * 1e3:.0f} / {row['comm_s'] * 1e3:.0f} / "
              f"{row['hidden_s'] * 1e3:.0f} | {cell(row, 'profiled')} | {cell(row, 'profiled_overlapped')} |")
    for key, label in (("error", "predicted"), ("overlapped_error", "overlapped"), ("profiled_error", "profiled alone"),
                       ("profiled_overlapped_error", "profiled alone, overlapped")):
        errors = [abs(r[key]) for r in rows]
        if errors:
            print(f"{label}: median |error| {statistics.median(errors) * 100:.0f}%, max {max(errors) * 100:.0f}% "
                  f"over {len(rows)} configurations")
    inside = sum(r["overlapped_s"] <= r["measured_s"] <= r["predicted_s"] for r in rows)
    print(f"measured between the overlapped and the serial prediction: {inside} of {len(rows)} configurations")
    if args.json:
        profiled_s = {f"{name}@batch{batch}": c.total_s for (name, batch), c in profiled.items()}
        Path(args.json).write_text(json.dumps({"compute_s": profiled_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
