"""Soak: 1 learner, 3 actors, random actor kills, learner pauses and link cuts, for minutes.

Every actor streams steps ``x = [incarnation, seq]`` through a fault proxy of its own; the
learner process checks each (actor, incarnation) stream arrives in order with no repeats and
reports its memory, threads and file descriptors. At the end, per stream:
``put = delivered + lost``, where "lost" is what a killed actor took with it (put into its
buffers, not yet delivered) plus what an actor reported lost (``steps_lost``), and the gaps in
a live stream are exactly what its actor reported lost; and the
learner's memory (beyond its receive ring's high-water mark, which its cap bounds), threads
and file descriptors are flat after the first third of the run. Exit status 1 otherwise.

With ``--step-mib N`` each actor puts one large step at a time (``x`` plus ``pad``, N MiB of
its seq) from one array it refills as soon as ``put`` returns, and the learner checks every
byte: on the shm plane, steps of 4 MiB and more are read straight from the actor's memory,
so this soaks that path (and its give-up rule) under the same faults.

With ``--actors N`` it is the soak at scale instead (bench/soak_scale.py: N actors over P
processes, an actor process SIGKILLed every 30 s, the learner killed and restarted, a per-minute
table of the learner's RSS, open files, threads and p99).

Usage: python bench/soak.py [--minutes 10] [--transport tcp|ucx|shm] [--step-mib N] [--json soak.json] [--trace DIR]   (the test suite runs 0.2 minutes of it, --seed 2034: a pause, a kill and a cut)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRACE_EVERY, STALL_SECONDS = 0.25, 2.0  # --trace: sampling period; what counts as a stall
FLAT_MIB = 4.0  # RSS growth after warm-up, beyond the ring's, that still counts as flat
HEARTBEAT = {"RLINK_HEARTBEAT_INTERVAL": "0.2", "RLINK_HEARTBEAT_TIMEOUT": "1.5"}


def log_to(trace_dir: str | None, name: str) -> None:
    """With --trace: this process's rlink log (INFO, wall-clock times) goes to DIR/NAME.log."""
    if trace_dir:
        logging.basicConfig(filename=os.path.join(trace_dir, f"{name}.log"), level=logging.INFO,
                            format="%(created).2f %(threadName)s %(name)s %(levelname)s %(message)s")


def learner_main(port: int, reports, drain, transport: str, trace_dir: str | None = None, step_mib: int = 0) -> None:
    from rlink_ucx import Learner, RLinkDataset

    log_to(trace_dir, "learner")
    from rlink_ucx import TimeoutError as RLinkTimeout

    expected: dict[tuple[int, int], int] = {}  # per (actor, incarnation): the next seq due
    received: dict[tuple[int, int], int] = {}  # steps that arrived
    skipped: dict[tuple[int, int], int] = {}  # steps jumped over: lost on the way, to be accounted for
    errors: list[str] = []
    with Learner(f"127.0.0.1:{port}", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=4 if step_mib else 200)
        # At the end: batches of 50, then single steps (a killed actor's last frame may have
        # ended mid-chunk, so what is left need not fill a batch of 50).
        tail = RLinkDataset(learner, batch_size=1 if step_mib else 50)
        single, tail_empty = RLinkDataset(learner, batch_size=1), False
        reports.put(("ready", learner.token_file))
        last = 0.0
        while True:
            try:
                # Once batches of 50 ran dry, single steps to the end: going back to a batch of 50
                # after each step cost a 0.5 s timeout per step (up to 25 s for a 49-step tail).
                source = dataset if not drain.is_set() else single if tail_empty else tail
                b = source.fetch(timeout=0.5)
                if step_mib:  # every byte of a large step is its seq's: never torn, never changed
                    pads = b["pad"].numpy()
                    for x, pad in zip(b["x"].tolist(), pads):
                        v = x[1] % 251  # min and max allocate nothing (a comparison would: 1 byte a byte)
                        if not pad.min() == v == pad.max() and len(errors) < 20:
                            errors.append(f"incarnation {x[0]} seq {x[1]}: a large step with bytes of another")
                for a, x in zip(b.actor_id.tolist(), b["x"].tolist()):
                    key = (a, x[0])
                    due = expected.get(key, 0)
                    if x[1] < due and len(errors) < 20:  # a repeat, or out of order
                        errors.append(f"actor {a} incarnation {x[0]}: seq {x[1]}, expected {due}")
                    skipped[key] = skipped.get(key, 0) + max(0, x[1] - due)  # must match what the actor reports lost
                    received[key] = received.get(key, 0) + 1
                    expected[key] = max(due, x[1] + 1)
            except RLinkTimeout:
                tail_empty = drain.is_set()
            if time.monotonic() - last > 2:
                last = time.monotonic()
                with open("/proc/self/statm") as f:
                    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                with open("/proc/self/status") as f:  # shared memory: UCX's segments, mostly
                    shm = next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))
                snapshot = learner.stats()
                t = snapshot["total"]
                reports.put(("stats", {"delivered": {f"{a}/{i}": n for (a, i), n in received.items()},
                                       "skipped": {f"{a}/{i}": n for (a, i), n in skipped.items()}, "errors": errors,
                                       "rss": rss, "shm": shm, "ring_peak": snapshot["buffer"]["peak_buffered_bytes"],
                                       "threads": len(os.listdir("/proc/self/task")),
                                       "fds": len(os.listdir("/proc/self/fd")), "duplicate_steps": t["duplicate_steps"],
                                       "lost_steps": t["lost_steps"], "recycled": snapshot["ucx_workers_recycled"],
                                       "time": time.monotonic()}))  # fmt: skip


