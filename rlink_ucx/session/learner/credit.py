"""Credit for actors, granted fairly.

Each actor may hold at most a *fair window*: the configured window, shrunk as more actors
connect so that together they hold at most half the ring (the other half absorbs frames in
flight and batches the consumer has not released yet). Grants go round robin, each pass
starting one actor further round the list, so one flooding actor cannot starve the others.
Credit promised while fewer actors were connected is taken back from the actors that hold more
than the new fair window, busy or not; idle actors give theirs back too once the ring has
nothing left to give. A session that does not give revoked credit back (by ``Returned`` or by
the frames it had in flight) within ``heartbeat_timeout + frame_timeout`` is ended as a protocol
error, and its credit goes to the others (``LearnerSession._check_revoke``, on the heartbeat).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ...config import Config
from ...store.ring import StepRing
from ...transport.loop import call_soon_any_thread
from ...transport.session_state import SessionState


class CreditGranter:
    """Tops up the credit of every open session from the ring's free space (on the I/O loop)."""

    def __init__(self, sessions: dict[int, Any], config: Config, loop: asyncio.AbstractEventLoop):
        self.sessions = sessions  # the server's own dict: session id -> LearnerSession
        self.config = config
        self.loop = loop
        self.ring: StepRing | None = None  # set once the schema made the ring
        self._rotation = 0
        self._pending = False  # a grant is scheduled on the loop and has not run yet
        # Some actor is low on credit and the ring had no room for it: the consumer's next
        # release must wake the loop. A flag, so that a release (one per batch) does not walk
        # every session: with many actors that walk costs the consumer's thread (docs/benchmarks.md).
        self.starved = False

    def window(self, ring: StepRing, actors: int) -> int:
        """Steps of credit one actor may hold while ``actors`` share ``ring``."""
        configured = max(4 * ring.max_frame_steps, self.config.actor_window_bytes // ring.step_bytes)
        fair = ring.capacity // (2 * max(1, actors))
        return max(1, min(configured, fair))

    def space_freed(self) -> None:
        """The consumer freed ring space (its thread). Wake the loop only if an actor is low on
        credit and waits for room: only those get any (see grant), and each wake is a thread
        switch."""
        if self.starved:
            self.request_grant()

    def credit_low(self) -> None:
        """A session fell to its low-water mark (any thread, after its credit fell): grant now
        if the ring has room, else once the consumer frees some. The flag is set before the
        room is looked at, so a release in between still sees it."""
        self.starved = True
        ring = self.ring
        if ring is not None and ring.grantable() > 0:
            self.request_grant()

    def request_grant(self) -> None:
        """Run grant on the loop soon (any thread); at most one pending at a time: the events
        of one loop pass (a storm of proposals, attaches or Returned, each of which used to
        walk every session) share one walk."""
        if not self._pending:
            self._pending = True
            call_soon_any_thread(self.loop, self._grant_now)

    def _grant_now(self) -> None:
        self._pending = False
        self.grant()

    def grant(self) -> None:
        """Top up each ready actor's credit while the ring has room (round robin, for fairness)."""
        ring = self.ring
        if ring is None:
            return
        active = [s for s in self.sessions.values() if s.state is SessionState.OPEN and s.ring is ring and s.receiver]
        self.starved = False  # set again below for each actor left waiting for room
        if not active:
            return
        window = self.window(ring, len(active))
        threshold = max(1, window // 4)  # grant in chunks: one Credit message per quarter window
        keep_idle = min(window, ring.max_frame_steps)
        self._rotation = (self._rotation + 1) % len(active)
        now = time.monotonic()
        low_water = window - threshold
        room_seen = 0  # the room on which an actor was left waiting
        for session in active[self._rotation :] + active[: self._rotation]:
            # A mark set under a larger window would keep the session "low" for good, and every
            # batch the consumer frees would wake this loop for nothing.
            flow = session.flow
            flow.low_water = min(flow.low_water, low_water)
            if flow.revoking or (session.idle(now) and flow.credit >= keep_idle):
                continue  # idle, with a frame's worth: more would sit unused while others wait
            want = window - flow.credit
            if want < threshold:
                continue
            room = ring.grantable()
            give = min(want, room)
            if give <= 0:  # it, and the actors after it, wait for room
                self.starved, room_seen = True, room
                break
            if give < threshold and flow.credit > 0:
                if session.low_on_credit:  # too little room to be worth a grant: it waits
                    self.starved, room_seen = True, room
                continue
            ring.grant(give)
            session.grant(give, low_water=low_water)
        if self.starved and ring.grantable() > room_seen:
            # The consumer freed room after it was looked at but before the flag was set, so
            # its release saw no flag: grant again rather than wait for a release that may
            # never come (the ring may be empty by now).
            self.request_grant()
        # Take back what actors hold beyond the fair window (promised while fewer were
        # connected); their Returned grants it to the others.
        self._revoke_excess(active, window, threshold)

    @staticmethod
    def _revoke_excess(active: list[Any], window: int, threshold: int) -> None:
        for session in active:
            if session.flow.credit - window >= threshold:
                session.revoke_credit(keep=window)

    def reclaim_idle(self, now: float) -> None:
        """When the ring has no room left to grant, take credit back from idle actors (keeping
        them a frame's worth, at most a fair window) so the ones still sending are not starved."""
        ring = self.ring
        if ring is None or ring.grantable() >= ring.max_frame_steps:
            return
        sessions = [s for s in list(self.sessions.values()) if s.ring is ring]
        keep = min(self.window(ring, len(sessions)), ring.max_frame_steps)
        for session in sessions:
            if session.idle(now):
                session.revoke_credit(keep=keep)
