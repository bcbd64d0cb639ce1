"""Run one command per rank inside an emulated cluster, torchrun-style, and always clean up.

Each rank gets ``MASTER_ADDR`` (rank 0's address), ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK=0`` (the same convention as ``tests.harness``: a ``Trainer(devices=N)`` joins
the group), ``GLOO_SOCKET_IFNAME`` (its namespace's interface) and ``OMP_NUM_THREADS=1``. Output is streamed
line by line with a ``[rank i]`` prefix. The first rank to fail, or the timeout, kills every rank (by process
group: a hung Gloo rank can ignore SIGTERM). The namespaces are deleted on every exit path, including
SIGTERM/SIGINT to the launcher.

Why not ``torch.distributed.run`` (torchrun) for the rank bookkeeping: torchrun starts every local worker itself,
from one process in one network namespace, so it cannot put rank r behind ``ip netns exec`` of namespace r with
that namespace's ``GLOO_SOCKET_IFNAME``. One torchrun per namespace (``--nnodes N --nproc-per-node 1``) could, but
its rendezvous store would then talk over the shaped links being measured, the ranks would see ``LOCAL_RANK=0``
and ``NODE_RANK=r`` (so the scripts' ``Trainer(devices=N)`` would have to become ``num_nodes=N``), and each agent
watches only its own worker, whereas here the first failure kills every rank at once (even one that ignores
SIGTERM). What torchrun would add is the variables of :func:`rank_env`: a dozen lines.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Optional, TextIO

from gradcomp_lab.emulate.cluster import Cluster
from lightning_gradcomp.validation import check_number


class RankFailed(RuntimeError):
    """A rank exited with a non-zero status, or the run timed out."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def rank_env(cluster: Cluster, rank: int, port: int, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of rank ``rank``: the parent's, plus the torchrun-style variables."""
    env = dict(os.environ)
    env.update(
        MASTER_ADDR=cluster.address(0),
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(cluster.nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(cluster.nproc),
        NODE_RANK="0",
        GLOO_SOCKET_IFNAME=cluster.interface,
        OMP_NUM_THREADS="1",
    )
    env.update(extra or {})
    return env


def _pump(rank: int, stream: IO[str], out: TextIO, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
            out.flush()


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_on_cluster(
    cluster: Cluster,
    argv: Sequence[str],
    *,
    timeout: float = 600.0,
    port: int = 29500,
    env: Optional[dict[str, str]] = None,
    out: TextIO = sys.stdout,
) -> None:
    """Run ``argv`` on every rank of an already created ``cluster``; raise :class:`RankFailed` on failure.

    Args:
        cluster: the cluster (its namespaces must exist).
        argv: the command each rank runs (the same for all; ranks tell themselves apart by ``RANK``).
        timeout: seconds for the whole run; on expiry every rank is killed.
        port: ``MASTER_PORT`` (namespaces have their own port space, so any free-by-construction port works).
        env: extra environment variables for every rank.
        out: where the ranks' prefixed output goes.
    """
    check_number("timeout", timeout, minimum=0.0, min_open=True)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(cluster.nproc):
            proc = subprocess.Popen(
                cluster.command(rank, list(argv)),
                env=rank_env(cluster, rank, port, env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,  # its own process group, so killpg takes its children too
            )
            procs.append(proc)
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(rank, proc.stdout, out, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise RankFailed(f"rank {rank} exited with status {code}; killed the other ranks", code or 1)
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise RankFailed(f"timed out after {timeout:g} s; killed every rank", 124)
            time.sleep(0.05)
    finally:
        _kill_all(procs)
        for pump in pumps:
            pump.join(timeout=2)


def launch(
    argv: Sequence[str],
    *,
    nproc: int,
    bandwidth: float,
    sites: int = 1,
    wan_bandwidth: Optional[float] = None,
    timeout: float = 600.0,
    env: Optional[dict[str, str]] = None,
    out: TextIO = sys.stdout,
) -> None:
    """Create a cluster, run ``argv`` on every rank, delete the cluster (also on failure or a signal)."""
    cluster = Cluster(nproc, bandwidth, sites, wan_bandwidth)

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that kill ranks and delete namespaces

    in_main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if in_main else ()
    previous = {s: signal.signal(s, _terminate) for s in signals}
    try:
        with cluster:
            run_on_cluster(cluster, argv, timeout=timeout, env=env, out=out)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
