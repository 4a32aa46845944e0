"""The ``shm`` data plane: actor and learner on one host share a byte ring in memory.

The learner creates one ring per session: a sealed ``memfd`` (it can never shrink, so a
misbehaving actor cannot make the learner's reads fault), announced in ``Welcome`` as
``(pid, fd, nonce, size)``. The actor maps it through ``/proc/<pid>/fd/<fd>``, which only a
process of the same user in the same PID namespace may open, and checks the nonce to be sure
it mapped the right object. Whoever cannot map it says so in ``Attach`` and the session falls
back to the tcp plane over the same data connection.

The ring is a byte stream with the tcp plane's framing (header, then payload). The data
connection carries only counters, 8 bytes each, both cumulative: the actor writes bytes into
the ring and then sends how many it has written in all (the doorbell); the learner copies
bytes out into its receive ring and sends how many it has consumed in all (the release). A
counter that goes backwards or claims more than the ring holds is a ``ProtocolError``.
Copies run in ``ctypes.memmove``, which releases the GIL, so the other threads keep running.

Each side sends its counter before it waits for the other's, so neither can wait on the other
forever; every wait is bounded by the socket timeout.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time

import numpy as np

from .._errors import ProtocolError
from .._wire import FRAME_HEADER_BYTES
from .base import FrameSink
from .tcp import _close, tune_socket

DATA_OFFSET = 4096  # the first page holds the nonce; the ring's bytes start page-aligned
NONCE_BYTES = 16
COUNTER = struct.Struct("<Q")
MEMFD_NAME = "rlink-shm"


def available() -> bool:
    """Whether this platform can create and map the ring (Linux with memfd and seals)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


def _address(buf: memoryview) -> int:
    """The address of a contiguous buffer, read-only or not."""
    return np.frombuffer(buf, np.uint8).ctypes.data


class ShmRing:
    """One mapped ring; ``size`` data bytes after the nonce page."""

    def __init__(self, mm: mmap.mmap, size: int, fd: int | None = None):
        self.mm = mm
        self.size = size
        self.fd = fd  # the learner's memfd until the actor has mapped it
        self.base = _address(memoryview(mm)) + DATA_OFFSET

    @classmethod
    def create(cls, size: int) -> tuple[ShmRing, bytes]:
        """Learner: a new sealed ring and the nonce written into it."""
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, DATA_OFFSET + size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, DATA_OFFSET + size)
        except BaseException:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(NONCE_BYTES)
        mm[:NONCE_BYTES] = nonce
        return cls(mm, size, fd), nonce

    @classmethod
    def open(cls, pid: int, fd: int, nonce: bytes, size: int) -> ShmRing:
        """Actor: map the learner's ring; ``OSError`` when it is not reachable from here."""
        path = f"/proc/{pid}/fd/{fd}"
        # In another PID namespace the same numbers name some other process's file: look
        # before opening (never open a device or a FIFO by accident), then check the nonce.
        if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME} "):
            raise OSError(f"{path} is not an rlink ring")
        own = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            info = os.fstat(own)
            if not stat.S_ISREG(info.st_mode) or info.st_size != DATA_OFFSET + size:
                raise OSError(f"{path} is not the announced ring")
            mm = mmap.mmap(own, DATA_OFFSET + size)
        finally:
            os.close(own)
        if mm[:NONCE_BYTES] != nonce:
            mm.close()
            raise OSError(f"/proc/{pid}/fd/{fd} is another object (nonce differs)")
        return cls(mm, size)

    def release_fd(self) -> None:
        """The learner's descriptor is no longer needed once the actor mapped the ring."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Unmap (the mapping holds a descriptor of its own). Only once no thread can copy
        through ``base`` any more: callers make sure of that."""
        self.release_fd()
        self.mm.close()

    def copy_in(self, pos: int, src: memoryview) -> None:
        """Copy ``src`` into the ring at stream position ``pos`` (wrapping)."""
        self._move(pos, _address(src), len(src), into_ring=True)

    def copy_out(self, pos: int, dst: memoryview) -> None:
        self._move(pos, _address(dst), len(dst), into_ring=False)

    def _move(self, pos: int, addr: int, n: int, into_ring: bool) -> None:
        while n:
            at = pos % self.size
            k = min(n, self.size - at)
            if into_ring:
                ctypes.memmove(self.base + at, addr, k)
            else:
                ctypes.memmove(addr, self.base + at, k)
            pos, addr, n = pos + k, addr + k, n - k


