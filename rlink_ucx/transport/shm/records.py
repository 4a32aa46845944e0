"""The shm plane's records on its data connection (``channel.py``), both ways.

Actor -> learner: a byte count of the ring, or a frame's header (its payload in the ring, in
the actor's arena, or at addresses in its memory, with the extents). Learner -> actor: the
cumulative counters of ring bytes freed and of bytes read from the actor's memory.
"""

from __future__ import annotations

import socket
import struct

from ...errors import ProtocolError
from ...wire.frame import FRAME_HEADER_BYTES
from .memory import EXTENT

__all__ = ["ARENA_FRAME", "COUNTER", "DIRECT_FRAME", "FREED", "MAX_EXTENTS", "READ", "REPLY", "RING_FRAME", "WRITTEN",
           "Records", "Replies"]

COUNTER = struct.Struct("<Q")
# Actor -> learner records on the data connection: bytes written to the ring so far; a frame
# whose payload follows in the ring; in the actor's arena; at addresses in the actor's memory.
WRITTEN, RING_FRAME, ARENA_FRAME, DIRECT_FRAME = b"W", b"R", b"A", b"C"
# Learner -> actor: ring bytes freed so far; payload bytes read from the actor's memory so far.
FREED, READ = b"F", b"D"
REPLY = struct.Struct("<cQ")
MAX_EXTENTS = 4096


class Replies:
    """The learner's cumulative counters (ring bytes freed, bytes read directly), read from the
    data connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(4096)
        self._partial = b""
        self.freed = 0
        self.read_directly = 0

    def read(self) -> bool:
        """Take the replies waiting in the socket without blocking; whether any whole one came.
        The socket is blocking without a timeout (a timeout would make Python poll before every
        call, even a non-blocking one): callers bound waits with poll."""
        try:
            n = self.sock.recv_into(self._buf, len(self._buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if n == 0:
            raise EOFError("learner closed the data connection")
        data = self._partial + bytes(self._buf[:n])
        whole = len(data) - len(data) % REPLY.size
        self._partial = data[whole:]
        for kind, value in REPLY.iter_unpack(data[:whole]):
            last = self.freed if kind == FREED else self.read_directly if kind == READ else None
            if last is None:
                raise ProtocolError(f"unknown reply {kind!r} on the shm data connection")
            if value < last:
                raise ProtocolError(f"the learner's shm counter {kind!r} went back from {last} to {value}")
            if kind == FREED:
                self.freed = value
            else:
                self.read_directly = value
        return whole > 0


class Records:
    """The actor's records, read from the data connection (blocking)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(65536)
        self._data = b""

    def _need(self, n: int) -> bytes:
        while len(self._data) < n:
            got = self.sock.recv_into(self._buf)
            if got == 0:
                raise EOFError("actor closed the data connection")
            self._data += self._buf[:got]
        out, self._data = self._data[:n], self._data[n:]
        return out

    def fill(self) -> bool:
        """Read what has arrived without blocking; whether anything had."""
        try:
            got = self.sock.recv_into(self._buf, len(self._buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if got == 0:
            if self._data:
                raise ConnectionResetError("actor closed the data connection mid-record")
            raise EOFError("actor closed the data connection")  # between frames: the control channel says why
        self._data += self._buf[:got]
        return True

    def complete(self) -> bool:
        """Whether a whole record is buffered (an unknown or oversized one counts: reading it
        raises the protocol error)."""
        data = self._data
        if not data:
            return False
        kind = data[:1]
        need = 1 + (COUNTER.size if kind == WRITTEN else FRAME_HEADER_BYTES)
        if kind in (ARENA_FRAME, DIRECT_FRAME) and len(data) >= need + COUNTER.size:
            (n,) = COUNTER.unpack_from(data, need)
            need += COUNTER.size + (n * EXTENT.size if n <= MAX_EXTENTS else 0)
        elif kind in (ARENA_FRAME, DIRECT_FRAME):
            need += COUNTER.size
        return kind not in (WRITTEN, RING_FRAME, ARENA_FRAME, DIRECT_FRAME) or len(data) >= need

    def buffered(self) -> bool:
        """Whether a whole byte-count record (``WRITTEN`` + counter) is already read, so reading
        it will not block."""
        return len(self._data) >= 1 + COUNTER.size and self._data[:1] == WRITTEN

    def next(self) -> tuple[bytes, bytes, list[tuple[int, int]]]:
        """``(kind, header or counter, extents)``."""
        kind = self._need(1)
        if kind == WRITTEN:
            return kind, self._need(COUNTER.size), []
        if kind == RING_FRAME:
            return kind, self._need(FRAME_HEADER_BYTES), []
        if kind in (ARENA_FRAME, DIRECT_FRAME):
            header = self._need(FRAME_HEADER_BYTES)
            (n,) = COUNTER.unpack(self._need(COUNTER.size))
            if n > MAX_EXTENTS:
                raise ProtocolError(f"a frame in {n} pieces; the limit is {MAX_EXTENTS}")
            raw = self._need(n * EXTENT.size)
            return kind, header, list(EXTENT.iter_unpack(raw))
        raise ProtocolError(f"unknown record {kind!r} on the shm data connection")
