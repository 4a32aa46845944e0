"""The replay's inserter thread: takes steps from the learner's ring into the replay table.

It takes steps the way ``RLinkDataset.fetch`` does (``StepRing.take`` / ``release``), so the
actors' side is unchanged. It sleeps on the ring's condition while no step is ready and on
the replay's condition while the rate limiter (or FIFO) leaves no room; while it waits for
room, nothing leaves the ring, the ring fills, the learner stops granting credit and the
actors' ``put`` blocks: backpressure, nothing dropped. For a table that takes whole ring chunks
without copying them, it waits a few milliseconds for the chunk under way to complete and ends
its takes on chunk boundaries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...errors import Closed
from ...errors import TimeoutError as RLinkTimeout
from ..ring import StepRing
from .core import ReplayCore

__all__ = ["Inserter"]

log = logging.getLogger(__name__)

_WAIT = 3600.0  # a ring wait ends on a frame, on close (wake) or on the ring closing
_GRACE = 0.005  # how long to wait for the rest of a ring chunk that could be taken without a copy


class Inserter:
    def __init__(self, core: ReplayCore, ring_source: Callable[[float], StepRing | None]):
        self.core = core
        self.ring_source = ring_source  # (timeout) -> the ring once the schema is known; may raise Closed
        self.ring: StepRing | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rlink-replay-insert", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self.core.close()
        if self.ring is not None:
            self.ring.wake()  # a take() waiting for a frame looks at _stop (its ``finished``)
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _how_many(self, ring: StepRing, most: int) -> int:
        """Steps to take next (at most ``most``), once some are ready: sleeps on the ring until
        a frame lands. A table that takes whole chunks without copying (``core.adopts``) waits
        a moment longer for the chunk under way to complete, and ends its takes on chunks."""
        ready, front = ring.wait_ready(1, _WAIT, finished=self._stop.is_set)
        if not ready:
            return 0
        if not self.core.adopts:
            return min(ready, most)
        k = ring.chunk_steps
        to_end = k - front % k  # steps to the end of the chunk the front is in
        if ready < min(to_end, most):  # at a high rate it completes in a moment; at a low one, copying is cheap
            ready, front = ring.wait_ready(min(to_end, most), _GRACE, finished=self._stop.is_set)
            to_end = k - front % k
        want = min(ready, most)
        whole = want - (want - to_end) % k if want >= to_end else want  # end on a chunk boundary
        return whole

    def _run(self) -> None:
        try:
            ring = None
            while ring is None and not self._stop.is_set():
                ring = self.ring_source(0.5)
            if ring is None:
                return
            self.ring = ring
            self.core.attach(ring.schema, (ring.chunk_steps, ring.capacity))
            limit = max(1, ring.capacity // 4)  # a quarter of the ring per insert frees space early
            while not self._stop.is_set():
                room = self.core.wait_room()
                if room == 0:
                    return  # closing
                most = limit if room is None else min(room, limit)
                want = self._how_many(ring, most)
                if not want:
                    continue  # stopping, or another reader took them
                try:
                    pieces, take_id = ring.take(want, 0.0)
                except RLinkTimeout:
                    continue  # another reader took them first
                try:
                    self.core.insert(ring, pieces)
                finally:
                    ring.release(take_id)
        except Closed:
            pass  # the learner (or this replay) closed
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of sample()
            log.error("replay inserter failed: %r", exc)
            self.core.fail(exc)
        finally:
            self.core.close_inserts()