def actor_main(address: str, actor: int, incarnation: int, put_count, stop, results, transport: str,
               trace_dir: str | None = None, step_mib: int = 0) -> None:  # fmt: skip
    from rlink_ucx import Actor, Config

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_to(trace_dir, f"actor_{actor}_{incarnation}")
    trace = None
    if trace_dir:  # open while the process lives (it may be SIGKILLed)
        trace = open(os.path.join(trace_dir, f"{actor}_{incarnation}.trace"), "w", buffering=1)  # noqa: SIM115
    traced = 0.0

    def progress(seq: int) -> None:
        nonlocal traced
        if trace is not None and time.monotonic() - traced > TRACE_EVERY:  # wall time, steps put, steps sent
            traced = time.monotonic()
            trace.write(f"{time.time():.2f} {seq} {a.stats()['steps_sent']}\n")

    config = Config.from_env(reconnect_timeout=120, frame_bytes=16 << 10, put_timeout=120)
    with Actor(address, transport=transport, actor_id=actor, config=config) as a:
        seq = 0
        pad = np.empty(step_mib << 20, np.uint8)
        while not stop.value and step_mib:  # one large step per put, sent from ``pad`` (refilled at once)
            progress(seq)
            pad.fill(seq % 251)
            put_count.value = seq + 1
            a.put({"x": np.array([incarnation, seq], np.int64), "pad": pad})
            seq += 1
            time.sleep(0.002)
        while not stop.value and not step_mib:
            progress(seq)
            chunk = np.empty((50, 2), np.int64)
            chunk[:, 0] = incarnation
            chunk[:, 1] = np.arange(seq, seq + 50)
            # Counted before the call: a kill can land inside put_many after part of the chunk
            # went out, so for a killed stream "put" is what it tried (delivered never exceeds it).
            put_count.value = seq + 50
            a.put_many({"x": chunk})
            seq += 50
            time.sleep(0.002)
        a.flush(120)
        results.put((actor, incarnation, a.stats()))


