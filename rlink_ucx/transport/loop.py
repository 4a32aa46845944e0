"""The I/O thread: one asyncio loop per Learner/Actor.

The sync public API hands work to the loop with :meth:`IOThread.call`; the loop never blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine
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
