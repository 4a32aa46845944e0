"""The ``tcp`` data plane: a second TCP connection per actor, scatter-gather I/O.

The sender hands the header and every field buffer to one ``sendmsg`` call; the receiver
reads the header into a small buffer, asks the sink for destination views and fills them with
``recvmsg_into``: no per-message Python copies on either side.
"""

from __future__ import annotations

import asyncio
import socket
import time

from .._wire import FRAME_HEADER_BYTES
from .base import FrameSink

# A connection gives up the loop after this many bytes so one busy actor cannot starve others.
_FAIRNESS_BYTES = 8 * 1024 * 1024
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
    name = "tcp"

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        sock.setblocking(False)
        tune_socket(sock)
        self.sock = sock
        self.loop = loop

    async def send(self, header: bytes, payload: list[memoryview]) -> None:
        buffers = [memoryview(header), *(b for b in payload if len(b))]
        while buffers:
            try:
                sent = self.sock.sendmsg(buffers)
            except BlockingIOError:
                await self._writable()
                continue
            buffers = _advance(buffers, sent)

    def _writable(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self.loop.create_future()

        def ready() -> None:
            self.loop.remove_writer(self.sock)
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(self.sock, ready)
        fut.add_done_callback(lambda f: self.loop.remove_writer(self.sock) if f.cancelled() else None)
        return fut

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpReceiver:
    """Reads frames from one actor's data socket, driven by loop reader callbacks."""

    name = "tcp"

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, sink: FrameSink):
        sock.setblocking(False)
        tune_socket(sock)
        self.sock = sock
        self.loop = loop
        self.sink = sink
        self._header = bytearray(FRAME_HEADER_BYTES)
        self._header_got = 0
        self._payload: list[memoryview] | None = None
        self.frame_started: float | None = None
        self._closed = False

    def start(self) -> None:
        self.loop.add_reader(self.sock, self._on_readable)

    def _on_readable(self) -> None:
        budget = _FAIRNESS_BYTES
        try:
            while budget > 0 and not self._closed:
                if self._payload is None:
                    n = self.sock.recv_into(memoryview(self._header)[self._header_got :])
                    if n == 0:
                        if self._header_got == 0:  # between frames: the control channel says why
                            raise EOFError("actor closed the data connection")
                        raise ConnectionResetError("actor closed the data connection mid-header")
                    if self._header_got == 0:
                        self.frame_started = time.monotonic()
                    self._header_got += n
                    if self._header_got < FRAME_HEADER_BYTES:
                        continue
                    self._header_got = 0
                    self._payload = [v for v in self.sink.begin(bytes(self._header)) if len(v)]
                    if not self._payload:
                        self._finish()
                    continue
                n = self.sock.recvmsg_into(self._payload)[0]
                if n == 0:
                    raise ConnectionResetError("actor closed the data connection mid-frame")
                budget -= n
                self._payload = _advance(self._payload, n)
                if not self._payload:
                    self._finish()
        except BlockingIOError:
            return
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the session
            self.close()
            self.sink.fail(exc)

    def _finish(self) -> None:
        self._payload = None
        self.frame_started = None
        self.sink.end()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.remove_reader(self.sock)
        except (ValueError, OSError, RuntimeError):
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        self._payload = None
        self.frame_started = None
        self.sink.abandon()
