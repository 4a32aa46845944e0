"""Credit for actors, granted fairly: each pass starts one actor further round the list of
sessions, so one flooding actor cannot starve the others; idle actors give credit back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..config import Config
from ..store.ring import StepRing


class CreditGranter:
    """Tops up the credit of every open session from the ring's free space (on the I/O loop)."""

    def __init__(self, sessions: dict[int, Any], config: Config, loop: asyncio.AbstractEventLoop):
        self.sessions = sessions  # the server's own dict: session id -> LearnerSession
        self.config = config
        self.loop = loop
        self.ring: StepRing | None = None  # set once the schema made the ring
        self._rotation = 0
        self._pending = False  # a grant is scheduled on the loop and has not run yet

    def space_freed(self) -> None:
        """The consumer freed ring space (its thread). Wake the loop only if an actor is low on
        credit: only those get any (see grant_credits), and each wake is a thread switch."""
        if any(s.low_on_credit for s in list(self.sessions.values())):
            self.request_grant()

    def request_grant(self) -> None:
        """Run grant_credits on the loop soon (any thread); at most one pending at a time."""
        if not self._pending:
            self._pending = True
            self.loop.call_soon_threadsafe(self._grant_now)

    def _grant_now(self) -> None:
        self._pending = False
        self.grant()

    def grant(self) -> None:
        """Top up each ready actor's credit while the ring has room (round robin, for fairness)."""
        ring = self.ring
        if ring is None:
            return
        window = max(4 * ring.max_frame_steps, self.config.actor_window_bytes // ring.step_bytes)
        threshold = max(1, window // 4)  # grant in chunks: one Credit message per quarter window
        active = [s for s in self.sessions.values() if s.state == "open" and s.ring is ring and s.receiver]
        if not active:
            return
        self._rotation = (self._rotation + 1) % len(active)
        now = time.monotonic()
        for session in active[self._rotation :] + active[: self._rotation]:
            if session.revoking or (session.idle(now) and session.credit >= ring.max_frame_steps):
                continue  # idle, with a frame's worth: more would sit unused while others wait
            want = window - session.credit
            if want < threshold:
                continue
            give = min(want, ring.grantable())
            if give <= 0:
                return
            if give < threshold and session.credit > 0:
                continue
            ring.grant(give)
            session.grant(give, low_water=window - threshold)

    def reclaim_idle(self, now: float) -> None:
        """When the ring has no room left to grant, take credit back from idle actors (keeping
        them one frame's worth) so the ones still sending are not starved."""
        ring = self.ring
        if ring is None or ring.grantable() >= ring.max_frame_steps:
            return
        for session in list(self.sessions.values()):
            if session.ring is ring:
                session.revoke_idle_credit(now, keep=ring.max_frame_steps)
