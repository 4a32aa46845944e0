"""The framed control connection: length-prefixed msgspec messages over one socket, on the I/O loop."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from ..errors import PeerLost, ProtocolError
from ..wire import messages as _wire


class ControlConnection:
    """Length-prefixed msgspec messages over one non-blocking socket, on the I/O loop.

    Reads are bounded (``max_bytes``) before any allocation; writes are buffered so a
    sender never waits inside a callback.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, peer: str = "?"):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = loop
        self.peer = peer
        self._out = bytearray()
        self._writing = False
        self._reader: asyncio.Task[Any] | None = None  # the task that last waited in recv
        self.last_send = time.monotonic()  # heartbeats are only sent after this much silence
        self.closed = False
        self.handed_off = False  # the socket now belongs to a data-plane receiver

    async def _read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = await self.loop.sock_recv_into(self.sock, view[got:])
            except OSError as exc:
                raise PeerLost(f"connection to {self.peer} broke: {exc}") from exc
            if k == 0:
                raise PeerLost(f"{self.peer} closed the connection")
            got += k
        return bytes(buf)

    async def recv(self, max_bytes: int) -> _wire.Message:
        if self.closed:
            raise PeerLost(f"connection to {self.peer} is closed")
        self._reader = asyncio.current_task()
        (length,) = _wire.LENGTH.unpack(await self._read_exact(_wire.LENGTH.size))
        _wire.check_length(length, max_bytes)
        if length == 0:
            raise ProtocolError("empty control message")
        return _wire.decode(await self._read_exact(length))

    def send(self, msg: Any) -> None:
        """Queue ``msg`` for sending; never blocks (call on the loop thread)."""
        if self.closed:
            return
        self.last_send = time.monotonic()
        self._out += _wire.encode(msg)
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                n = self.sock.send(self._out)
                del self._out[:n]
        except BlockingIOError:
            if not self._writing:
                self._writing = True
                self.loop.add_writer(self.sock, self._on_writable)
            return
        except OSError:
            self._out.clear()  # the reader side will report the broken connection
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.sock)

    def _on_writable(self) -> None:
        self._flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Unregister the fd before closing it: a pending sock_recv_into leaves a reader in the
        # selector, and once the kernel reuses the fd number for a new connection, that stale
        # entry silently swallows the new socket's registration (seen as a hung handshake).
        fd = self.sock.fileno()
        if fd >= 0:
            self.loop.remove_reader(fd)
            self.loop.remove_writer(fd)
        if self._reader is not None and self._reader is not asyncio.current_task() and not self._reader.done():
            self._reader.cancel()
        try:
            self.sock.close()
        except OSError:
            pass
