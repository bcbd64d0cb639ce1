"""``python -m gradcomp_lab.emulate --nproc 4 --bandwidth 1gbit [--sites 2 --wan-bandwidth 100mbit] -- CMD ...``"""

import argparse
import sys
from typing import Optional

from gradcomp_lab.emulate.cluster import EmulationUnavailable, check_available, cleanup_stale
from gradcomp_lab.emulate.launcher import RankFailed, launch
from lightning_gradcomp.exchange.costmodel import parse_rate


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point; exits with the failing rank's status (124 on timeout, 2 when emulation is unavailable)."""
    args_in = sys.argv[1:] if argv is None else argv
    if "--" in args_in:
        split = args_in.index("--")
        ours, command = args_in[:split], args_in[split + 1 :]
    else:
        ours, command = args_in, []
    parser = argparse.ArgumentParser(
        prog="python -m gradcomp_lab.emulate",
        description="Run N ranks, each in its own network namespace behind a rate-limited link (needs root).",
        epilog="Example: python -m gradcomp_lab.emulate --nproc 4 --bandwidth 1gbit -- python train.py",
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--bandwidth", default="1gbit", help="each rank's link: 100mbit, 1gbit, 10gbit, inf")
    parser.add_argument("--sites", type=int, default=1, help="sites (bridges) joined by WAN links (default 1)")
    parser.add_argument("--wan-bandwidth", default=None, help="rate of the link between sites, e.g. 100mbit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is killed")
    parser.add_argument("--cleanup", action="store_true", help="delete namespaces left by killed runs, then exit")
    args = parser.parse_args(ours)
    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespaces: {removed}")
        return
    if not command:
        parser.error("give the command to run after `--`")
    try:
        launch(
            command,
            nproc=args.nproc,
            bandwidth=parse_rate(args.bandwidth),
            sites=args.sites,
            wan_bandwidth=None if args.wan_bandwidth is None else parse_rate(args.wan_bandwidth),
            timeout=args.timeout,
        )
    except RankFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.returncode) from exc


if __name__ == "__main__":
    main()
