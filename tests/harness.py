"""Run a function on N real Gloo ranks in spawned processes, with a hard timeout.

Never mocks the collective: each rank is a process with its own ``torch.distributed`` process group over
loopback. A hung run is killed (Gloo can ignore SIGTERM), and the test fails with the ranks' output.
"""

import contextlib
import faulthandler
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    env: dict,
    queue: Any,
    args: tuple,
    timeout: float | None = None,
) -> None:
    if timeout is not None:
        # a rank still running shortly before the parent gives up prints where every thread is: a hang names its place
        faulthandler.dump_traceback_later(max(1.0, timeout - 10.0), exit=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        **env,
    )
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle: tensors by value; torch's queue pickler would pass shared-memory handles that vanish
        # when this process exits before the parent reads them
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure, including SystemExit from a Trainer
        queue.put((rank, "error", traceback.format_exc()))
    # the report is out (flushed to the pipe): end the process without the interpreter's teardown, where a process
    # group still alive is destroyed holding the GIL while a Gloo worker thread may need it (the gradcomp CLI ends
    # the same way)
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: thread counts a rank's math libraries must read when they load: ``_worker`` sets ``OMP_NUM_THREADS`` only after
#: the spawned process imported torch, so MKL (dynamic threads by default) still runs BLAS calls made on a Gloo
#: callback thread (a hook's decoding) with a load-dependent thread count, which changes their rounding
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}


@contextlib.contextmanager
def single_threaded_children() -> Iterator[None]:
    """Ranks spawned inside this block inherit :data:`SINGLE_THREADED` from the start (run-to-run bit-exact BLAS)."""
    saved = {k: os.environ.get(k) for k in SINGLE_THREADED}
    os.environ.update(SINGLE_THREADED)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, env: dict | None = None
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return the results by rank.

    ``fn`` must be importable (module level). The ranks get torchrun-style environment variables, so a
    ``Trainer`` inside ``fn`` joins the group instead of launching processes.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, env or {}, queue, args, timeout), daemon=True)
        for r in range(world_size)
    ]
    with single_threaded_children():  # every rank's math libraries single-threaded from their first import
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except Exception as exc:
                raise TimeoutError(f"ranks did not finish within {timeout}s; got results from {sorted(results)}") from exc
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
