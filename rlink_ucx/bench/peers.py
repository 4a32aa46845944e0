"""The benchmark suite's harness and its non-rlink runners (see rlink_ucx/_bench_suite.py).

Every runner moves the same workload: chunks of ``Workload.chunk`` steps, one send call per
chunk, each chunk carrying a ``t_ns`` int64 field (``time.monotonic_ns()`` at the send call;
CLOCK_MONOTONIC is shared by the processes of one host) next to the step's own fields.

Protocol of a session (one system, one workload, one actor count), in :func:`run_session`:

1. the receiver (this process) listens on 127.0.0.1, port 0, and spawns the sender
   process(es) (``multiprocessing`` "spawn");
2. each sender connects, reports ready, and waits for ``go``;
3. each sender sends for ``Timing.stream_seconds``, then sends end marker(s) (``t_ns = -1``)
   and reports its CPU seconds; the receiver stops once it saw every sender's marker;
4. the receiver keeps, per message, its arrival time, step count and latency; the first
   ``Timing.warmup`` seconds after the first arrival are dropped and the next
   ``Timing.reps`` windows of ``Timing.window`` seconds are the repetitions.

Every wait has a timeout, and the sender processes are joined (or killed) in ``finally``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from ..wire.messages import recv_exact_into

MiB = 1 << 20
MARKER = -1


# --- workloads ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """``fields``: (name, dtype, per-step shape); ``chunk``: steps per send call."""

    name: str
    fields: tuple[tuple[str, str, tuple[int, ...]], ...]
    chunk: int = 1
    kind: str = "bytes"  # "bytes" (one uint8 array per step) or "rl" (an RL step)

    @property
    def size_bytes(self) -> int:
        """Payload bytes per step (without ``t_ns``)."""
        return sum(np.dtype(d).itemsize * math.prod(s) for _, d, s in self.fields)

    @property
    def wire_step_bytes(self) -> int:
        return self.size_bytes + 8

    def chunk_arrays(self, k: int | None = None, fill: int | None = None) -> dict[str, np.ndarray]:
        k = self.chunk if k is None else k
        rng = np.random.default_rng(1)
        out = {}
        for name, dtype, shape in self.fields:
            if fill is not None:
                out[name] = np.full((k, *shape), fill, dtype=dtype)
            elif np.dtype(dtype) == np.uint8:
                out[name] = rng.integers(0, 255, (k, *shape), dtype=np.uint8)
            else:
                out[name] = rng.random((k, *shape)).astype(dtype)
        return out

    def with_chunk(self, chunk: int) -> Workload:
        return dataclasses.replace(self, chunk=chunk)


def bytes_workload(name: str, size: int) -> Workload:
    return Workload(name, (("x", "uint8", (size,)),))


ATARI = Workload("atari", (("obs", "uint8", (4, 84, 84)), ("action", "int64", ()), ("reward", "float32", ()),
                           ("done", "bool", ())), kind="rl")  # fmt: skip
CARTPOLE = Workload("cartpole", (("obs", "float32", (4,)), ("action", "int64", ()), ("reward", "float32", ()),
                                 ("done", "bool", ())), kind="rl")  # fmt: skip
WORKLOADS = {
    "1KiB": bytes_workload("1KiB", 1 << 10),
    "64KiB": bytes_workload("64KiB", 64 << 10),
    "1MiB": bytes_workload("1MiB", 1 << 20),
    "16MiB": bytes_workload("16MiB", 16 << 20),
    "atari": ATARI,
    "cartpole": CARTPOLE,
}


def flat_bytes(arr: np.ndarray) -> np.ndarray:
    """A 1-D uint8 view of a C-contiguous array (same memory)."""
    return arr.reshape(-1).view(np.uint8)


@dataclasses.dataclass(frozen=True)
class Timing:
    warmup: float = 0.5  # seconds dropped after the first arrival
    window: float = 0.6  # seconds per repetition
    reps: int = 3
    timeout: float = 60.0  # any single wait

    @property
    def measured(self) -> float:
        return self.warmup + self.reps * self.window

    @property
    def stream_seconds(self) -> float:
        """How long senders send: the measured span plus a tail for the first message's delay."""
        return self.measured + max(0.25, 0.1 * self.measured)


