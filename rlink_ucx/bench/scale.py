"""Scale: many actors into one learner, on each data plane.

Per row (one transport, N actors):

- the learner runs in a process of its own (so its CPU time is its own): ``Learner`` on
  127.0.0.1 port 0 and ``RLinkDataset(batch_size=B)``, fetched in a loop with a short timeout;
- N actors, each a real ``Actor`` on a thread of its own, are spread over P worker processes
  (``--procs``, default min(N, 8); "spawn" start method); every actor declares the schema when
  it connects (so connecting includes schema negotiation), then puts one small step
  (``obs`` float32[4], ``t_ns`` int64 = ``time.time_ns()`` at the put, ``actor`` int32,
  ``seq`` int64) every 1/``--rate`` seconds (phases spread over the period) for ``--seconds``
  after all are connected, then ``flush()`` and ``close()``;
- the learner then drains what is left with a batch size of 1.

``--start together`` instead models a cluster launch: every actor is released at one instant
(``start_at``), builds its ``Actor`` with no schema (its first ``put`` infers and negotiates it),
puts its first step at once and then in lockstep with the others (on the grid ``start_at + k /
rate``; a late actor skips the points it missed). ``--seconds`` then counts from the release,
connecting included.

Reported per row: connect time (spread: the first actor's start -> the last one connected, all
connecting at once; together: the release -> the last one connected), how many connected / failed to connect (with the error), steps expected
(what the actors' puts returned for) / delivered / duplicated / lost, put->fetch latency
p50 / p99 / p99.9 over the whole run, the same p50 / p99 of each actor's first step (seq 0) and
of the steady state (steps put 3 s or more after the stream's start), with how many first steps
took over 200 ms and when the first steps were fetched, counted from the stream's start (p50,
p99, max: ``first_fetched_*_s``; in together mode that includes connecting) (the learner's ``time.time_ns()`` when the batch is returned minus ``t_ns``:
it includes waiting for the batch to fill, which is why the default batch size follows the
aggregate rate: about 5 ms of steps, 1 to 32), the learner's CPU (fraction of a core over the
streaming window, ``os.times`` of its process), actor CPU per connected actor (the worker
processes' CPU time in the window / connected actors / window), the learner's RSS growth per
connected actor (after all connected minus before any, MiB; it includes the receive ring,
``Config.buffer_bytes``, which the first schema allocates) and its open file descriptors after
all connected, and every actor that died (phase, exception type and message).

Every wait has a timeout and a row is bounded by ``--timeout``; a row that fails is reported
with what it measured so far, and the processes are killed.

Usage: rlink bench --suite scale [--actors 1,16,64,256] [--procs 8] [--rate 20] [--seconds 10]
       [--start spread|together] [--transport auto|tcp|shm|ucx[,...]] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .common import installed
from .report import loadavg, machine
from .scale_report import plot, print_table
from .scale_row import run_row

# The pieces: scale_learner / scale_worker (the processes), scale_row (one row), scale_report (table, plot).


def _transports(value: str) -> list[str]:
    from ..transport.shm import channel as shm

    if value == "auto":
        out = ["tcp"]
        if shm.available():
            out.append("shm")
        if installed("ucxx"):
            out.append("ucx")
        return out
    out = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in ("tcp", "shm", "ucx")]
    if bad or not out:
        raise SystemExit(f"unknown transport(s): {', '.join(bad) or value!r} (choose from auto, tcp, shm, ucx)")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink bench --suite scale`` options (docs/cli.md is generated from them)."""
    parser = argparse.ArgumentParser(prog="rlink bench --suite scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--actors", default="1,16,64,256", help="comma list of actor counts N (default 1,16,64,256)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes P per row, at most N (default 8)")
    parser.add_argument("--rate", type=float, default=20.0, help="steps per second per actor (default 20)")
    parser.add_argument("--seconds", type=float, default=10.0, help="streaming window after all connected (default 10)")
    parser.add_argument(
        "--transport",
        default="auto",
        help="auto (tcp, shm where it works, ucx when ucxx imports) or a comma list of tcp, shm, ucx",
    )
    parser.add_argument("--start", choices=("spread", "together"), default="spread",
                        help="spread: connect first with the schema, phases spread over the period (default); "
                             "together: all released at once, schema inferred from the first put, lockstep")  # fmt: skip
    parser.add_argument(
        "--batch", type=int, default=0, help="learner batch size (default: about 5 ms of the aggregate stream, 1 to 32)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="limit of one row, seconds (default 120)")
    parser.add_argument("--json", help="write the machine, the arguments and the rows here")
    parser.add_argument("--plot", help="write a PNG of latency p50/p99 and learner CPU against N here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        counts = [int(a) for a in args.actors.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--actors takes a comma list of integers, got {args.actors!r}")
    if not counts or min(counts) < 1:
        parser.error("--actors: every count must be >= 1")
    if args.procs < 1 or args.rate <= 0 or args.seconds <= 0 or args.timeout <= 0 or args.batch < 0:
        parser.error("--procs, --rate, --seconds and --timeout must be positive, --batch >= 0")
    transports = _transports(args.transport)
    info = machine()
    print(f"rlink bench --suite scale: {info.get('cpus')} CPUs, python {info['python']}, git {info.get('git', '?')}; "
          f"start {args.start}, {args.rate:g} steps/s per actor for {args.seconds:g}s; load average {info['loadavg']}", flush=True)  # fmt: skip
    rows = []
    started = time.monotonic()
    for transport in transports:
        for n in counts:
            row = run_row(transport, n, min(args.procs, n), args.rate, args.seconds, args.timeout, args.batch or None,
                          args.start)  # fmt: skip
            rows.append(row)
            state = (
                f"error: {row['error']}"
                if row["error"]
                else (
                    f"connected {row['connected']}/{n} in {row['connect_s']:.2f}s, delivered {row.get('delivered')}"
                    f"/{row.get('expected')}, p50 {row.get('p50_ms', float('nan')):.2f} ms, "
                    f"p99 {row.get('p99_ms', float('nan')):.2f} ms, first p99 {row.get('first_p99_ms', float('nan')):.1f}"
                    f" ms, steady p99 {row.get('steady_p99_ms', float('nan')):.2f} ms"
                )
            )
            print(f"[{transport} x{n}] {state} ({row['wall_s']:.1f}s)", flush=True)
    print()
    print_table(rows)
    print(f"\ntotal {time.monotonic() - started:.0f}s; load average at the end {loadavg()}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, fh, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


__all__ = ["main", "run_row"]

if __name__ == "__main__":
    sys.exit(main())
