"""The ``tcp`` data plane: a second TCP connection per actor, scatter-gather I/O.

The sender hands the header and every field buffer to one ``sendmsg`` call; the receiver
reads the header into a small buffer, asks the sink for destination views and fills them with
``recvmsg_into``: no per-message Python copies on either side.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from ...wire.frame import FRAME_HEADER_BYTES, PAYLOAD_BYTES_AT, announced_payload, unpack_payload_bytes
from .. import pump
from ..base import FrameSink
from ..sockopts import close_socket, set_congestion

SHARED_PER_PUMP = 1024  # small-frame connections one pump reads (their frames land a pass at a time)
RECV_LOW_WATER = 256 * 1024  # bytes of a frame to wait for before a blocked read returns
MIN_LOW_WATER = 16 * 1024  # below this a low-water mark saves too little to be worth setting


def tune_socket(sock: socket.socket, congestion: str = "auto") -> None:
    """Options of a data connection: no Nagle, ``Config.tcp_congestion``.

    The buffer sizes are left to the kernel's autotuning: fixed ones (``SO_SNDBUF`` /
    ``SO_RCVBUF``, 4 MiB here once) turn it off and keep up to twice that in flight per
    connection, memory that has left the cache by the time it is copied. With 4 actors that
    doubled the learner's CPU per GB (docs/benchmarks.md, "4 actors against 1").
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_congestion(sock, congestion)


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a buffer list (after a partial send/receive)."""
    i = 0
    while i < len(buffers) and n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _send_timeout_in_kernel(sock: socket.socket, timeout: float) -> bool:
    """Make ``sock`` blocking with ``SO_SNDTIMEO`` = ``timeout``; False where that is refused.

    Why not ``settimeout``: Python then polls before every send and the socket is non-blocking,
    so a frame larger than the free socket buffer goes out in many partial sends, each a trip
    through Python. A blocking send with a kernel timeout is one call per frame.
    """
    if sys.platform == "win32":  # there SO_SNDTIMEO is a DWORD of milliseconds, not a timeval
        return False
    sec = int(timeout)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, int((timeout - sec) * 1e6)))
    except (OSError, struct.error):
        return False
    sock.settimeout(None)
    return True


class TcpSender:
    """Blocking scatter-gather sends from the caller's or the I/O thread, each bounded by
    ``frame_timeout``: one system call per frame while the learner keeps up."""

    name = "tcp"
    any_thread = True  # a socket may be written from any thread (under the send lock)

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, timeout: float, congestion: str = "auto"):
        tune_socket(sock, congestion)
        if not _send_timeout_in_kernel(sock, timeout):
            sock.settimeout(timeout)
        self.sock = sock
        self.timeout = timeout

    def on_ready(self, answer: bytes) -> None:
        """Nothing to learn from the learner's Ready on this plane."""

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        buffers = [memoryview(header), *(b for b in payload if len(b))]
        while buffers:
            try:
                sent = self.sock.sendmsg(buffers)
            except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent
                raise TimeoutError(f"the learner took no data for {self.timeout:g}s") from None
            buffers = _advance(buffers, sent)

    def close(self) -> None:
        close_socket(self.sock)