# --- measurements ---------------------------------------------------------------------------------------
class Recorder:
    """Per message: arrival (ns), steps, and latency (ns; a scalar or one value per step)."""

    def __init__(self) -> None:
        self.t: list[int] = []
        self.n: list[int] = []
        self.lat: list[Any] = []

    def add(self, now_ns: int, steps: int, lat_ns: Any) -> None:
        self.t.append(now_ns)
        self.n.append(steps)
        self.lat.append(lat_ns)

    def stamp(self, now_ns: int, steps: int, sent_ns: int) -> int:
        """Record a message sent at ``sent_ns``; 1 if it is the sender's end marker (negative)."""
        if sent_ns < 0:
            return 1
        self.add(now_ns, steps, now_ns - sent_ns)
        return 0

    @property
    def steps(self) -> int:
        return sum(self.n)

    def result(self, timing: Timing, step_bytes: int) -> dict[str, Any]:
        if len(self.t) < 2:
            raise RuntimeError(f"only {len(self.t)} message(s) arrived; nothing to measure")
        t = np.asarray(self.t, np.int64)
        n = np.asarray(self.n, np.int64)
        start = t[0] + int(timing.warmup * 1e9)
        span = int(timing.window * 1e9)
        rates = []
        for i in range(timing.reps):
            lo, hi = np.searchsorted(t, [start + i * span, start + (i + 1) * span])
            if hi <= lo:
                continue
            # the steps that arrived in the window, over the time since the arrival just before it
            # (exact for a steady stream, even when a window holds a single big message or batch)
            ref, first = (lo - 1, lo) if lo > 0 else (lo, lo + 1)
            if hi > first and t[hi - 1] > t[ref]:
                rates.append(float(n[first:hi].sum()) / float((t[hi - 1] - t[ref]) / 1e9))
        coarse = not rates
        if coarse:  # fewer messages than windows (a very slow system): one rate over the whole stream
            rates.append(float(n[1:].sum()) / float((t[-1] - t[0]) / 1e9))
        lo, hi = np.searchsorted(t, [start, start + timing.reps * span])
        picked = self.lat[lo:hi] or self.lat[-1:]
        if isinstance(picked[0], np.ndarray):
            lat = np.concatenate(picked)
        else:
            lat = np.asarray(picked, np.float64)
        p50, p99 = np.percentile(lat, [50, 99]) / 1e3
        gbps = [r * step_bytes / 1e9 for r in rates]
        out = {
            "gbps": statistics.median(gbps), "gbps_min": min(gbps), "gbps_max": max(gbps),
            "per_s": statistics.median(rates), "p50_us": float(p50), "p99_us": float(p99), "reps": len(rates),
            "windows": rates,  # steps/s of each repetition
        }  # fmt: skip
        if coarse:
            out["coarse"] = f"{len(t)} messages in all: one rate over the whole stream"
        return out


def record(system: str, transport: str, workload: Workload, actors: int, group: str, **values: Any) -> dict[str, Any]:
    rec = {"system": system, "transport": transport, "workload": workload.name, "size_bytes": workload.size_bytes,
           "actors": actors, "gbps": None, "per_s": None, "p50_us": None, "p99_us": None, "reps": 0,
           "group": group, "chunk": workload.chunk}  # fmt: skip
    rec.update(values)
    return rec


def per_gb(cpu_s: float | None, nbytes: int) -> float | None:
    return None if cpu_s is None or nbytes <= 0 else cpu_s / (nbytes / 1e9)


