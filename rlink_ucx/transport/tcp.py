"""The ``tcp`` data plane: a second TCP connection per actor, scatter-gather I/O.

The sender hands the header and every field buffer to one ``sendmsg`` call; the receiver
reads the header into a small buffer, asks the sink for destination views and fills them with
``recvmsg_into``: no per-message Python copies on either side.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from .._wire import FRAME_HEADER_BYTES
from .base import FrameSink

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


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


class TcpSender:
    """Blocking scatter-gather sends on the actor's I/O thread.

    A blocking ``sendmsg`` (bounded by ``frame_timeout``) beats non-blocking sends driven by
    the event loop: one Python wake-up per frame instead of one per socket-buffer's worth.
    """

    name = "tcp"
    any_thread = True  # a socket may be written from any thread (under the send lock)

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, timeout: float):
        tune_socket(sock)
        sock.settimeout(timeout)
        self.sock = sock

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        buffers = [memoryview(header), *(b for b in payload if len(b))]
        while buffers:
            buffers = _advance(buffers, self.sock.sendmsg(buffers))

    def close(self) -> None:
        _close(self.sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class SocketReceiver:
    """One actor's data connection, read with blocking calls on a thread of its own.

    The session's ``begin``/``end`` are thread-safe; a stalled frame is caught by the session's
    heartbeat check, which closes the socket and so unblocks this thread. Subclasses provide
    ``_receive`` (the frame loop) and may release what only this thread used in ``_finished``.
    """

    name = "tcp"

    def __init__(self, sock: socket.socket, sink: FrameSink, name: str):
        sock.setblocking(True)
        tune_socket(sock)
        self.sock = sock
        self.sink = sink
        self.frame_started: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._receive()
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the session
            if not self._closed:
                self._closed = True
                _close(self.sock)
                self.sink.fail_threadsafe(exc)
        finally:
            self.frame_started = None
            self.sink.abandon()  # nothing more can land in the ring from this thread
            self._finished()

    def _receive(self) -> None:
        raise NotImplementedError

    def _finished(self) -> None:
        """After this thread's last write into the sink."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _close(self.sock)


class TcpReceiver(SocketReceiver):
    """Reads one actor's frames with blocking ``recvmsg_into``: one Python call per socket
    read instead of an event-loop round trip each (measured ~2x the throughput on loopback)."""

    def __init__(self, sock: socket.socket, sink: FrameSink, name: str = "rlink-tcp-recv"):
        super().__init__(sock, sink, name)

    def _receive(self) -> None:
        header = bytearray(FRAME_HEADER_BYTES)
        view = memoryview(header)
        got = 0  # bytes of the next header already read
        while True:
            while got < FRAME_HEADER_BYTES:
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    if got == 0:  # between frames: the control channel says why
                        raise EOFError("actor closed the data connection")
                    raise ConnectionResetError("actor closed the data connection mid-header")
                got += n
            self.frame_started = time.monotonic()
            payload = [v for v in self.sink.begin(bytes(header)) if len(v)]
            got = 0
            while payload:
                # Read the next frame's header in the same call as this payload's tail:
                # one system call per frame fewer for a streaming actor.
                left = sum(len(v) for v in payload)
                n = self.sock.recvmsg_into([*payload, view])[0]
                if n == 0:
                    raise ConnectionResetError("actor closed the data connection mid-frame")
                if n >= left:
                    got, payload = n - left, []
                else:
                    payload = _advance(payload, n)
            self.frame_started = None
            self.sink.end_threadsafe()
