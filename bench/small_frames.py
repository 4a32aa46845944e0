"""The learner's CPU per small frame on the receive path, landed whole against begin/copy/end.

A lockstep burst brings the learner one small frame from each of hundreds of actors; each costs
the pump's thread Python work, under the GIL the fetching thread needs too. This runs the
real receive path with no network and no threads in one process: frames already read (as a
tcp pump's read leaves them in its scratch buffer) go through ``TcpReceiver._parse`` into a
real ``LearnerSession`` and ``StepRing``, which a consumer empties by ``take`` and ``release``.
Variants, alternating, in the same run: ``land`` (the session's one-call path), ``begin`` (the
same frames through ``begin``, a copy per view and ``end_threadsafe``), the baseline, and, in a
tree that has it, ``burst`` (the read's frames deferred and landed as a pump's burst:
``LearnerSession.land_burst``). CPU time is ``time.process_time``.

    python bench/small_frames.py [--frames 100000] [--per-read 1,16] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import time
import types
from typing import Any

from rlink_ucx import Config
from rlink_ucx.observe.ratelog import RateLimitedLog
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.store.ring import StepRing
from rlink_ucx.transport import pump
from rlink_ucx.transport.tcp.stream import TcpReceiver
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frame import FrameHeader

# The scale benchmark's step (rlink_ucx/bench/scale_worker.py): 36 bytes.
SCHEMA = Schema.from_spec({"obs": ("float32", (4,)), "t_ns": ("int64", ()), "actor": ("int32", ()),
                           "seq": ("int64", ())})  # fmt: skip
ACTOR, INCARNATION = 7, 11


class _Control:
    last_send = 0.0

    def send(self, msg: object) -> None:
        pass

    def close(self) -> None:
        pass


def _receiver(sock: socket.socket) -> tuple[TcpReceiver, StepRing]:
    ring = StepRing(SCHEMA, 64 << 20, 64, chunk_steps=32)
    owner = types.SimpleNamespace(config=Config(), grant_credits=lambda: None, credit_low=lambda: None,
                                  session_ended=lambda *a: None, quiet_log=RateLimitedLog(logging.getLogger("bench")),
                                  token=None, loop=None)  # fmt: skip
    hello = _wire.Hello(ACTOR, INCARNATION, "0", "tcp", False, False, "bench", 1)
    session = LearnerSession(owner, 1, _Control(), hello, ACTOR, "tcp", "bench", b"b" * 32)  # type: ignore[arg-type]
    session.schema_id, session.ring, session.flow.credit, session.flow.low_water = 1, ring, 1 << 60, -1
    return TcpReceiver(sock, session), ring


def run_variant(variant: str, frames: int, per_read: int, sock: socket.socket) -> float:
    """CPU microseconds per frame of ``frames`` one-step frames, ``per_read`` to a read."""
    receiver, ring = _receiver(sock)
    if variant == "begin":
        receiver._land = None  # the baseline: begin, a copy per view, end_threadsafe
    parse = receiver._parse
    if variant == "burst":  # a pump's pass: the read's frames deferred, then landed as one burst
        receiver.pump = pump.Pump()  # its thread ends at once (no connection): only its burst is used

        def parse(data: memoryview) -> None:
            receiver._parse(data, defer=True)
            receiver.pump.land_burst()
    payload = bytes(SCHEMA.step_bytes)
    wire = [FrameHeader(1, 1, ACTOR, INCARNATION, seq, 0, len(payload)).pack() + payload for seq in range(frames)]
    reads = [memoryview(b"".join(wire[i : i + per_read])) for i in range(0, frames, per_read)]
    started = time.process_time()
    for data in reads:
        parse(data)
        if ring.used >= 4096:  # the consumer keeps up, in batches
            _, take = ring.take(ring.used, 1.0)
            ring.release(take)
    spent = time.process_time() - started
    if ring.stats.frames_in != frames:
        raise RuntimeError(f"{variant}: {ring.stats.frames_in} of {frames} frames reached the ring")
    ring.close()
    return spent / frames * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--per-read", default="1,16", help="frames a pump's read brings in (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    listener = socket.create_server(("127.0.0.1", 0))  # a real connection for the receiver to own
    client = socket.create_connection(listener.getsockname())
    sock, _ = listener.accept()
    rows = []
    try:
        for per_read in [int(x) for x in args.per_read.split(",")]:
            runs: dict[str, list[float]] = {"begin": [], "land": []}
            if hasattr(LearnerSession, "land_burst"):  # a tree with burst landing (a pump's whole pass)
                runs["burst"] = []
            for _ in range(args.rounds):
                for variant, values in runs.items():  # alternating
                    values.append(run_variant(variant, args.frames, per_read, sock))
            base = statistics.median(runs["begin"])
            for variant, values in runs.items():
                median = statistics.median(values)
                rows.append({"per_read": per_read, "variant": variant, "us_per_frame": round(median, 2),
                             "min": round(min(values), 2), "max": round(max(values), 2),
                             "ratio": round(median / base, 3)})  # fmt: skip
                print(f"{per_read:3d} a read  {variant:5s}  {median:6.2f} us/frame (min {min(values):.2f}, "
                      f"max {max(values):.2f})  ratio to begin {median / base:.3f}")  # fmt: skip
    finally:
        for s in (client, sock, listener):
            s.close()
    report = {"frames": args.frames, "rounds": args.rounds, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
