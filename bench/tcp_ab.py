"""Alternating A/B of rlink-tcp variants against the raw socket, at one step size.

Each variant is a set of ``RLINK_*`` settings (``""`` = the defaults) applied to a fresh
learner and actor; rounds alternate raw socket, variant 1, variant 2, ... so that a slow spell
of a noisy machine hits them alike. Prints the median GB/s and every round's value, and the
ratio to the raw socket with the system's defaults. A second raw row gives that socket the
congestion control rlink uses on loopback (``LOOPBACK_CONGESTION``): the same kernel path.

    python bench/tcp_ab.py --size 64K --rounds 6 --variant "" --variant "RLINK_RESEND_BUFFER_BYTES=0"
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from throughput import SIZES, TOTAL_BYTES, print_medians, raw_socket  # bench/throughput.py, beside this script

from rlink_ucx.transport.sockopts import LOOPBACK_CONGESTION

_RUN_ONE = (
    "import sys; sys.path.insert(0, {here!r}); from throughput import rlink; "
    "print(rlink('tcp', 'bytes', {size}, {count}, {size}) / 1e9)"
)


def rlink_tcp(size: int, count: int, settings: str) -> float:
    """GB/s of one rlink-tcp run in a fresh process with ``settings`` ("K=V K=V") applied."""
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in settings.split()))
    code = _RUN_ONE.format(here=os.path.dirname(os.path.abspath(__file__)), size=size, count=count)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64K", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variant", action="append", help='RLINK_* settings, e.g. "RLINK_FRAME_BYTES=2097152"')
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    count = TOTAL_BYTES[size] // size
    variants = args.variant or [""]
    tuned_raw = f"raw-socket {LOOPBACK_CONGESTION}"
    runs: dict[str, list[float]] = {"raw-socket": [], tuned_raw: [],
                                    **{f"rlink-tcp {v or '(defaults)'}": [] for v in variants}}  # fmt: skip
    for _ in range(args.rounds):
        runs["raw-socket"].append(raw_socket(size, count) / 1e9)
        runs[tuned_raw].append(raw_socket(size, count, LOOPBACK_CONGESTION) / 1e9)
        for v in variants:
            runs[f"rlink-tcp {v or '(defaults)'}"].append(rlink_tcp(size, count, v))
    print_medians(runs, "raw-socket")
    return 0


if __name__ == "__main__":
    sys.exit(main())
