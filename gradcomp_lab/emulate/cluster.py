"""An emulated cluster on one Linux machine: one network namespace per rank, veth pairs, bridges, ``tc tbf``.

Layout (everything lives in namespaces this module creates; the host's own namespace is never touched)::

    rank ns  <prefix>r<i>:  lo, eth0 = 10.213.7.(i+1)/24, tbf at the site rate (rank -> switch)
    switch ns <prefix>sw:   bridge br<s> per site; p<i> (peer of rank i's eth0), tbf at the site rate
                            (switch -> rank); sites s > 0 joined to site 0 by a veth pair w<s>a/w<s>b
                            with tbf at the WAN rate on both ends

Each link is full duplex, rate-limited in both directions by a token bucket on each end's egress. Creating a
cluster needs root and iproute2 (``ip``, ``tc``); :func:`check_available` says clearly what is missing.
:meth:`Cluster.close` deletes every namespace it created (which deletes their veths and bridges) and is called
from ``__exit__``, so a failed run still cleans up; :func:`cleanup_stale` removes leftovers of killed runs.
"""

import math
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from lightning_gradcomp.exchange.costmodel import format_rate
from lightning_gradcomp.validation import check_int

#: every namespace we create starts with this, followed by the creating process id
PREFIX = "gcemu"
SUBNET = "10.213.7"


class EmulationUnavailable(RuntimeError):
    """The machine cannot host an emulated cluster (not root, no iproute2, no namespace support)."""


def check_available(probe: bool = True) -> None:
    """Raise :class:`EmulationUnavailable` with the reason and the fix when namespaces cannot be created.

    Args:
        probe: also create (and delete) a throwaway namespace with a ``tbf`` qdisc, which catches containers
            that run as root without ``CAP_NET_ADMIN`` or without the ``sch_tbf`` module.
    """
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationUnavailable(
            f"The emulated cluster needs iproute2, but {missing} not found on PATH. Fix: install iproute2 "
            f"(`apt-get install -y iproute2`)."
        )
    if os.geteuid() != 0:
        raise EmulationUnavailable(
            "The emulated cluster creates network namespaces, veth pairs and tc qdiscs, which needs root "
            f"(running as uid {os.geteuid()}). Fix: run as root (e.g. `sudo -E python -m gradcomp_lab.emulate ...`)."
        )
    if probe:
        name = f"{PREFIX}{os.getpid()}probe"
        steps = [
            ["ip", "netns", "add", name],
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *_tbf(1e9)],
        ]
        try:
            for step in steps:
                proc = subprocess.run(step, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise EmulationUnavailable(
                        f"`{' '.join(step)}` failed: {proc.stderr.strip()}. The emulated cluster needs network "
                        f"namespaces and tc's tbf qdisc. Fix: run as root with CAP_NET_ADMIN (e.g. a privileged container)."
                    )
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")


def _tbf(rate: float) -> list[str]:
    """``tc`` arguments of a token bucket for ``rate`` bit/s.

    The burst must cover what arrives in one timer tick (1 ms at the highest rates) and one GSO segment
    (64 KiB); the queue holds 100 ms at line rate so TCP sees delay, not loss, at the limit.
    """
    rate_bytes = rate / 8
    burst = max(64 * 1024, int(rate_bytes / 1000))
    limit = max(2 * burst, int(rate_bytes * 0.1))
    return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)]