# --- the session harness ------------------------------------------------------------------------------------
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
            except Exception:  # noqa: BLE001 - best effort at exit
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


# --- limits: memcpy ---------------------------------------------------------------------------------------
def run_memcpy(workload: Workload, timing: Timing) -> dict[str, Any]:
    """Single-core copy of each chunk into preallocated arrays (numpy ``copyto``), in this process."""
    src = workload.chunk_arrays()
    dst = {k: np.empty_like(v) for k, v in src.items()}
    for k in src:  # touch the destination once
        np.copyto(dst[k], src[k])
    pairs = [(dst[k], src[k]) for k in src]
    rec = Recorder()
    copyto, monotonic_ns = np.copyto, time.monotonic_ns
    chunk = workload.chunk
    cpu0 = time.process_time()
    end = monotonic_ns() + int(timing.measured * 1e9) + 1
    while True:
        t0 = monotonic_ns()
        for d, s in pairs:
            copyto(d, s)
        now = monotonic_ns()
        rec.add(now, chunk, now - t0)
        if now > end:
            break
    cpu = time.process_time() - cpu0
    out = rec.result(timing, workload.size_bytes)
    out["cpu_s_per_gb_recv"] = per_gb(cpu, rec.steps * workload.size_bytes)
    return out


# --- limits: raw socket -----------------------------------------------------------------------------------
def _views(t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> list[memoryview]:
    return [memoryview(flat_bytes(t_ns))] + [memoryview(flat_bytes(a)) for a in arrays.values()]


class RawSocketSender(Sender):
    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        super().__init__(info, workload, index, timeout)
        self.sock = socket.create_connection(("127.0.0.1", info), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.views: list[memoryview] | None = None
        self.key: Any = None
        self.total = workload.chunk * workload.wire_step_bytes

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.key is not t_ns:  # the views are made once (t_ns is filled in place)
            self.key, self.views = t_ns, _views(t_ns, arrays)
        views = self.views
        assert views is not None
        sent = self.sock.sendmsg(views)
        if sent < self.total:  # a partial sendmsg: send the rest buffer by buffer
            for v in views:
                if sent >= len(v):
                    sent -= len(v)
                    continue
                self.sock.sendall(v[sent:])
                sent = 0

    def close(self) -> None:
        try:
            self.sock.recv(1)  # the receiver says when it is done
        finally:
            self.sock.close()


class RawSocketReceiver(Receiver):
    def __init__(self, workload: Workload):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.size = workload.chunk * workload.wire_step_bytes
        self.buf = bytearray(self.size)
        self.view = memoryview(self.buf)
        self.t_ns = np.frombuffer(self.buf, np.int64, count=1)
        self.chunk = workload.chunk
        self.conn: socket.socket | None = None

    def info(self) -> Any:
        return self.server.getsockname()[1]

    def accept(self, actors: int, timeout: float) -> None:
        self.server.settimeout(timeout)
        self.conn, _ = self.server.accept()
        self.conn.settimeout(timeout)

    def recv(self, rec: Recorder) -> int:
        conn, view, size = self.conn, self.view, self.size
        assert conn is not None
        recv_exact_into(conn, view[:size])
        return rec.stamp(time.monotonic_ns(), self.chunk, int(self.t_ns[0]))

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(b"x")
            except OSError:
                pass
            self.conn.close()
        self.server.close()


def run_raw_socket(workload: Workload, timing: Timing) -> dict[str, Any]:
    return run_session(RawSocketReceiver(workload), f"{__name__}:RawSocketSender", workload, timing)


# --- raw ucxx (the substrate of rlink's ucx plane) --------------------------------------------------------
UCX_TAG = 0x5EED << 32


def _ucx_worker() -> tuple[Any, Any, Any, Any]:
    """A worker made exactly like rlink's ucx plane makes its own (same UCX options)."""
    from ..config import Config
    from ..transport.ucx import load_ucxx, make_worker

    u, context, worker = make_worker(Config.from_env())
    return u, load_ucxx()[1], context, worker


def _ucx_wait(worker: Any, requests: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    spins = 0
    while not all(r.completed for r in requests):
        worker.progress()
        spins += 1
        if spins % 256 == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"ucx requests did not complete within {timeout}s")
    for r in requests:
        r.check_error()


class UcxxSender(Sender):
    """One ``tag_send`` per field (tag = field index), waited for before the next chunk."""

    markers = 2  # the receiver keeps two messages' receives posted

    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        super().__init__(info, workload, index, timeout)
        self.u, self.Array, self._context, self.worker = _ucx_worker()
        address = self.u.UCXAddress.create_from_buffer(info)
        self.ep = self.u.UCXEndpoint.create_from_worker_address(self.worker, address, False)
        self.tags = [self.u.UCXXTag(UCX_TAG | i) for i in range(len(workload.fields) + 1)]
        self.key: Any = None
        self.bufs: list[Any] = []

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.key is not t_ns:
            self.key = t_ns
            self.bufs = [self.Array(flat_bytes(t_ns))] + [self.Array(flat_bytes(a)) for a in arrays.values()]
        ep = self.ep
        requests = [ep.tag_send(b, tag) for b, tag in zip(self.bufs, self.tags)]
        _ucx_wait(self.worker, requests, self.timeout)

    def close(self) -> None:
        self.ep.close_blocking(10**9, 1)


class UcxxReceiver(Receiver):
    def __init__(self, workload: Workload, timeout: float):
        self.u, self.Array, self._context, self.worker = _ucx_worker()
        self.timeout = timeout
        self.chunk = workload.chunk
        self.tags = [self.u.UCXXTag(UCX_TAG | i) for i in range(len(workload.fields) + 1)]
        self.slots = []
        for _ in range(2):
            t_ns = np.zeros(workload.chunk, np.int64)
            arrays = workload.chunk_arrays(fill=0)
            buffers = [self.Array(flat_bytes(t_ns))] + [self.Array(flat_bytes(a)) for a in arrays.values()]
            self.slots.append((t_ns, buffers, arrays))
        self.requests: list[list[Any]] = [[], []]
        self.cur = 0

    def info(self) -> Any:
        return bytes(self.worker.address.tobytes())

    def _post(self, slot: int) -> None:
        self.requests[slot] = [self.worker.tag_recv(b, tag) for b, tag in zip(self.slots[slot][1], self.tags)]

    def accept(self, actors: int, timeout: float) -> None:
        self._post(0)
        self._post(1)

    def recv(self, rec: Recorder) -> int:
        cur = self.cur
        _ucx_wait(self.worker, self.requests[cur], self.timeout)
        now = time.monotonic_ns()
        t = int(self.slots[cur][0][0])
        self.requests[cur] = []
        if t < 0:  # the sender sends two markers: drain the other slot too
            _ucx_wait(self.worker, self.requests[cur ^ 1], self.timeout)
            self.requests[cur ^ 1] = []
            return 1
        rec.add(now, self.chunk, now - t)
        self._post(cur)
        self.cur = cur ^ 1
        return 0

    def close(self) -> None:
        if any(self.requests):
            try:
                self.worker.cancel_inflight_requests()
                for _ in range(100):
                    self.worker.progress()
            except Exception:  # noqa: BLE001 - best effort after a failure
                pass


def run_raw_ucxx(workload: Workload, timing: Timing) -> dict[str, Any]:
    return run_session(UcxxReceiver(workload, timing.timeout), f"{__name__}:UcxxSender", workload, timing)


# --- pyzmq -----------------------------------------------------------------------------------------------
def _zmq_hwm(workload: Workload) -> int:
    """Bound what zmq queues to about 64 MiB per side (the default 1000 messages of 16 MiB would be 16 GB)."""
    return max(2, min(1000, (64 * MiB) // (workload.chunk * workload.wire_step_bytes)))


class ZmqSender(Sender):
    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        import zmq

        super().__init__(info, workload, index, timeout)
        endpoint, self.copy = info
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, _zmq_hwm(workload))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, int(timeout * 1000))
        self.sock.connect(endpoint)

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.copy:
            self.sock.send_multipart([t_ns, *arrays.values()], copy=True)
        else:  # zmq keeps a reference until sent: t_ns is refilled in place, so send a copy of it
            self.sock.send_multipart([t_ns.copy(), *arrays.values()], copy=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class ZmqReceiver(Receiver):
    def __init__(self, workload: Workload, copy: bool, timeout: float):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, _zmq_hwm(workload))
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.copy = copy
        self.chunk = workload.chunk
        self.fields = [(np.dtype(d), s) for _, d, s in workload.fields]

    def info(self) -> Any:
        return (self.endpoint, self.copy)

    def recv(self, rec: Recorder) -> int:
        parts = self.sock.recv_multipart(copy=self.copy)
        now = time.monotonic_ns()
        t = int(np.frombuffer(parts[0] if self.copy else parts[0].buffer, np.int64, count=1)[0])
        # what a consumer would do: numpy views of the fields (no copy)
        for part, (dtype, shape) in zip(parts[1:], self.fields):
            np.frombuffer(part if self.copy else part.buffer, dtype).reshape(self.chunk, *shape)
        return rec.stamp(now, self.chunk, t)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def run_zmq(workload: Workload, timing: Timing, copy: bool) -> dict[str, Any]:
    return run_session(ZmqReceiver(workload, copy, timing.timeout), f"{__name__}:ZmqSender", workload, timing)


# --- torch.distributed gloo send/recv -------------------------------------------------------------------
def _gloo_group(store: Any, rank: int, timeout: float) -> Any:
    from ..weights.group import new_group

    return new_group(store, "bench/", rank, 2, backend="gloo", hostname="127.0.0.1", timeout=timeout)


class GlooSender(Sender):
    """One ``send`` per field (tag = field index), as flat uint8 tensors; all waited for."""

    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        from ..weights.group import connect_store

        super().__init__(info, workload, index, timeout)
        self.group = _gloo_group(connect_store("127.0.0.1", info, timeout), 1, timeout)
        self.key: Any = None
        self.tensors: list[Any] = []
        self.delta = __import__("datetime").timedelta(seconds=timeout)

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        import torch

        if self.key is not t_ns:
            self.key = t_ns
            self.tensors = [torch.from_numpy(flat_bytes(a)) for a in (t_ns, *arrays.values())]
        works = [self.group.send([t], 0, i) for i, t in enumerate(self.tensors)]
        for w in works:
            w.wait(self.delta)


class GlooReceiver(Receiver):
    def __init__(self, workload: Workload, timeout: float):
        import datetime

        import torch

        from ..weights.group import serve_store

        self.store, self.port = serve_store("127.0.0.1", timeout)
        self.chunk = workload.chunk
        self.t_ns = np.zeros(workload.chunk, np.int64)
        arrays = workload.chunk_arrays(fill=0)
        self.tensors = [torch.from_numpy(flat_bytes(a)) for a in (self.t_ns, *arrays.values())]
        self.delta = datetime.timedelta(seconds=timeout)
        self.group: Any = None

    def info(self) -> Any:
        return self.port

    def accept(self, actors: int, timeout: float) -> None:
        self.group = _gloo_group(self.store, 0, timeout)

    def recv(self, rec: Recorder) -> int:
        works = [self.group.recv([t], 1, i) for i, t in enumerate(self.tensors)]
        for w in works:
            w.wait(self.delta)
        return rec.stamp(time.monotonic_ns(), self.chunk, int(self.t_ns[0]))

    def close(self) -> None:
        self.group = None
        self.store = None


def run_gloo(workload: Workload, timing: Timing) -> dict[str, Any]:
    return run_session(GlooReceiver(workload, timing.timeout), f"{__name__}:GlooSender", workload, timing)


# --- Ray -------------------------------------------------------------------------------------------------
_RAY: dict[str, Any] = {}


def _ray() -> tuple[Any, Any, Any]:
    """Start a local Ray instance once (closed by :func:`ray_shutdown`); its actor classes."""
    if not _RAY:
        import logging

        import ray

        # Ray's worker processes must import this module: put our package on their path.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=False)  # fmt: skip
        _RAY["ray"] = ray
        _RAY["receiver"] = ray.remote(num_cpus=0)(RayReceiver)
        _RAY["sender"] = ray.remote(num_cpus=0)(RaySender)
    return _RAY["ray"], _RAY["receiver"], _RAY["sender"]


def ray_shutdown() -> None:
    if _RAY:
        _RAY.pop("ray").shutdown()
        _RAY.clear()


class RayReceiver:
    """A Ray actor: each ``push(t_ns, *fields)`` call is one message."""

    def __init__(self) -> None:
        self.rec = Recorder()
        self.cpu0: float | None = None
        self.cpu = 0.0

    def push(self, t_ns: np.ndarray, *fields: np.ndarray) -> None:
        now = time.monotonic_ns()
        if self.cpu0 is None:
            self.cpu0 = time.process_time()
        self.rec.add(now, len(t_ns), now - int(t_ns[0]))
        self.cpu = time.process_time() - self.cpu0

    def report(self) -> tuple[list[int], list[int], list[Any], float]:
        return self.rec.t, self.rec.n, self.rec.lat, self.cpu


class RaySender:
    """A Ray actor that calls ``receiver.push.remote`` with at most ``in_flight`` calls pending."""

    def run(self, receiver: Any, workload: Workload, seconds: float, in_flight: int, timeout: float) -> dict[str, Any]:
        import ray

        arrays = list(workload.chunk_arrays().values())
        pending: list[Any] = []
        messages = 0
        cpu0 = time.process_time()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t_ns = np.full(workload.chunk, time.monotonic_ns(), np.int64)
            pending.append(receiver.push.remote(t_ns, *arrays))
            messages += 1
            if len(pending) >= in_flight:
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise TimeoutError(f"no push completed within {timeout}s")
                ray.get(ready)
        ray.get(pending, timeout=timeout)
        return {"cpu_s": time.process_time() - cpu0, "bytes": messages * workload.chunk * workload.size_bytes}


def run_ray(workload: Workload, timing: Timing, in_flight: int = 8) -> dict[str, Any]:
    ray, receiver_cls, sender_cls = _ray()
    receiver = receiver_cls.remote()
    sender = sender_cls.remote()
    try:
        sent = ray.get(sender.run.remote(receiver, workload, timing.stream_seconds, in_flight, timing.timeout),
                       timeout=timing.stream_seconds + 2 * timing.timeout)  # fmt: skip
        t, n, lat, cpu = ray.get(receiver.report.remote(), timeout=timing.timeout)
    finally:
        for actor in (sender, receiver):
            ray.kill(actor)
    rec = Recorder()
    rec.t, rec.n, rec.lat = t, n, lat
    out = rec.result(timing, workload.size_bytes)
    out["cpu_s_per_gb_send"] = per_gb(sent["cpu_s"], sent["bytes"])
    out["cpu_s_per_gb_recv"] = per_gb(cpu, rec.steps * workload.size_bytes)
    return out


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "memcpy": run_memcpy,
    "raw-socket": run_raw_socket,
    "raw-ucxx": run_raw_ucxx,
    "pyzmq-copy": lambda w, t: run_zmq(w, t, copy=True),
    "pyzmq-zerocopy": lambda w, t: run_zmq(w, t, copy=False),
    "torch-gloo": run_gloo,
    "ray": run_ray,
}
