"""The physical limits every system is measured against: ``memcpy`` and ``raw-socket``.

- ``memcpy``: numpy ``copyto`` of each chunk into preallocated arrays, one core, in this process;
- ``raw-socket``: ``sendmsg`` of the chunk's buffers / ``recv_into`` a preallocated buffer,
  between processes over loopback TCP; with several senders the receiver takes whole
  messages from whichever connection ``select`` finds readable (one thread, like rlink's
  learner receiving from several actors).
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any

import numpy as np

from .common import recv_exact
from .harness import Receiver, Sender, run_session
from .measure import Recorder, Timing, per_gb
from .workloads import Workload, flat_bytes


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


def _views(t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> list[memoryview]:
    return [flat_bytes(t_ns).data] + [flat_bytes(a).data for a in arrays.values()]


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


RING_BYTES = 256 << 20  # raw-socket-ring: as large as the learner ring of a 4-actor rlink row


class RawSocketReceiver(Receiver):
    """Whole messages from each sender, read with ``recv_into``. ``ring``: into the next slot of
    a ``RING_BYTES`` buffer, wrapping, as rlink's learner lands frames in its ring (fresh, cold
    memory each time); else all into one buffer, which stays in the cache."""

    def __init__(self, workload: Workload, ring: bool = False):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.size = workload.chunk * workload.wire_step_bytes
        slots = max(1, RING_BYTES // self.size) if ring else 1
        self.buf = bytearray(self.size * slots)
        self.slots = [memoryview(self.buf)[i * self.size : (i + 1) * self.size] for i in range(slots)]
        self.stamps = [np.frombuffer(slot, np.int64, count=1) for slot in self.slots]  # each message's send time
        self.turn = 0
        self.view = self.slots[0]
        self.chunk = workload.chunk
        self.conns: list[socket.socket] = []
        self.selector: selectors.BaseSelector | None = None
        self.timeout = 60.0

    def info(self) -> Any:
        return self.server.getsockname()[1]

    def accept(self, actors: int, timeout: float) -> None:
        self.server.settimeout(timeout)
        self.timeout = timeout
        for _ in range(actors):
            conn, _ = self.server.accept()
            conn.settimeout(timeout)
            self.conns.append(conn)
        if actors > 1:
            self.selector = selectors.DefaultSelector()
            for conn in self.conns:
                self.selector.register(conn, selectors.EVENT_READ)

    def recv(self, rec: Recorder) -> int:
        view, size = self.view, self.size
        if self.selector is None:  # one sender: no select call per message
            conn = self.conns[0]
        else:
            ready = self.selector.select(self.timeout)
            if not ready:
                raise TimeoutError("no sender sent anything")
            conn = ready[0][0].fileobj  # type: ignore[assignment]
        recv_exact(conn, view[:size])
        marker = rec.stamp(time.monotonic_ns(), self.chunk, int(self.stamps[self.turn][0]))
        self.turn = (self.turn + 1) % len(self.slots)
        self.view = self.slots[self.turn]
        if marker and self.selector is not None:
            self.selector.unregister(conn)  # that sender is done
        return marker

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(b"x")
            except OSError:
                pass
            conn.close()
        if self.selector is not None:
            self.selector.close()
        self.server.close()


def run_raw_socket(workload: Workload, timing: Timing, senders: int = 1, ring: bool = False) -> dict[str, Any]:
    return run_session(RawSocketReceiver(workload, ring), f"{__name__}:RawSocketSender", workload, timing, senders)
