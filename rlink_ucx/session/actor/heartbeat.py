"""Actor side, the liveness both ways: say we are alive after a silence, answer the learner's
heartbeats, and give the learner up after ``heartbeat_timeout`` without a message from it,
from one timer armed for the next moment something is due (never a periodic tick)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ...errors import PeerLost, RLinkError
from ...wire import messages as _wire
from .outbox import Outbox
from .state import LinkState

__all__ = ["Heartbeat"]

# Without a learner's heartbeat to answer, the actor says it is alive after this many heartbeat
# intervals of silence: the learner's heartbeats (one interval apart) come first, and answering
# them keeps an idle actor's wake-ups at one per learner heartbeat, not two.
OWN_HEARTBEAT_AFTER = 1.5
# A heartbeat timer this much later than due (in heartbeat intervals) means our own pause.
PAUSED_AFTER = 0.25
SLACK = 0.001  # timers are armed this long after their moment, so the check at it holds


class Heartbeat:
    """The liveness of one connection (loop thread).

    It owns ``last_heard``: the control reader reports each message through :meth:`heard`.

    Args:
        state: reads ``control``.
        outbox: reads when its last frame went out (``frame_sent_at``).
        fail: called with ``PeerLost`` when the learner fell silent for too long.
    """

    def __init__(self, state: LinkState, outbox: Outbox, fail: Callable[[RLinkError], None]):
        self._state = state
        self._outbox = outbox
        self._fail = fail
        self.last_heard = time.monotonic()  # when the learner's last message came (loop thread)
        self._wake: asyncio.Future[None] | None = None  # what the heartbeat task waits on
        self._timer: asyncio.TimerHandle | None = None  # resolves it when something is due
        self._at = 0.0  # when that timer is due

    def _said_alive(self) -> float:
        """When we last said something to the learner: a control message or a frame."""
        control = self._state.control
        assert control is not None
        return max(control.last_send, self._outbox.frame_sent_at)

    def heard(self) -> None:
        """A message from the learner came (loop thread)."""
        self.last_heard = time.monotonic()

    def answer(self) -> None:
        """The learner's heartbeat (it was silent for an interval): answer it unless we spoke
        lately, and push our own heartbeat timer back, so it does not wake us as well."""
        control = self._state.control
        if control is None:
            return
        if time.monotonic() - self._said_alive() >= self._state.config.heartbeat_interval / 2:
            control.send(_wire.Heartbeat())
        self._arm()

    def _heartbeat_due(self) -> float:
        """The next moment the heartbeat has work: our silence is long enough to speak, or the
        learner's long enough to give up on it (monotonic time, as the loop's)."""
        c = self._state.config
        speak = self._said_alive() + OWN_HEARTBEAT_AFTER * c.heartbeat_interval
        return min(speak, self.last_heard + c.heartbeat_timeout)

    def _arm(self) -> None:
        """(Re)schedule the heartbeat's one timer (loop thread): nothing else wakes an idle actor."""
        wake = self._wake
        if wake is None or wake.done():
            return
        if self._timer is not None:
            self._timer.cancel()
        self._at = max(self._heartbeat_due(), time.monotonic()) + SLACK
        self._timer = self._state.loop.call_at(self._at, _wake_up, wake)

    async def run(self) -> None:
        """Keep the liveness both ways, from one timer armed for the next moment something is
        due (not a periodic tick): say we are alive after a silence (frames and control
        messages say it already; the learner's heartbeats are answered as they come), and give
        the learner up after ``heartbeat_timeout`` without a message from it."""
        control = self._state.control
        assert control is not None
        c = self._state.config
        wake = None
        try:
            while True:
                self._wake = wake = self._state.loop.create_future()
                self._arm()
                await wake
                now = time.monotonic()
                # A timer that fires late means this process was paused (SIGSTOP, a VM stall) or
                # its loop blocked: what the learner sent meanwhile is still unread, so our own
                # pause is not the learner's silence. (Only a real pause: the timer is armed for
                # the very moment the learner would be given up, and crediting every small
                # lateness would push that moment on, again and again.)
                late = now - self._at
                if late > PAUSED_AFTER * c.heartbeat_interval:
                    self.last_heard = min(now, self.last_heard + late)
                if now - self.last_heard >= c.heartbeat_timeout:
                    self._fail(PeerLost(f"no message from the learner for {c.heartbeat_timeout:.3g}s"))
                    return
                if now - self._said_alive() >= OWN_HEARTBEAT_AFTER * c.heartbeat_interval:
                    control.send(_wire.Heartbeat())
        finally:
            if wake is not None and self._wake is wake:  # not a newer connection's
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self._wake = None


def _wake_up(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)
