"""Run a function on N real Gloo ranks in spawned processes, with a hard timeout.

Never mocks the collective: each rank is a process with its own ``torch.distributed`` process group over
loopback. A hung run is killed (Gloo can ignore SIGTERM), and the test fails with the ranks' output.
"""

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, env: dict, queue: Any, args: tuple) -> None:
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
        ctx.Process(target=_worker, args=(fn, r, world_size, port, env or {}, queue, args), daemon=True)
        for r in range(world_size)
    ]
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