class SocketReceiver:
    """One actor's data connection, read by the process's pumps (``pump.py``: ``pump_step``
    handles what has arrived, never waiting for more).

    The session's ``begin``/``end`` are thread-safe; a stalled frame is caught by the session's
    heartbeat check, which closes the socket and so wakes the pump. Subclasses provide
    ``pump_step`` and may release what only the pump's thread used in ``_finished``.
    """

    name = "tcp"
    pump_spread = 1  # pumps started before two of these connections share one (``pump.pump``)
    per_pump = pump.PER_PUMP  # connections of its kind one pump reads at most
    own_pump_spread = 1  # pumps running before one that asks for its own pump shares one
    wants_own_pump = False  # set by ``pump_step``: move me to a pump of my own (``Pump._hand_over``)

    def __init__(self, sock: socket.socket, sink: FrameSink, name: str, congestion: str = "auto"):
        sock.setblocking(True)
        tune_socket(sock, congestion)
        self.sock = sock
        self.sink = sink
        # A sink that can take a whole frame at once (the session's ``land``) gets the frames
        # whose payload is in memory already that way: one call instead of begin, copy and end.
        self._land: Callable[[memoryview, memoryview | list[memoryview]], None] | None = getattr(sink, "land", None)
        # One that can take many sessions' whole frames at once gets them that way from a pump
        # (``Pump.land_burst``): a pass's reads first, then one landing for all they brought.
        self.land_burst: Callable[[list[tuple[object, memoryview, memoryview]]], list[tuple[object, Exception]]] | None = (
            getattr(sink, "land_burst", None))  # fmt: skip
        self.frame_started: float | None = None
        self._closed = False
        self._name = name
        self.pump: pump.Pump | None = None  # the pump that reads it, if one does

    @property
    def _pumped(self) -> bool:
        return self.pump is not None

    def start(self) -> None:
        self.pump = pump.pump(self.pump_spread, self.per_pump)
        self.pump.add(self)

    def _failed(self, exc: Exception) -> None:
        """Reading stopped on ``exc``: close and tell the session (unless we were closed)."""
        if not self._closed:
            self._closed = True
            close_socket(self.sock)
            self.sink.fail_threadsafe(exc)

    def _ended(self) -> None:
        """Nothing more is read: the session's ring gets nothing more from this receiver."""
        self.frame_started = None
        self.sink.abandon()
        self._finished()

    def pump_step(self) -> None:
        raise NotImplementedError

    def _finished(self) -> None:
        """After the last write into the sink."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._pumped:  # never started
            close_socket(self.sock)
            return
        # The pump closes the socket once it has stopped watching it (closed here, its number
        # could be reused by another connection while the pump still polls it): shutting it
        # wakes the pump, whose next read sees the end.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class TcpReceiver(SocketReceiver):
    """Reads one actor's frames with ``recvmsg_into`` straight into the sink's views, on a
    pump (``pump_step``): one Python call per socket read, not an event-loop round trip.

    While a frame's payload streams in, ``SO_RCVLOWAT`` keeps the reader asleep until
    ``RECV_LOW_WATER`` bytes have arrived (epoll honours it too): fewer wake-ups, which the
    *sender* pays for on loopback (waking us runs in its system call), and fewer trips through
    this code. Connections start on one shared pump (small frames land a pass at a time there,
    ``pump.py``); one that streams large frames moves to a pump of its own, up to
    :attr:`own_pump_spread` of them, so that a few actors streaming large frames are copied on
    every core at once.
    """

    per_pump = SHARED_PER_PUMP
    own_pump_spread = 8

    def __init__(self, sock: socket.socket, sink: FrameSink, name: str = "rlink-tcp-recv", congestion: str = "auto"):
        super().__init__(sock, sink, name, congestion)
        self._low_water = 1  # the socket's SO_RCVLOWAT now (1 is the kernel's default)
        self._low_water_option = getattr(socket, "SO_RCVLOWAT", None)
        # Where a pumped read stopped: the next header's bytes so far, or the rest of a frame's
        # payload (the sink's views still to fill) and how many bytes that is.
        self._header = bytearray(FRAME_HEADER_BYTES)
        self._got = 0
        self._payload: list[memoryview] = []
        self._left = 0
        self._big = False  # the last frame was large: read only the next header ahead
        self._moved = False  # asked for a pump of its own once (it is not asked again)

    def _wake_after(self, owed: int) -> None:
        """Set the low-water mark for a read that is owed ``owed`` more bytes (the rest of a
        frame whose header came: the actor sends a frame in one go; 0 between frames).

        Linux wakes a blocked reader once the bytes it has *not yet copied* reach the mark, even
        if the reader needs fewer: having copied ``A`` < mark bytes, it waits for ``owed - A``
        more. A mark of at most half of ``owed`` keeps ``owed - A`` at or above the mark, so the
        rest of a frame is never held back waiting for traffic that may not come.
        """
        n = min(RECV_LOW_WATER, owed // 2)
        if n < MIN_LOW_WATER:
            n = 1  # the default: wake for any byte
        if n == self._low_water or self._low_water_option is None:
            return
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, self._low_water_option, n)
            self._low_water = n
        except OSError:  # not supported here: plain reads, which wake for any byte
            self._low_water_option = None

    # --- read by a pump --------------------------------------------------------------------------
    def pump_step(self) -> None:
        """Read what has arrived, without waiting for more (the pump's thread).

        The rest of a frame's payload goes straight into the sink's views. What follows it, or
        what comes between frames, goes into the pump's scratch buffer, from which whole small
        frames are parsed and copied: one system call for a burst of them. After a large frame
        (a scratch buffer or more) only the next header is read that way, into the header
        buffer, so a stream of large frames is never copied twice.
        """
        if not (self._payload or self._got or self._big) and self.land_burst is not None and self._land is not None:
            self._read_frames()  # the pump calling it lands bursts: whole frames are deferred to it
            return
        tail = memoryview(self._header)[self._got :] if self._big else self._room()
        try:
            if self._payload:
                n = self.sock.recvmsg_into([*self._payload, tail], 0, socket.MSG_DONTWAIT)[0]
            else:
                n = self.sock.recv_into(tail, len(tail), socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing after all (or only what the low-water mark holds back)
            return
        if n == 0:
            if self._payload:
                raise ConnectionResetError("actor closed the data connection mid-frame")
            if self._got:
                raise ConnectionResetError("actor closed the data connection mid-header")
            raise EOFError("actor closed the data connection")  # between frames: the control channel says why
        if self._payload:
            if n < self._left:
                self._payload = _advance(self._payload, n)
                self._left -= n
                self._wake_after(self._left)
                return
            n -= self._left
            self._frame_done()
        if tail.obj is self._header:
            self._got += n
            if self._got == FRAME_HEADER_BYTES:
                self._start_frame()
            self._wake_after(self._left)
        else:
            deferring = self._deferring
            if deferring:
                assert self.pump is not None
                self.pump.used(n)  # the frames deferred from it point into the arena
            self._parse(tail[:n], defer=deferring)

    def _read_frames(self) -> None:
        """``pump_step`` between frames on a pump that lands bursts (almost every read of a
        small-frame actor): read into the pump's arena and defer each whole frame read, with
        no per-frame state; only a frame cut off by the end of the read goes through ``_parse``."""
        pump = self.pump
        assert pump is not None
        room = pump.room(_SCRATCH_BYTES)
        try:
            n = self.sock.recv_into(room, _SCRATCH_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if n == 0:
            raise EOFError("actor closed the data connection")  # between frames: the control channel says why
        pump.used(n)
        pos = 0
        while n - pos >= FRAME_HEADER_BYTES:
            end = pos + FRAME_HEADER_BYTES + unpack_payload_bytes(room, pos + PAYLOAD_BYTES_AT)[0]
            if end > n:
                break
            pump.defer(self, room[pos : pos + FRAME_HEADER_BYTES], room[pos + FRAME_HEADER_BYTES : end])
            pos = end
        if pos < n:
            self._parse(room[pos:n], defer=True)

    @property
    def _deferring(self) -> bool:
        """Whole frames are deferred to the pump's burst (else landed one by one)."""
        return self.pump is not None and self.land_burst is not None

    def _room(self) -> memoryview:
        """Where a read of many small frames goes: the pump's arena when its frames are
        deferred to the burst, else the pump thread's scratch buffer."""
        if self._deferring:
            assert self.pump is not None
            return self.pump.room(_SCRATCH_BYTES)
        return memoryview(_scratch())

    def _parse(self, data: memoryview, *, defer: bool = False) -> None:
        """Frames (or their beginning) read into ``data``: headers to the sink, payload bytes
        into its views, each whole frame ended (or, ``defer``, handed to the pump's burst:
        ``data`` is in its arena); where ``data`` stops, the state says."""
        pos, size = 0, len(data)
        land = self._land
        while pos < size:
            if land is not None and not self._got and not self._payload and size - pos >= FRAME_HEADER_BYTES:
                end = pos + FRAME_HEADER_BYTES + announced_payload(data, pos)
                if end <= size:  # the whole frame is in: validated, copied and committed in one call
                    if defer:
                        assert self.pump is not None
                        self.pump.defer(self, data[pos : pos + FRAME_HEADER_BYTES], data[pos + FRAME_HEADER_BYTES : end])
                    else:
                        land(data[pos : pos + FRAME_HEADER_BYTES], data[pos + FRAME_HEADER_BYTES : end])
                    pos = end
                    continue
            if self._payload:
                k = min(self._left, size - pos)
                self._payload = _fill(self._payload, data[pos : pos + k])
                self._left -= k
                pos += k
                if self._left:
                    break  # the rest comes with later reads
                self._frame_done()
                continue
            k = min(FRAME_HEADER_BYTES - self._got, size - pos)
            self._header[self._got : self._got + k] = data[pos : pos + k]
            self._got += k
            pos += k
            if self._got == FRAME_HEADER_BYTES:
                self._start_frame()
        self._wake_after(self._left)  # 0 between frames: the actor may go quiet

    def _start_frame(self) -> None:
        """A whole header is in: the sink's views for its payload."""
        if self.pump is not None and self.pump.deferred:
            # This session's deferred frames come before this one: land them first (seq order).
            error = self.pump.land_burst(current=self)
            if error is not None:
                raise error
        self._got = 0
        self.frame_started = time.monotonic()
        self._payload = [v for v in self.sink.begin(bytes(self._header)) if len(v)]
        self._left = sum(len(v) for v in self._payload)
        self._big = self._left >= _SCRATCH_BYTES
        if self._big and not self._moved:  # it streams large frames: a pump of its own copies them
            self.wants_own_pump = self._moved = True
        if not self._left:
            self._frame_done()

    def _frame_done(self) -> None:
        self._payload, self._left = [], 0
        self.frame_started = None
        self.sink.end_threadsafe()


def _fill(views: list[memoryview], data: memoryview) -> list[memoryview]:
    """Copy ``data`` into the front of ``views`` (which hold at least that much); the views
    still to fill."""
    pos = 0
    for i, view in enumerate(views):
        k = min(len(view), len(data) - pos)
        view[:k] = data[pos : pos + k]
        pos += k
        if pos == len(data):
            return _advance(views[i:], k)
    return []


_SCRATCH_BYTES = 64 * 1024  # a pump's read-ahead buffer: many small frames in one system call
_local = threading.local()


def _scratch() -> bytearray:
    """The calling pump thread's scratch buffer (one pump thread reads one connection at a time)."""
    buf: bytearray | None = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = bytearray(_SCRATCH_BYTES)
    return buf
