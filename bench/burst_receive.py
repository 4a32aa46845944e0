"""The learner's receive path alone under lockstep bursts: real sockets, real pumps, no actors.

A writer process sends one one-step frame (the scale benchmark's 36-byte step) on each of N
tcp connections per burst, every ``--period`` seconds. This process reads them with the real
pumps, ``TcpReceiver``, ``LearnerSession`` and one ``StepRing``; a consumer thread takes batches
of ``--batch`` steps and assembles each with the dataset's ``BatchAssembler`` (numpy format), as
``RLinkDataset`` does (``--consumer pieces``: each piece's fields copied on their own, the
consumer of the runs recorded before #51's second round, with ``--batch 10``). It reports the process's CPU per frame
(``time.process_time``; user and system from ``os.times``, in 10 ms ticks), the same split by
thread (``/proc``'s schedstat, nanoseconds on a CPU: the pumps that land the frames, the consumer
that copies them out field by field, the rest), the pumps' CPU split into reading a pass and
landing it (``PassClock``: µs a frame each, polls a burst, frames a landed pass), the frames taken per second of the measured
window (with ``--period 0`` the writer sends as fast as it can: the learner's ingest rate) and
the put -> taken latency. What a 1,024-actor burst costs the learner
can so be measured without 1,024 actor threads on the same two cores.

    python bench/burst_receive.py [--connections 1024] [--bursts 10] [--period 0.5] [--per-pump 16]
                                  [--spread N] [--batch 256] [--consumer dataset|pieces]
                                  [--json out.json]

``--per-pump`` and ``--spread`` set ``pump.PER_PUMP`` and ``TcpReceiver.pump_spread``: in a
tree where small-frame tcp connections share one pump (#51) they change nothing for tcp; in an
older one ``--per-pump 1024 --spread 1`` puts every connection on one pump.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import small_frames as sf  # the scale benchmark's step and a session around one receiver

from rlink_ucx.store.gather import BatchAssembler
from rlink_ucx.store.ring import StepRing
from rlink_ucx.transport import pump
from rlink_ucx.transport.tcp.stream import TcpReceiver
from rlink_ucx.wire.frame import FrameHeader
from rlink_ucx.wire.frameworks import adapter

WARM_BURSTS = 2  # bursts before the measured window (connections' first reads, page faults)


def writer(port: int, connections: int, bursts: int, period: float, start: Any, ready: Any) -> None:
    """Connect, then send one frame on every connection per burst, bursts ``period`` apart."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(sf.SCHEMA.step_bytes)
    ready.set()
    while start.value == 0:
        time.sleep(0.01)
    for b in range(bursts):
        while (left := start.value + b * period - time.time()) > 0:
            time.sleep(left)
        put_us = int(time.time() * 1e6)
        for s in socks:
            s.sendall(FrameHeader(1, 1, sf.ACTOR, sf.INCARNATION, b, 0, len(payload), put_time_us=put_us).pack()
                      + payload)  # fmt: skip
    time.sleep(1.0)
    for s in socks:
        s.close()


def thread_cpu() -> dict[str, float]:
    """Seconds on a CPU so far of this process's live threads, summed by role: ``pumps`` (the
    reading and landing), ``consumer`` (the bench's own copies out) and ``other``."""
    out = {"pumps": 0.0, "consumer": 0.0, "other": 0.0}
    for thread in threading.enumerate():
        seconds = _on_cpu(thread.native_id)
        role = "pumps" if thread.name.startswith("rlink-pump") else thread.name if thread.name == "consumer" else "other"
        out[role] += seconds
    return out


class PassClock:
    """The pumps' CPU split between reading a pass and landing it (``time.thread_time`` around
    ``Pump._read_pass`` and ``Pump._land_pass``, two clock reads a pass, not a frame), with the
    polls and the frames landed; a tree without those two methods reports nothing."""

    def __init__(self) -> None:
        self.totals = {"read": 0.0, "land": 0.0, "polls": 0, "passes": 0}
        read, land = getattr(pump.Pump, "_read_pass", None), getattr(pump.Pump, "_land_pass", None)
        self.active = read is not None and land is not None
        if not self.active:
            return
        totals = self.totals

        def timed_read(pump_self: Any, events: Any) -> None:
            t = time.thread_time()
            read(pump_self, events)
            totals["read"] += time.thread_time() - t
            totals["polls"] += 1

        def timed_land(pump_self: Any) -> None:
            totals["passes"] += bool(pump_self._burst)
            t = time.thread_time()
            land(pump_self)
            totals["land"] += time.thread_time() - t

        pump.Pump._read_pass, pump.Pump._land_pass = timed_read, timed_land  # type: ignore[method-assign]

    def report(self, before: dict[str, float], after: dict[str, float], frames: int, bursts: int) -> dict[str, Any]:
        if not self.active:
            return {}
        d = {k: after[k] - before[k] for k in self.totals}
        return {"read_us_per_frame": round(d["read"] / frames * 1e6, 1), "land_us_per_frame": round(d["land"] / frames * 1e6, 1),
                "polls_per_burst": round(d["polls"] / bursts, 1), "frames_per_pass": round(frames / max(d["passes"], 1), 1)}  # fmt: skip