def find_stalls(trace_dir: str) -> list[dict]:
    """Spans in the actors' traces where steps were put but none were sent for STALL_SECONDS
    (the last span counts too: a stream can be killed while stalled)."""
    stalls = []
    for name in sorted(f for f in os.listdir(trace_dir) if f.endswith(".trace")):
        with open(os.path.join(trace_dir, name)) as f:
            rows = [tuple(float(v) for v in line.split()) for line in f if len(line.split()) == 3]
        for i, row in enumerate(rows):
            if i == 0:
                since = row
            elif row[2] != since[2] or i == len(rows) - 1:  # something was sent, or the trace ends
                if row[0] - since[0] > STALL_SECONDS and row[1] > since[1]:
                    stalls.append({"stream": name[: -len(".trace")].replace("_", "/"), "at": since[0],
                                   "seconds": round(row[0] - since[0], 1)})  # fmt: skip
                since = row
    return stalls


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--actors" or a.startswith("--actors=") for a in argv):
        from bench.soak_scale import main as scale_main

        return scale_main(argv)
    from tests.integration.faultproxy import FaultProxy

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ucx", "shm"])
    parser.add_argument("--no-faults", action="store_true", help="stream only: a baseline for the resource figures")
    parser.add_argument("--step-mib", type=int, default=0,
                        help="stream large steps of this many MiB, one per put, each byte checked at the learner "
                             "(4+: read by address on the shm plane)")  # fmt: skip
    parser.add_argument("--json")
    parser.add_argument("--trace", metavar="DIR", help="write every process's rlink log and each actor's "
                        "steps put/sent every 0.25 s to DIR, and report the streams' stalls")  # fmt: skip
    args = parser.parse_args(argv)
    os.environ.update(HEARTBEAT)
    rng = random.Random(args.seed)
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reports, results, drain = ctx.Queue(), ctx.Queue(), ctx.Event()
    # Lock-free shared flags and counters: an actor SIGKILLed while holding a lock (an Event's
    # or a Value's) would leave it held, and every other process touching it would hang.
    stop = ctx.RawValue("b", 0)
    learner = ctx.Process(target=learner_main, args=(port, reports, drain, args.transport, args.trace, args.step_mib))
    learner.start()
    kind, token_file = reports.get(timeout=60)
    assert kind == "ready"
    # The actors dial the fault proxies, not the learner's port, under which the learner's
    # generated token is found: they are told its file.
    os.environ["RLINK_TOKEN_FILE"] = token_file
    proxies = {a: FaultProxy(("127.0.0.1", port)) for a in (1, 2, 3)}
    actors: dict[int, tuple] = {}
    put: dict[str, int] = {}
    killed: list[str] = []
    events: list[tuple[float, str]] = []

    def start(a: int, inc: int) -> None:
        counter = ctx.RawValue("q", 0)
        p = ctx.Process(target=actor_main, args=(proxies[a].address, a, inc, counter, stop, results, args.transport,
                                                         args.trace, args.step_mib))  # fmt: skip
        p.start()
        actors[a] = (p, inc, counter)

    for a in (1, 2, 3):
        start(a, 0)
    started = time.monotonic()
    stats_log: list[dict] = []
    while time.monotonic() - started < args.minutes * 60:
        time.sleep(rng.uniform(3, 8))
        while not reports.empty():
            kind, value = reports.get()
            if kind == "stats":
                stats_log.append(value)
        if args.no_faults:
            continue
        event = rng.choice(["kill", "pause", "cut"])
        a = rng.choice([1, 2, 3])
        t = round(time.monotonic() - started, 1)
        if event == "kill":
            p, inc, counter = actors[a]
            with contextlib.suppress(ProcessLookupError):  # it may have ended by itself
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            put[f"{a}/{inc}"] = counter.value
            killed.append(f"{a}/{inc}")
            start(a, inc + 1)
        elif event == "pause":
            os.kill(learner.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 3.0))
            os.kill(learner.pid, signal.SIGCONT)
        else:
            proxies[a].set("cut")  # both directions; over ucx the proxy carries the control channel
            time.sleep(rng.uniform(0.5, 3.0))
            proxies[a].set(None)
        events.append((t, f"{event} {a}" if event != "pause" else "pause learner"))
        print(f"[soak] {t:7.1f}s {events[-1][1]}", flush=True)
    stop.value = 1
    finals = {}
    for a, (p, inc, counter) in actors.items():
        actor, incarnation, stats = results.get(timeout=180)
        finals[f"{actor}/{incarnation}"] = stats
    for a, (p, inc, counter) in actors.items():
        p.join(60)
        put[f"{a}/{inc}"] = counter.value
    # Resources are judged on the last sample taken while streaming: the drain below reads
    # through two more datasets (batches of 50, then of 1), whose staging is the harness's.
    while not reports.empty():
        kind, value = reports.get()
        if kind == "stats":
            stats_log.append(value)
    streaming = stats_log[-1] if stats_log else None
    drain.set()  # the last steps of each stream may not fill a whole batch of 200
    deadline = time.monotonic() + 30
    last = None
    while time.monotonic() < deadline:
        kind, value = reports.get(timeout=10)
        if kind == "stats":
            last = value
            if all(last["delivered"].get(k, 0) + finals[k]["steps_lost"] == put[k] for k in finals):
                break
    learner.kill()
    for proxy in proxies.values():
        proxy.close()
    assert last is not None
    stats_log.append(last)
    rows, ok = [], not last["errors"]
    for key in sorted(put):
        delivered = last["delivered"].get(key, 0)
        reported = finals[key]["steps_lost"] if key in finals else 0
        lost_in_kill = put[key] - delivered - reported if key in killed else 0
        skipped = last["skipped"].get(key, 0)
        # A gap in a live stream is exactly what its actor reported lost (large puts a broken
        # link caught after they returned, not kept for resending); a killed actor reports
        # nothing, so its gaps are part of what it took with it.
        accounted = skipped <= lost_in_kill if key in killed else skipped == reported
        balanced = put[key] == delivered + reported + lost_in_kill and lost_in_kill >= 0 and accounted
        ok &= balanced
        rows.append({"stream": key, "put": put[key], "delivered": delivered, "skipped": skipped, "reported_lost": reported,
                     "lost_in_kill": lost_in_kill, "killed": key in killed, "balanced": balanced})  # fmt: skip
    # Warm-up is the first third of the run: the allocator, UCX's pools and the receive ring
    # reach their working size in it (about 3 minutes in the 10-minute runs of docs/reliability.md).
    warm = next((s for s in stats_log if s["time"] - stats_log[0]["time"] >= args.minutes * 20), stats_log[0])
    # The receive ring's pages are touched the first time the learner falls that far behind,
    # so part of any RSS step is the ring reaching a new high-water mark (bounded by its cap).
    end = streaming or last
    growth = {"rss_mb": (end["rss"] - warm["rss"]) / 2**20,
              "ring_peak_mb": (end["ring_peak"] - warm["ring_peak"]) / 2**20,
              "threads": end["threads"] - warm["threads"], "fds": end["fds"] - warm["fds"]}  # fmt: skip
    # Flat: after warm-up, RSS beyond the ring's new high-water mark grows less than FLAT_MIB,
    # and there are no more threads or file descriptors than then (one connection's fds may be
    # mid-reconnect at either sample).
    flat = growth["rss_mb"] - growth["ring_peak_mb"] < FLAT_MIB and growth["threads"] <= 0 and growth["fds"] <= 3
    ok &= flat
    # Resource samples through the run (every ~minute), to show they stay flat.
    samples = [s for i, s in enumerate(stats_log[:-1]) if i % 30 == 0] + [last]
    trend = [{"t": round(s["time"] - stats_log[0]["time"]), "rss_mb": round(s["rss"] / 2**20, 1),
              "shm_mb": round(s["shm"] / 2**20, 1), "ring_peak_mb": round(s["ring_peak"] / 2**20, 1), "threads": s["threads"], "fds": s["fds"]} for s in samples]  # fmt: skip
    out = {"minutes": args.minutes, "transport": args.transport, "resources": trend, "events": events,
           "streams": rows, "order_errors": last["errors"], "duplicate_steps_dropped": last["duplicate_steps"],
           "growth_after_warmup": growth, "flat": flat, "ucx_workers_recycled": last["recycled"], "ok": ok}  # fmt: skip
    for r in rows:
        print(f"[soak] {r['stream']:>5}: put {r['put']:>9,}  delivered {r['delivered']:>9,}  gaps {r['skipped']:>5}  "
              f"reported lost {r['reported_lost']:>5}  lost in kill {r['lost_in_kill']:>5}  {'ok' if r['balanced'] else 'UNBALANCED'}")
    points = (f"{r['t']}s {r['rss_mb']} MiB (shm {r['shm_mb']}, ring peak {r['ring_peak_mb']}) {r['threads']}t {r['fds']}fd"
              for r in trend)
    print("[soak] resources over time: " + ", ".join(points))
    print(f"[soak] order errors: {len(last['errors'])}; duplicates dropped by the learner: {last['duplicate_steps']}; "
          f"UCX workers recycled: {last['recycled']}; "
          f"growth after warm-up: {growth} ({'flat' if flat else 'NOT FLAT'}); {'OK' if ok else 'FAILED'}")  # fmt: skip
    if args.trace:
        out["stalls"] = stalls = find_stalls(args.trace)
        longest = max((s["seconds"] for s in stalls), default=0.0)
        print(f"[soak] stalls (an actor putting while nothing was sent for over {STALL_SECONDS:g} s): "
              f"{len(stalls)}, the longest {longest:.1f} s; logs and traces in {args.trace}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
