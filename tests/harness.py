"""Run a function on N real Gloo ranks in processes of their own, with a hard timeout.

Never mocks the collective: each rank is a process with its own ``torch.distributed`` process group over
loopback. A hung run is killed (Gloo can ignore SIGTERM), and the test fails with the ranks' output.
"""

import atexit
import faulthandler
import functools
import gc
import importlib.metadata
import os
import pickle
import random
import socket
import sys
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any
from unittest import mock

import torch.multiprocessing as mp


@functools.cache
def _entry_points(group: str) -> importlib.metadata.EntryPoints:
    return importlib.metadata.entry_points(group=group)


def memoize_lightning_entry_points() -> None:
    """Scan the installed distributions' entry points once per process instead of at every ``Trainer(...)``.

    Lightning's ``Trainer.__init__`` looks up external callback factories with ``importlib.metadata.entry_points``,
    which parses the entry points of every installed distribution (some hundred here): over half of a tiny model's
    fit, and the suite builds thousands of Trainers. Nothing is installed while the tests run, so the answer per
    group is fixed; the factories it names are still loaded and called by every Trainer, as without this.
    """
    from lightning.fabric.utilities import registry

    registry.entry_points = _entry_points  # type: ignore[assignment]  # the same lookup, memoized per group


def freeze_imported_objects() -> None:
    """Leave every object alive now (the imported modules: torch, Lightning, the library) out of the cyclic garbage
    collector's full collections from here on (``gc.freeze``).

    A full collection visits every tracked object, and after those imports there are over a million: each took
    about 0.4 s on the 2 CI cores and a tiny model's fit triggers several, which made up about a quarter of its
    time. Module-level objects live as long as the process anyway; objects made later (a fit's model, optimizer,
    strategy) are collected as before. In a fork server this also keeps forked ranks from copying the pages the
    collector would otherwise write to (Python's documented use of ``gc.freeze``).
    """
    gc.collect()
    gc.freeze()
    # and back at exit, so that the interpreter's teardown collects them as without this (nanobind, under Triton,
    # reports the instances it still finds alive then as leaks)
    atexit.register(gc.unfreeze)


# in every test process, and in the fork server, where this module is the last of PRELOAD: every rank forked from it
# starts with the scan cached and the preloaded modules frozen
memoize_lightning_entry_points()
freeze_imported_objects()


#: where :func:`free_port` looks: below Linux's ephemeral range (``ip_local_port_range``, 32768-60999), whose ports
#: the kernel also hands to outgoing connections (Gloo opens many), so that no connection of a test running beside
#: this one (pytest-xdist) takes the port between its choice and rank 0's bind
PORTS = range(20000, 32768)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, outside the ephemeral range (:data:`PORTS`)."""
    for port in random.Random().sample(PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"Expected a free port in {PORTS} but found none in 64 tries. Fix: free ports on 127.0.0.1.")


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


#: thread counts a rank's math libraries must read when they load (in the fork server): without them, MKL (dynamic
#: threads by default) runs BLAS calls made on a Gloo callback thread (a hook's decoding) with a load-dependent
#: thread count, which changes their rounding; ``_worker``'s ``OMP_NUM_THREADS`` comes after torch's import
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}


#: what the fork server imports once, so that a rank starts in well under a second instead of importing torch and
#: Lightning anew (about 5 s of CPU per rank; the suite starts some hundred ranks on 2 cores)
PRELOAD = ["torch", "lightning.pytorch", "lightning_gradcomp", "gradcomp_lab", "tests.harness"]


#: the test process's environment as it was before any test ran: the fork server starts with it whichever test
#: starts it first, so a variable set by an earlier test in the same process cannot reach the ranks
_ENVIRONMENT = dict(os.environ)

#: Lightning's seed variables (``seed_everything`` sets them in the process that calls it): a rank's strategy setup
#: seeds again from ``PL_GLOBAL_SEED`` (``reset_seed``), so one inherited from a test that seeded in-process would
#: change every rank's random streams, and what a rank computes would depend on which tests ran before
SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def rank_environment() -> dict[str, str]:
    """The environment the fork server starts with, and so every rank: the test process's own before any test ran,
    without Lightning's seed variables, with :data:`SINGLE_THREADED`."""
    base = {k: v for k, v in _ENVIRONMENT.items() if k not in SEED_VARIABLES}
    return {**base, **SINGLE_THREADED}


def _context() -> Any:
    """The fork-server context, its server started (once per test process) in :func:`rank_environment`.

    A rank is forked from the server, so it is a fresh process that never ran a collective or an OpenMP region,
    with the server's environment: a variable a test sets in its own process does not reach the ranks (pass it as
    ``run_ranks(..., env=...)``, which each rank sets first).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # the server imports the math libraries, which read their thread settings once
    with mock.patch.dict(os.environ, rank_environment(), clear=True):
        forkserver.ensure_running()
    return ctx


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, env: dict | None = None
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks forked from the server; return the results by rank.

    ``fn`` must be importable (module level). The ranks get torchrun-style environment variables, so a
    ``Trainer`` inside ``fn`` joins the group instead of launching processes.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, env or {}, queue, args, timeout), daemon=True)
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
