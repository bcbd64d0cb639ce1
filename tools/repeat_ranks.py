"""Run a rank body on N real Gloo ranks again and again; on a hang, print every stuck rank's native stacks (gdb).

How the DeMo fixture's one-in-twenty hang was caught (the stacks showed ``~ProcessGroupGloo`` joining, on a thread
holding the GIL, a Gloo worker thread that waited for the GIL to free a finished all-gather's tensors):

    python tools/repeat_ranks.py tests.distributed.demo_ranks:demo_suite --ranks 2 --runs 80 --args 4 8 0.9
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.multiprocessing as mp

from tests.harness import SINGLE_THREADED, _worker, free_port


def once(fn: object, ranks: int, args: tuple, timeout: float) -> bool:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, ranks, port, {}, queue, args), daemon=True) for r in range(ranks)]
    with mock.patch.dict(os.environ, SINGLE_THREADED):  # each rank's math libraries single-threaded from the start
        for p in procs:
            p.start()
    reported: list[int] = []
    try:
        for _ in range(ranks):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                print(f"rank {rank} failed:\n{value}", flush=True)
                return False
            reported.append(rank)
        return True
    except Exception:
        for p in procs:
            if p.is_alive() and shutil.which("gdb"):
                stacks = subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 25"],
                                        capture_output=True, text=True).stdout
                print(f"pid {p.pid} hung (reports from ranks {reported}):\n{stacks}", flush=True)
        return False
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="module:function, a rank body fn(rank, world_size, *args)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as hung")
    parser.add_argument("--args", nargs="*", type=float, default=[], help="further positional arguments (numbers)")
    opts = parser.parse_args()
    module, name = opts.target.split(":")
    fn = getattr(importlib.import_module(module), name)
    args = tuple(int(a) if float(a).is_integer() else a for a in opts.args)
    for i in range(opts.runs):
        start = time.perf_counter()
        ok = once(fn, opts.ranks, args, opts.timeout)
        print(f"run {i}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - start:.1f} s)", flush=True)
        if not ok:
            sys.exit(1)
    print(f"{opts.runs} runs, no hang")


if __name__ == "__main__":
    main()
