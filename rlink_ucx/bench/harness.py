"""One row of the suite: a receiver in this process, sender processes, one measured stream.

Every system plugs in a :class:`Receiver` and a :class:`Sender` and runs them with
:func:`run_session` (one system, one workload, one actor count):

1. the receiver (this process) listens on 127.0.0.1, port 0, and spawns the sender
   process(es) (``multiprocessing`` "spawn");
2. each sender connects, reports ready, and waits for ``go``;
3. each sender sends for ``Timing.stream_seconds``, then sends end marker(s) (``t_ns = -1``)
   and reports its CPU seconds; the receiver stops once it saw every sender's marker;
4. the receiver keeps, per message, its arrival time, step count and latency
   (:class:`~rlink_ucx.bench.measure.Recorder`; CLOCK_MONOTONIC is shared by the processes of
   one host), from which the warm-up is dropped and the repetitions are cut.

Every wait has a timeout, and the sender processes are joined (or killed) in ``finally``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from .measure import Recorder, Timing, per_gb
from .workloads import Workload

MARKER = -1


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _sender_main(cls_path: str, info: Any, workload: Workload, seconds: float, timeout: float, index: int,
                 reports: Any, go: Any, done: Any) -> None:  # fmt: skip
    """A sender process: connect, wait for go, send chunks for ``seconds``, send the marker."""
    sender = None
    try:
        sender = _load(cls_path)(info, workload, index, timeout)
        reports.put(("ready", index, None))
        if not go.wait(timeout):
            raise TimeoutError("no go from the receiver")
        t_ns = np.zeros(workload.chunk, np.int64)
        arrays = workload.chunk_arrays()
        send = sender.send
        monotonic, monotonic_ns = time.monotonic, time.monotonic_ns
        messages = 0
        cpu0 = time.process_time()
        deadline = monotonic() + seconds
        while monotonic() < deadline:
            t_ns.fill(monotonic_ns())
            send(t_ns, arrays)
            messages += 1
        sender.finish(np.full(workload.chunk, MARKER, np.int64), arrays)
        cpu = time.process_time() - cpu0
        reports.put(("done", index, {"cpu_s": cpu, "bytes": messages * workload.chunk * workload.size_bytes}))
        done.wait(timeout)
    except BaseException:  # noqa: BLE001 - reported to the receiver, which raises it
        reports.put(("error", index, traceback.format_exc()))
        failed = True
    else:
        failed = False
    finally:
        if sender is not None:
            try:
                sender.close()
            except Exception:  # noqa: BLE001, S110 - best effort at exit
                pass
    if failed:
        raise SystemExit(1)  # the exit code tells the receiver too (the queue is flushed first)


class Sender:
    """Base class of a sender (runs in the spawned process)."""

    markers = 1  # marker messages sent at the end

    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        self.workload = workload
        self.timeout = timeout

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def finish(self, marker: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        for _ in range(self.markers):
            self.send(marker, arrays)

    def close(self) -> None:
        pass


class Receiver:
    """Base class of a receiver (runs in this process)."""

    check: Callable[[], None] = staticmethod(lambda: None)  # raises if a sender failed (set by run_session)

    def info(self) -> Any:
        """What each sender needs to connect (picklable)."""
        raise NotImplementedError

    def accept(self, actors: int, timeout: float) -> None:
        """Called after the senders were started."""

    def recv(self, rec: Recorder) -> int:
        """Receive one message into ``rec``; returns how many end markers it completed."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def stop_processes(procs: list[Any], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_session(receiver: Receiver, sender_cls: str, workload: Workload, timing: Timing,
                actors: int = 1) -> dict[str, Any]:  # fmt: skip
    """Run senders against ``receiver``; returns the measured values (see ``Recorder.result``)."""
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    go, done = ctx.Event(), ctx.Event()
    procs = []
    rec = Recorder()
    try:
        info = receiver.info()
        procs = [ctx.Process(target=_sender_main, daemon=True, name=f"bench-sender-{i}",
                             args=(sender_cls, info, workload, timing.stream_seconds, timing.timeout, i, reports,
                                   go, done))
                 for i in range(actors)]  # fmt: skip
        for p in procs:
            p.start()
        receiver.check = lambda: _check_senders(reports, procs)
        receiver.accept(actors, timing.timeout)
        _collect(reports, "ready", actors, timing.timeout + 30, procs)
        cpu0 = time.process_time()
        go.set()
        deadline = time.monotonic() + timing.stream_seconds + timing.timeout
        markers = 0
        while markers < actors:
            markers += receiver.recv(rec)
            if time.monotonic() > deadline:
                raise TimeoutError("the stream did not end in time")
        cpu_recv = time.process_time() - cpu0
        sent = _collect(reports, "done", actors, timing.timeout, procs)
        done.set()
    except BaseException as exc:
        errors = _errors(reports)
        if errors:  # what the senders saw is usually the cause: full tracebacks here, last lines in the row
            print("\n".join(errors), file=sys.stderr, flush=True)
            last = "; ".join(e.split(":")[0] + ": " + e.strip().splitlines()[-1] for e in errors)
            raise RuntimeError(f"{exc}; {last}") from exc
        raise
    finally:
        done.set()
        interrupted = sys.exc_info()[0] is KeyboardInterrupt
        try:
            receiver.close()
        finally:
            stop_processes(procs, 1.0 if interrupted else 20.0)
    out = rec.result(timing, workload.size_bytes)
    out["cpu_s_per_gb_send"] = per_gb(sum(s["cpu_s"] for s in sent), sum(s["bytes"] for s in sent))
    out["cpu_s_per_gb_recv"] = per_gb(cpu_recv, rec.steps * workload.size_bytes)
    return out


def _check_senders(reports: Any, procs: list[Any]) -> None:
    """Raise if a sender died (for receivers that wait in slices)."""
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"sender {dead[0].name} exited with {dead[0].exitcode}")


def _errors(reports: Any) -> list[str]:
    out = []
    try:
        while True:
            kind, index, value = reports.get(timeout=0.5)
            if kind == "error":
                out.append(f"sender {index}: {value}")
    except (queue.Empty, OSError, ValueError):
        pass
    return out


def _collect(reports: Any, what: str, count: int, timeout: float, procs: list[Any]) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        try:
            kind, index, value = reports.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count - len(got)} sender(s) did not report {what!r} in {timeout:.0f}s") from None
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"sender {dead[0].name} exited with {dead[0].exitcode}") from None
            continue
        if kind == "error":
            raise RuntimeError(f"sender {index} failed:\n{value}")
        if kind == what:
            got.append(value)
    return got