class _Counters:
    """The other side's cumulative counter, read from the data connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(4096)
        self._partial = b""
        self.last = 0

    def read(self, block: bool) -> int | None:
        """The newest whole counter waiting in the socket (None: none yet); with ``block``,
        waits for bytes first. The socket is blocking without a timeout (a timeout would make
        Python poll before every call, even a non-blocking one): callers bound waits with poll."""
        try:
            n = self.sock.recv_into(self._buf, len(self._buf), 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if n == 0:
            raise EOFError("peer closed the data connection")
        data = self._partial + bytes(self._buf[:n])
        whole = len(data) - len(data) % COUNTER.size
        self._partial = data[whole:]
        if not whole:
            return None
        for (value,) in COUNTER.iter_unpack(data[:whole]):
            if value < self.last:
                raise ProtocolError(f"the peer's shared ring counter went back from {self.last} to {value}")
            self.last = value
        return self.last


class ShmSender:
    """Actor side: copies each frame into the ring, then rings the doorbell."""

    name = "shm"
    any_thread = True  # like tcp: any thread may send, under the connection's send lock

    def __init__(self, sock: socket.socket, ring: ShmRing, timeout: float):
        tune_socket(sock)
        sock.setblocking(True)
        self.sock = sock
        self.ring = ring
        self.timeout = timeout
        self._lock = threading.Lock()  # close() unmaps only between sends
        self._closed = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.written = 0
        self.released = 0
        self._releases = _Counters(sock)

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        with self._lock:
            if self._closed:
                raise ConnectionResetError("the shm data plane is closed")
            self._send(header, payload)

    def _send(self, header: bytes, payload: list[memoryview]) -> None:
        for buf in (memoryview(header), *payload):
            while len(buf):
                free = self.ring.size - (self.written - self.released)
                if not free:
                    self._doorbell()
                    self._await_release(block=True)
                    continue
                k = min(free, len(buf))
                self.ring.copy_in(self.written, buf[:k])
                self.written += k
                buf = buf[k:]
        self._doorbell()
        self._await_release(block=False)

    def _doorbell(self) -> None:
        self.sock.sendall(COUNTER.pack(self.written))

    def _await_release(self, block: bool) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if block and not self._poll.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError(f"the learner freed no room in the shared ring for {self.timeout:.3g}s")
            released = self._releases.read(block=False)
            if released is None:
                if block:
                    continue  # half a counter arrived; the rest follows
                return
            if released > self.written:
                raise ProtocolError(f"learner released {released} bytes of the shared ring; {self.written} written")
            self.released = released
            return

    def close(self) -> None:
        _close(self.sock)  # wakes a send waiting for room: it fails and lets go of the lock
        with self._lock:
            if not self._closed:
                self._closed = True
                self.ring.close()


class ShmReceiver:
    """Learner side: one thread per actor copies frames out of the ring into the sink's views."""

    name = "shm"

    def __init__(self, sock: socket.socket, ring: ShmRing, sink: FrameSink, name: str = "rlink-shm-recv"):
        sock.setblocking(True)
        tune_socket(sock)
        self.sock = sock
        self.ring = ring
        self.sink = sink
        self.frame_started: float | None = None
        self._closed = False
        self._written = 0  # what the actor announced
        self._consumed = 0  # copied out
        self._released = 0  # what we told the actor
        self._doorbells = _Counters(sock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _read_into(self, views: list[memoryview]) -> None:
        for view in views:
            while len(view):
                ready = self._written - self._consumed
                if not ready:
                    self._wait_for_bytes()
                    continue
                k = min(ready, len(view))
                self.ring.copy_out(self._consumed, view[:k])
                self._consumed += k
                view = view[k:]
                if self._consumed - self._released >= self.ring.size // 4:
                    self._release()

    def _release(self) -> None:
        self._released = self._consumed
        self.sock.sendall(COUNTER.pack(self._consumed))

    def _wait_for_bytes(self) -> None:
        if self._consumed != self._released:
            self._release()  # before waiting: the actor may be waiting for room
        written = self._doorbells.read(block=True)
        while written is None:
            written = self._doorbells.read(block=True)
        if written > self._consumed + self.ring.size:
            raise ProtocolError(f"actor announced {written} bytes in the shared ring; {self._consumed} consumed, "
                                f"ring of {self.ring.size}")  # fmt: skip
        self._written = written

    def _run(self) -> None:
        header = bytearray(FRAME_HEADER_BYTES)
        try:
            while True:
                if self._written == self._consumed:
                    try:
                        self._wait_for_bytes()
                    except EOFError:  # between frames: the control channel says why
                        raise EOFError("actor closed the data connection") from None
                self._read_into([memoryview(header)])
                self.frame_started = time.monotonic()
                payload = [v for v in self.sink.begin(bytes(header)) if len(v)]
                try:
                    self._read_into(payload)
                except EOFError:
                    raise ConnectionResetError("actor closed the data connection mid-frame") from None
                self.frame_started = None
                self.sink.end_threadsafe()
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the session
            if not self._closed:
                self._closed = True
                _close(self.sock)
                self.sink.fail_threadsafe(exc)
        finally:
            self.frame_started = None
            self.sink.abandon()
            self.ring.close()  # this thread was the only one copying out of it

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _close(self.sock)
