"""rlink against its limits and its peers, on the same workloads, in one run.

Rows (all measured at the receiver, in separate processes unless noted):

- limits: ``memcpy`` (numpy copy of each chunk into preallocated arrays, one core, in this
  process); ``raw-socket`` (``sendmsg`` / ``recv_into`` a preallocated buffer);
- rlink: ``Actor.put`` (``put_many`` when ``--chunk`` > 1) -> ``RLinkDataset.fetch`` (batches of
  about 4 MiB) on each data plane (``tcp``, ``ucx``, ``shm``), with 1 and 4 actor processes;
- peers: ``raw-ucxx`` (ucxx low-level tag send/recv, the substrate of the ucx plane, on a
  worker made like rlink's), ``pyzmq-copy`` / ``pyzmq-zerocopy`` (PUSH/PULL multipart,
  ``copy=True`` / ``copy=False``), ``torch-gloo`` (ProcessGroupGloo send/recv per field),
  ``ray`` (a Ray actor receiving the arrays as ``.remote()`` arguments, at most 8 calls in
  flight; sender and receiver are Ray actors, started by Ray). Their harnesses are
  ``bench/peer_*.py`` of a source checkout, not in the wheel (peers.py);
- ``fanout``: ``learner.publish`` vs one gloo broadcast (rlink_ucx/bench/fanout.py).

Workloads: one uint8 array of 1 / 4 / 16 / 64 KiB, 1 MiB or 16 MiB per step, an Atari step (obs
uint8[4,84,84], action int64, reward float32, done bool) and a CartPole step (obs float32[4],
...). Every system sends ``--chunk`` steps (default 1) per call, each with a ``t_ns`` int64
field stamped at the call; latency is receive time minus ``t_ns``.

Each (system, workload, actors) streams for warm-up + reps x window seconds; the first
``--warmup`` seconds are dropped, each window is one repetition; the median is reported with
min/max. A system whose package (or, from a wheel, whose harness) is missing gets a row with
``"skipped"``. See docs/bench-suite.md.

Usage: rlink bench [--quick] [--systems ...] [--workloads ...] [--rounds N] [--json out.json] [--plot out.png]
       rlink bench --suite scale [...]   (many actors into one learner: rlink_ucx/bench/scale.py)
       rlink bench --suite replay [...]  (replay sampling, inserts, checkpoints: rlink_ucx/bench/replay.py)
       rlink bench --suite formats [...] (batches as torch / numpy / JAX / TensorFlow: rlink_ucx/bench/formats.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from . import peers
from .measure import Timing, merge_rounds
from .report import loadavg, machine, plot, print_table, print_targets, targets
from .systems import FANOUT, SETTINGS, SYSTEMS, plan, run_fanout, run_one
from .workloads import WORKLOADS

SUITES = ["default", "scale", "replay", "formats", "fanout"]  # scale.py, replay.py, formats.py, fanout_hosts.py


def _names(value: str, known: list[str], what: str) -> list[str]:
    aliases = {"1K": "1KiB", "4K": "4KiB", "16K": "16KiB", "64K": "64KiB", "1M": "1MiB", "16M": "16MiB"}
    out = [aliases.get(v.strip(), v.strip()) for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in known]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(known)})")
    return out


def row_label(workload: str, system: str, actors: int) -> str:
    """A progress line's columns: workload, system, actor processes (``x4``), apart."""
    return f"{workload:<9}{system:<16}x{actors}"


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink bench`` options (docs/cli.md is generated from them; each other suite has its own)."""
    parser = argparse.ArgumentParser(prog="rlink bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--suite", choices=SUITES, default="default",
                        help="default: this suite; scale: many actors into one learner (rlink bench --suite scale --help); "
                        "replay: the replay table (rlink bench --suite replay --help); formats: batches as torch, "
                        "numpy, JAX, TensorFlow (rlink bench --suite formats --help); fanout: weights to actors on "
                        "many hosts, shaped links (rlink bench --suite fanout --help)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a few rows per system, 1 short rep (< 60 s)")
    parser.add_argument("--systems", default=",".join([*SYSTEMS, FANOUT]), help="comma list (default: all)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list (default: all)")
    parser.add_argument("--actors", default="1,4", help="actor processes for rlink rows")
    parser.add_argument("--chunk", type=int, default=1, help="steps per send call, for every system")
    parser.add_argument("--reps", type=int, help="repetitions (windows) per row [3; --quick 1]")
    parser.add_argument("--warmup", type=float, help="seconds dropped at the start of each row [0.5; --quick 0.15]")
    parser.add_argument("--window", type=float, help="seconds per repetition [0.6; --quick 0.3]")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole plan this many times (interleaved) and pool the windows")
    parser.add_argument("--timeout", type=float, help="limit of any single wait, seconds [60; --quick 20]")
    parser.add_argument("--fanout-mb", type=int, help="fan-out state size [100; --quick 16]")
    parser.add_argument("--fanout-subscribers", type=int, default=3, help="actors receiving the fan-out")
    parser.add_argument("--fanout-reps", type=int, help="fan-out repetitions [5; --quick 1]")
    parser.add_argument("--rlink-api", choices=["auto", "put", "put_many"], default="auto",
                        help="rlink actor call: auto = put for --chunk 1, else put_many")
    parser.add_argument("--ray-in-flight", type=int, default=8, help="pending .remote() calls per Ray sender")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--plot", help="write a PNG of throughput vs size here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--suite", choices=SUITES, default="default")
    chosen, rest = pre.parse_known_args(argv)
    if chosen.suite == "scale":
        from .scale import main as scale_main

        return scale_main(rest)
    if chosen.suite == "replay":
        from .replay import main as replay_main

        return replay_main(rest)
    if chosen.suite == "formats":
        from .formats import main as formats_main

        return formats_main(rest)
    if chosen.suite == "fanout":
        from .fanout_hosts import main as fanout_hosts_main

        return fanout_hosts_main(rest)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.systems = _names(args.systems, [*SYSTEMS, FANOUT], "system")
    args.workloads = _names(args.workloads, list(WORKLOADS), "workload")
    args.actors = [int(a) for a in args.actors.split(",")]
    quick = args.quick
    timing = Timing(warmup=args.warmup if args.warmup is not None else (0.15 if quick else 0.5),
                    window=args.window if args.window is not None else (0.3 if quick else 0.6),
                    reps=args.reps or (1 if quick else 3),
                    timeout=args.timeout or (20.0 if quick else 60.0))  # fmt: skip
    if args.chunk < 1:
        parser.error("--chunk must be >= 1")
    SETTINGS.update(rlink_api=args.rlink_api, ray_in_flight=args.ray_in_flight)

    started = time.monotonic()
    info = machine()
    print(f"rlink bench: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), python {info['python']}, "
          f"git {info.get('git', '?')}; {timing.reps} rep(s) of {timing.window}s after {timing.warmup}s warm-up, "
          f"chunk {args.chunk} step(s) per call; load average {info['loadavg']}", flush=True)  # fmt: skip
    records: list[dict[str, Any]] = []
    runs = plan(args)
    ray_runs = [r for r in runs if r[0] == "ray"]  # Ray's processes stay up once started: last
    runs = [r for r in runs if r[0] != "ray"] * args.rounds + ray_runs * args.rounds
    fanout_done = FANOUT not in args.systems
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        for i, (key, wname, actors) in enumerate(runs):
            if key == "ray" and not fanout_done:  # fan-out before Ray's processes start
                records += _fanout(args, quick)
                fanout_done = True
            workload = WORKLOADS[wname].with_chunk(args.chunk)
            t0 = time.monotonic()
            rec = run_one(key, workload, timing, actors)
            rows.setdefault((key, wname, actors), []).append(rec)
            print(f"[{i + 1}/{len(runs)}] {row_label(wname, key, actors)}  " + _summary(rec)
                  + f"  ({time.monotonic() - t0:.1f}s)", flush=True)  # fmt: skip
        if not fanout_done:
            records += _fanout(args, quick)
    finally:
        peers.shutdown()
    records += [merge_rounds(recs) for recs in rows.values()]
    order = {w: i for i, w in enumerate(args.workloads)}
    keys = [SYSTEMS[k].system for k in SYSTEMS]
    records.sort(key=lambda r: (order.get(r["workload"], len(order)), keys.index(r["system"]) if r["system"] in keys
                                else len(keys), r["transport"], r["actors"]))  # fmt: skip
    results = targets(records)
    print()
    print_table(records)
    print_targets(results)
    print(f"\ntotal {time.monotonic() - started:.0f}s; load average at the start {info['loadavg']}, "
          f"at the end {loadavg()} (1, 5, 15 min; {info.get('cpus')} CPUs)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    if args.plot:
        plot(records, args.plot)
    return 0


def _fanout(args: argparse.Namespace, quick: bool) -> list[dict[str, Any]]:
    size = args.fanout_mb or (16 if quick else 100)
    reps = args.fanout_reps or (1 if quick else 5)
    t0 = time.monotonic()
    rows = run_fanout(size, args.fanout_subscribers, reps)
    for r in rows:
        print(f"[fanout] {r['workload']:<14}{r['system']:<16}  {_summary(r)}", flush=True)
    print(f"[fanout] ({time.monotonic() - t0:.1f}s)", flush=True)
    return rows


def _summary(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if r.get("error"):
        return f"error: {r['error']}"
    return f"{r['gbps']:.2f} GB/s  {r['per_s']:,.0f}/s  p50 {r['p50_us']:,.0f} us  p99 {r['p99_us']:,.0f} us"


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