@dataclass
class Cluster:
    """N ranks in namespaces, each with its own link into a bridge; optional sites joined by WAN links.

    Args:
        nproc: number of ranks.
        bandwidth: bit/s of each rank's link (``math.inf``: no limit).
        sites: number of sites (bridges); ranks are split into equal contiguous groups.
        wan_bandwidth: bit/s of the link joining site s > 0 to site 0 (required with ``sites > 1``).
    """

    nproc: int
    bandwidth: float = math.inf
    sites: int = 1
    wan_bandwidth: Optional[float] = None
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("nproc", self.nproc, minimum=1)
        check_int("sites", self.sites, minimum=1)
        if self.nproc % self.sites:
            raise ValueError(
                f"Expected `nproc` to be a multiple of `sites`, but got nproc={self.nproc}, sites={self.sites}. "
                f"Fix: use equal sites."
            )
        if self.nproc > 250:
            raise ValueError(f"Expected `nproc` <= 250 (one /24 subnet), but got {self.nproc}.")
        if self.sites > 1 and self.wan_bandwidth is None:
            raise ValueError(f"Expected `wan_bandwidth` with sites={self.sites}, but got None. Fix: e.g. '100mbit'.")

    # -- names ------------------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def namespace(self, rank: int) -> str:
        """The namespace rank ``rank`` runs in."""
        return f"{self.prefix}r{rank}"

    def address(self, rank: int) -> str:
        """Rank ``rank``'s IPv4 address (inside its namespace only)."""
        return f"{SUBNET}.{rank + 1}"

    def site_of(self, rank: int) -> int:
        return rank // (self.nproc // self.sites)

    #: the rank side of every rank's link
    interface = "eth0"

    def describe(self) -> str:
        text = f"{self.nproc} ranks, {format_rate(self.bandwidth)} per link"
        if self.sites > 1:
            assert self.wan_bandwidth is not None
            text += f", {self.sites} sites joined by {format_rate(self.wan_bandwidth)}"
        return text

    # -- lifecycle --------------------------------------------------------------------------------------
    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _limit(self, namespace: str, device: str, rate: Optional[float]) -> None:
        if rate is not None and math.isfinite(rate):
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", *_tbf(rate))

    def create(self) -> "Cluster":
        """Build the namespaces, bridges, links and rate limits (cleans up what it made if a step fails)."""
        check_available(probe=False)
        try:
            self._add_namespace(self.switch)
            sw = self.switch
            for s in range(self.sites):
                _run("ip", "-n", sw, "link", "add", f"br{s}", "type", "bridge")
                _run("ip", "-n", sw, "link", "set", f"br{s}", "up")
            for s in range(1, self.sites):
                _run("ip", "-n", sw, "link", "add", f"w{s}a", "type", "veth", "peer", "name", f"w{s}b")
                _run("ip", "-n", sw, "link", "set", f"w{s}a", "master", "br0", "up")
                _run("ip", "-n", sw, "link", "set", f"w{s}b", "master", f"br{s}", "up")
                self._limit(sw, f"w{s}a", self.wan_bandwidth)
                self._limit(sw, f"w{s}b", self.wan_bandwidth)
            for r in range(self.nproc):
                ns = self.namespace(r)
                self._add_namespace(ns)
                _run("ip", "-n", sw, "link", "add", f"p{r}", "type", "veth", "peer", "name", self.interface, "netns", ns)
                _run("ip", "-n", sw, "link", "set", f"p{r}", "master", f"br{self.site_of(r)}", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", self.interface)
                _run("ip", "-n", ns, "link", "set", self.interface, "up")
                self._limit(ns, self.interface, self.bandwidth)
                self._limit(sw, f"p{r}", self.bandwidth)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete every namespace this cluster created (their veths, bridges and qdiscs go with them)."""
        errors = []
        for name in reversed(self.created):
            proc = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if proc.returncode != 0 and "No such file" not in proc.stderr:
                errors.append(f"{name}: {proc.stderr.strip()}")
        self.created.clear()
        if errors:
            raise RuntimeError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> "Cluster":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(rank), *argv]


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix``."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces left by emulated clusters whose creating process is gone; returns their names."""
    removed = []
    for name in list_namespaces(prefix):
        m = re.match(rf"{PREFIX}(\d+)", name)
        if m and os.path.exists(f"/proc/{m.group(1)}"):
            continue  # its creator is alive: not ours to remove
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed
