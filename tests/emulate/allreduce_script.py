"""A rank of the emulated-cluster test: time one all-reduce of NUMEL floats, print the result (run as a script)."""

import os
import sys
import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
        sys.exit(3)
    dist.init_process_group("gloo")
    x = torch.ones(int(os.environ.get("NUMEL", "1000")))
    dist.all_reduce(x)  # warm-up: connections are set up
    start = time.perf_counter()
    dist.all_reduce(x)
    seconds = time.perf_counter() - start
    print(f"RESULT rank={dist.get_rank()} value={x[0].item():g} seconds={seconds:.6f}", flush=True)
    dist.destroy_process_group()
