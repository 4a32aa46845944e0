"""The I/O thread (one asyncio loop per Learner/Actor) and the framed control connection.

The sync public API hands work to the loop with :meth:`IOThread.call`; the loop never blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from . import _wire
from ._errors import Closed, PeerLost, ProtocolError
from ._errors import TimeoutError as RLinkTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")


async def ticks(interval: float) -> AsyncIterator[float]:
    """Every ``interval`` seconds, yield how many seconds late this tick came.

    A late tick means this process was paused (SIGSTOP, a VM stall) or its loop was blocked:
    what peers sent meanwhile is still unread, so a liveness check must not count that
    silence against them.
    """
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        yield max(0.0, now - last - interval)
        last = now


class IOThread:
    """A daemon thread running one asyncio event loop until :meth:`stop`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, coro: Coroutine[Any, Any, T], timeout: float, what: str = "operation") -> T:
        """Run ``coro`` on the loop and wait for its result in the calling thread."""
        if self.loop.is_closed() or not self.loop.is_running():
            coro.close()
            raise Closed(f"cannot run {what}: the I/O thread has stopped")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise RLinkTimeout(f"{what} did not finish within {timeout:.3g}s") from exc
        except concurrent.futures.CancelledError as exc:
            raise Closed(f"{what} was cancelled because the connection closed") from exc

    def soon(self, fn: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop already closed: nothing left to notify
            pass

    def stop(self, timeout: float) -> None:
        async def _shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout) if tasks else None

        if self.loop.is_running() and not self.in_loop_thread():
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(), self.loop).result(timeout)
            except Exception:  # noqa: BLE001 - best effort: the loop is stopped below regardless
                log.debug("I/O shutdown did not finish cleanly", exc_info=True)
            self.soon(self.loop.stop)
        # The join is bounded: a wedged native call (UCX progress) must not hang close().
        self._thread.join(timeout)


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
