"""The I/O thread: one asyncio loop per Learner, and one per process for all its Actors.

The sync public API hands work to the loop with :meth:`IOThread.call`; the loop never blocks.
A process holding many ``Actor`` objects (a vectorized or threaded sampler) shares one loop
among them (:func:`shared_io`): threads per process do not grow with the number of actors, and
their periodic work runs from one timer per interval (:meth:`IOThread.every`), not one each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from ..errors import Closed
from ..errors import TimeoutError as RLinkTimeout

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


def call_soon_any_thread(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """``loop.call_soon_threadsafe(fn, *args)``, except that a closed loop is not an error: its
    owner shut down and nobody is left to notify (a receiving thread that stops at exit used to
    die with a traceback)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


class IOThread:
    """A daemon thread running one asyncio event loop until :meth:`stop`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()  # a forked child inherits the object, not the thread
        self._every: dict[float, list[Callable[[], None]]] = {}  # interval -> callbacks (loop thread only)
        self._timers: set[float] = set()  # intervals whose timer is pending
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Return once the loop runs: a call made before that (an Actor connecting at once on a
        # busy machine) found the loop not running yet and raised "the I/O thread has stopped".
        running = threading.Event()
        self.loop.call_soon(running.set)  # before the thread starts: nothing else touches the loop yet
        self._thread.start()
        running.wait(10.0)

    def every(self, interval: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` on the loop every ``interval`` seconds, from one timer shared by every
        callback of that interval; returns a function that stops it (any thread)."""

        def add() -> None:
            self._every.setdefault(interval, []).append(fn)
            if interval not in self._timers:
                self._timers.add(interval)
                self.loop.call_later(interval, self._tick, interval)

        def remove() -> None:
            callbacks = self._every.get(interval, [])
            if fn in callbacks:
                callbacks.remove(fn)

        if self.in_loop_thread():
            add()
        else:
            self.soon(add)
        return lambda: remove() if self.in_loop_thread() else self.soon(remove)

    def _tick(self, interval: float) -> None:
        callbacks = self._every.get(interval)
        if not callbacks:
            self._timers.discard(interval)  # the next every() of this interval starts it again
            return
        for fn in list(callbacks):
            try:
                fn()
            except Exception:  # one actor's failure must not stop the others' ticks
                log.exception("periodic callback %r failed", fn)
        self.loop.call_later(interval, self._tick, interval)

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
        """Run ``fn(*args)`` on the loop soon (any thread; in FIFO order with other calls)."""
        if self.in_loop_thread():  # no need to wake the loop through its self-pipe
            self.loop.call_soon(fn, *args)
        else:
            call_soon_any_thread(self.loop, fn, *args)

    def stop(self, timeout: float) -> None:
        async def _shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout) if tasks else None

        if self.loop.is_running() and not self.in_loop_thread():
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(), self.loop).result(timeout)
            except Exception:  # best effort: the loop is stopped below regardless
                log.debug("I/O shutdown did not finish cleanly", exc_info=True)
            self.soon(self.loop.stop)
        # The join is bounded: a wedged native call (UCX progress) must not hang close().
        self._thread.join(timeout)


_shared: IOThread | None = None
_shared_users = 0
_shared_lock = threading.Lock()


def shared_io() -> IOThread:
    """The I/O thread every Actor of this process uses; pair each call with :func:`release_io`."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or _shared.pid != os.getpid() or not _shared._thread.is_alive():
            _shared, _shared_users = IOThread(name="rlink-actor-io"), 0
        _shared_users += 1
        return _shared


def release_io(io: IOThread, timeout: float) -> None:
    """One user of the shared I/O thread is done; the last one stops it (a later Actor starts a
    new one), so a process that closed all its actors keeps no rlink thread."""
    global _shared, _shared_users
    with _shared_lock:
        if io is not _shared:
            last = True  # from before a fork, or already replaced: it is ours alone to stop
        else:
            _shared_users -= 1
            last = _shared_users <= 0
            if last:
                _shared = None
    if last and io.pid == os.getpid():
        io.stop(timeout)
