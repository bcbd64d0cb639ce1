"""Validate the performance model (lightning_gradcomp.perfmodel) against the emulated-cluster step times.

Reads the JSON written by ``benchmarks/step_time.py``, profiles each model's compute (one process, one thread,
one worker's batch) and TernGrad's codec on this machine, predicts every measured configuration and prints
measured vs predicted step time with the relative error.

    python benchmarks/perf_validate.py docs/data/step_time.json
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

import torch  # noqa: E402

from lightning_gradcomp import registry  # noqa: E402
from lightning_gradcomp.costmodel import Link, Network, parse_rate  # noqa: E402
from lightning_gradcomp.perfmodel import fp32_codec, measure_codec, predict, profile_compute  # noqa: E402
from step_time import BATCH, build_model, input_shape  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measured", help="JSON from benchmarks/step_time.py")
    parser.add_argument("--json", default=None, help="write predictions here")
    parser.add_argument("--mlp-width", type=int, default=4096, help="as given to step_time.py")
    args = parser.parse_args()
    report = json.loads(Path(args.measured).read_text())
    torch.set_num_threads(1)  # each emulated rank runs with OMP_NUM_THREADS=1
    cores = os.cpu_count() or 1
    width = args.mlp_width
    shapes = {name: [(n, tuple(p.shape)) for n, p in build_model(name, width).named_parameters()] for name in ("mlp", "lenet")}
    profiled: dict[tuple[str, int], float] = {}

    def compute(name: str, batch: int) -> float:
        """One worker's forward + backward + update, profiled alone once per (model, per-rank batch)."""
        if (name, batch) not in profiled:
            profiled[name, batch] = profile_compute(build_model(name, width), batch, input_shape(name), steps=3, warmup=1)
            print(f"profiled {name}: {profiled[name, batch] * 1e3:.1f} ms forward+backward+update (batch {batch}, 1 thread)")
        return profiled[name, batch]

    codecs: dict[tuple[str, int], object] = {}
    rows = []
    for run in report["runs"]:
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
                raise SystemExit(f"{model} has {numel} parameters in {args.measured}: pass the --mlp-width it ran with")
            buckets = max(1, math.ceil(4 * numel / (25 * 2**20)))
            planned_off = r.get("plans") == ["allreduce_fp32"]
            if strategy in ("ddp", "fp32") or planned_off:
                codec = fp32_codec(numel)
            elif strategy == "ddp_bf16":
                codec = fp32_codec(numel, 2.0)
            elif strategy.split("+")[0] == "terngrad":
                key = (model, n)
                if key not in codecs:
                    codecs[key] = measure_codec(registry.make_compressor("terngrad"), shapes[model], n)
                codec = codecs[key]
            else:
                continue
            # profiled alone on one machine, scaled by the ranks' share of the cores
            p = predict(compute(model, batch), codec, n, network, batch, buckets, cpu_share=share)
            row = {"nproc": n, "link": run["link"], "model": model, "strategy": strategy, "measured_s": r["median_s"],
                   "profiled_s": p.step_s, "profiled_error": (p.step_s - r["median_s"]) / r["median_s"]}
            if model in in_situ:
                # compute (and codec) timed on the cluster itself, under the same load: isolates the comm model
                if codec.encode_s + codec.decode_s > 0 and model in in_situ_codec:
                    codec = type(codec)(codec.nbytes, codec.aggregation, in_situ_codec[model], 0.0, codec.rounds)
                    q = predict(in_situ[model], codec, n, network, batch, buckets)
                else:
                    q = predict(in_situ[model], codec, n, network, batch, buckets)
                p = q
            row.update(predicted_s=p.step_s, error=(p.step_s - r["median_s"]) / r["median_s"],
                       compute_s=p.compute_s, codec_s=p.codec_s, comm_s=p.comm_s)
            rows.append(row)
    print()
    print("command: python benchmarks/perf_validate.py " + " ".join(sys.argv[1:]))
    print("| N | link | model | strategy | measured ms | predicted ms | error | compute / codec / comm ms | profiled-alone prediction ms (error) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['nproc']} | {row['link']} | {row['model']} | {row['strategy']} | {row['measured_s'] * 1e3:.0f} | "
              f"{row['predicted_s'] * 1e3:.0f} | {row['error'] * 100:+.0f}% | "
              f"{row['compute_s'] * 1e3:.0f} / {row['codec_s'] * 1e3:.0f} / {row['comm_s'] * 1e3:.0f} | "
              f"{row['profiled_s'] * 1e3:.0f} ({row['profiled_error'] * 100:+.0f}%) |")
    for key, label in (("error", "predicted"), ("profiled_error", "profiled-alone")):
        errors = [abs(r[key]) for r in rows]
        if errors:
            print(f"{label}: median |error| {statistics.median(errors) * 100:.0f}%, max {max(errors) * 100:.0f}% "
                  f"over {len(rows)} configurations")
    if args.json:
        profiled_s = {f"{name}@batch{batch}": seconds for (name, batch), seconds in profiled.items()}
        Path(args.json).write_text(json.dumps({"compute_s": profiled_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