def _on_cpu(tid: int | None) -> float:
    """Seconds thread ``tid`` has run so far (0 if it ended, or where there is no /proc)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


def run(connections: int, bursts: int, period: float, per_pump: int, batch: int, spread: int | None = None,
        consumer_kind: str = "dataset") -> dict[str, Any]:  # fmt: skip
    pump.PER_PUMP = per_pump
    passes = PassClock()
    if spread is not None:
        TcpReceiver.pump_spread = spread
    ctx = mp.get_context("spawn")
    listener = socket.create_server(("127.0.0.1", 0), backlog=connections)
    start, ready = ctx.Value("d", 0.0), ctx.Event()
    proc = ctx.Process(target=writer, args=(listener.getsockname()[1], connections, bursts, period, start, ready))
    proc.start()
    ring = StepRing(sf.SCHEMA, 64 << 20, 64, chunk_steps=32)
    receivers = []
    for _ in range(connections):
        sock, _ = listener.accept()
        receiver, own_ring = sf._receiver(sock)
        own_ring.close()
        receiver.sink.ring = ring  # every session lands in one ring, as in a learner
        receivers.append(receiver)
    if not ready.wait(60):
        raise TimeoutError("the writer did not connect")
    for receiver in receivers:
        receiver.start()
    total, got, latencies = connections * bursts, 0, []
    consumer_spent = [0.0]  # the consumer's CPU when it finished (it has ended by the last look)

    assembler = BatchAssembler(ring, batch, adapter("numpy")) if consumer_kind == "dataset" else None

    def consume() -> None:
        nonlocal got
        while got < total:
            pieces, take_id = ring.take(min(batch, total - got), 30.0)
            now = time.time()
            latencies.extend(now - piece.put_at for piece in pieces)
            got += sum(p.count for p in pieces)
            if assembler is not None:  # what RLinkDataset does with a take: one batch, field by field
                assembler.assemble(pieces, take_id, 0)  # releases the take
                continue
            for piece in pieces:
                for f in range(len(sf.SCHEMA.fields)):
                    ring.piece_bytes(f, piece).copy()
            ring.release(take_id)
        consumer_spent[0] = _on_cpu(threading.get_native_id())

    consumer = threading.Thread(target=consume, name="consumer")
    consumer.start()
    start.value = time.time() + 0.5
    time.sleep(0.5 + WARM_BURSTS * period)
    before, cpu_before, threads_before = os.times(), time.process_time(), thread_cpu()
    taken_before, wall_before, passes_before = got, time.monotonic(), dict(passes.totals)
    consumer.join(bursts * period + 60)
    wall = time.monotonic() - wall_before
    after, cpu, threads_after = os.times(), time.process_time() - cpu_before, thread_cpu()
    passes_after = dict(passes.totals)  # now, as the threads' CPU: the connections' ends come after
    threads_after["consumer"] = consumer_spent[0]
    pumps = len(pump._pumps)
    proc.join(30)
    for receiver in receivers:
        receiver.close()
    ring.close()
    listener.close()
    if got != total:
        raise RuntimeError(f"{got} of {total} frames taken")
    # the bursts after the warm-up ones; back to back (--period 0), what was taken in the window
    frames = total - (WARM_BURSTS * connections if period > 0 else taken_before)
    lat_ms = np.array(latencies[WARM_BURSTS * connections :]) * 1e3
    return {"connections": connections, "per_pump": per_pump, "spread": TcpReceiver.pump_spread, "pumps": pumps,
            "batch": batch, "consumer": consumer_kind,
            "frames": frames, "cpu_us_per_frame": round(cpu / frames * 1e6, 1), "user_us_per_frame": round((after[0] - before[0]) / frames * 1e6, 1),
            "sys_us_per_frame": round((after[1] - before[1]) / frames * 1e6, 1),
            **{f"{role}_us_per_frame": round((threads_after[role] - threads_before[role]) / frames * 1e6, 1)
               for role in threads_after},
            **passes.report(passes_before, passes_after, frames, bursts - WARM_BURSTS if period > 0 else 1),
            "frames_per_s": round((total - taken_before) / wall),
            "latency_ms_p50_p90_p99": [round(float(np.percentile(lat_ms, q)), 2) for q in (50, 90, 99)]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=1024)
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--period", type=float, default=0.5)
    parser.add_argument("--per-pump", type=int, default=pump.PER_PUMP, help="connections one pump reads at most")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--consumer", choices=["dataset", "pieces"], default="dataset",
                        help="dataset: batches assembled as RLinkDataset does; pieces: each piece's fields copied on their own")
    parser.add_argument("--spread", type=int, default=None,
                        help="tcp connections that get a pump each before they share (default: the tree's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.bursts <= WARM_BURSTS:
        parser.error(f"--bursts must be more than the {WARM_BURSTS} warm-up bursts")
    report = run(args.connections, args.bursts, args.period, args.per_pump, args.batch, args.spread, args.consumer)
    print(json.dumps(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
