"""Actor side, the credit the learner granted: added on the I/O loop, taken by senders on any
thread, under one condition variable that also wakes the callers waiting for some."""

from __future__ import annotations

import asyncio
import threading
import time

from ...errors import Closed
from .state import LinkState

__all__ = ["Credit"]


class Credit:
    """Steps the learner lets this actor send (its Credit messages, less what was taken or
    revoked). ``steps`` is read without the lock only as a hint (a racy peek); every change is
    made under ``cv``.

    Args:
        state: the connection's shared state (read: whether it is connected, failed or closing).
    """

    __slots__ = ("_state", "cv", "event", "steps", "waits")

    def __init__(self, state: LinkState) -> None:
        self._state = state
        self.steps = 0
        self.waits = 0  # a statistic: waits for credit, counted without the lock
        self.cv = threading.Condition()
        self.event = asyncio.Event()  # the send loop's wake-up: credit came, or an error

    def add(self, steps: int) -> None:
        """The learner granted ``steps`` more (loop thread)."""
        with self.cv:
            self.steps += steps
            self.cv.notify_all()
        self.event.set()

    def revoke(self, steps: int) -> int:
        """The learner takes back up to ``steps`` unused steps; returns how many it got."""
        with self.cv:
            give = max(0, min(self.steps, steps))
            self.steps -= give
        return give

    def take(self, want: int) -> int:
        """Take up to ``want`` steps (any thread); returns how many were taken."""
        with self.cv:
            k = min(want, self.steps)
            self.steps -= k
            return k

    def at_hand(self, n: int) -> bool:
        """Whether ``n`` steps are at hand now (a peek, not taken)."""
        return self.steps >= n

    def wait(self, deadline: float) -> None:
        """Until some credit is at hand (not taken: another thread may take it first), or
        ``deadline`` passed (then the caller's frame waits in the I/O thread's queue, which
        reports Backpressure). Raises the actor's error, or Closed."""
        s = self._state
        with self.cv:
            while self.steps <= 0 or not s.connected:
                if s.error is not None:
                    raise s.error
                if s.closing:
                    raise Closed("the actor is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.waits += 1
                self.cv.wait(min(left, 0.5))

    def clear(self) -> None:
        """The connection is gone: the credit it granted goes with it."""
        with self.cv:
            self.steps = 0
