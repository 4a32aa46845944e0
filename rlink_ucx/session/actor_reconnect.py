"""Actor side, reconnecting: retry a lost learner with backoff and jitter, then resume the
stream where the learner says it stopped (schema again, unacknowledged frames resent)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ..errors import AuthError, PeerLost, RLinkError, SchemaMismatch, Superseded
from ..wire import messages as _wire
from ..wire.codec import Schema

log = logging.getLogger(__name__)


class Reconnect:
    """Part of :class:`ActorConnection`: the reconnect loop, schema proposals (which survive a
    reconnect) and the requeueing of frames the learner does not hold."""

    async def _reconnect(self, cause: RLinkError) -> None:
        """Retry the learner with backoff and jitter until ``reconnect_timeout``; then resume
        the stream where the learner says it stopped (resending what it lacks)."""
        self._teardown()
        deadline = time.monotonic() + self.config.reconnect_timeout
        delay, last = 0.05, cause
        # An attempt made while the link is still down can be swallowed whole (a blackholed
        # route, a cut that TCP does not see), and would then hold the actor for the full
        # connect + handshake timeouts after the link is back. A healthy learner answers within
        # a heartbeat interval, so each attempt gets twice that (at least 1 s), doubling after
        # each failure up to the full timeouts: a slow learner is still reached.
        full = self.config.connect_timeout + self.config.handshake_timeout
        attempt_timeout = min(full, max(1.0, 2 * self.config.heartbeat_interval))
        while not self.closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(left, delay * (0.5 + random.random())))
            delay = min(2 * delay, 2.0)
            try:
                await self.connect(attempt_timeout)
            except (AuthError, SchemaMismatch, Superseded) as exc:
                last = exc
                break
            except (RLinkError, OSError) as exc:
                last = exc if isinstance(exc, RLinkError) else PeerLost(str(exc))
                attempt_timeout = min(full, 2 * attempt_timeout)
                self._teardown()
                continue
            self.reconnects += 1
            self.reconnecting = False
            log.info("actor %s reconnected (resuming at seq %d)", self.actor_id, self.next_send_seq)
            if self.subscription is not None and self.control is not None:
                self.control.send(self.subscription)
            with self.changed:
                self.changed.notify_all()
            with self.credit_cv:
                self.credit_cv.notify_all()
            return
        self.reconnecting = False
        if not self.closing:
            if isinstance(last, (AuthError, SchemaMismatch, Superseded)):
                self._fail_for_good(last)
            else:
                self._fail_for_good(PeerLost(f"learner unreachable for {self.config.reconnect_timeout:.3g}s: {last}"))

    def _teardown(self) -> None:
        """Drop the broken connection (not the frames: they are resent)."""
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = [t for t in self._tasks if t is current]
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.control is not None:
            self.control.close()
            self.control = None
        with self.credit_cv:
            self.credit = 0
        self._ready = self.loop.create_future()
        if self._proposal is not None and not self._proposal.done():
            self._proposal.set_exception(_ConnectionReplaced())  # propose() asks the new connection
            self._proposal.exception()  # retrieved: a proposal nobody awaits any more stays quiet
        self._proposal = None

    async def _renegotiate(self) -> None:
        assert self.schema is not None
        reply = await self._propose_once(self.schema)
        if isinstance(reply, _wire.Reject):
            raise SchemaMismatch(f"after reconnecting, the learner rejected the schema: {reply.reason}")
        self.schema_id, self.max_frame_steps = reply.schema_id, reply.max_steps

    def _requeue(self, resume: int) -> None:
        """Put every unacknowledged frame back in the queue, from where the learner stopped
        (``resume``; -1: a learner that never saw this stream gets everything unacknowledged)."""
        with self.changed:
            frames = [*self.inflight, *self.queue]
            self.outstanding += len(self.inflight)  # queued again
            self.inflight.clear()
            self.queue.clear()
            if resume >= 0 and resume > self.acked:
                self.acked = resume
            start = self.next_send_seq
            base = resume if resume >= 0 else self.acked  # a new learner: from what the old one lacked
            for fb in frames:
                fb.sent = min(fb.n, max(0, base - fb.seq))
                if fb.sent == fb.n:  # the learner has all of it
                    self._finished(fb)
                else:
                    self.queue.append(fb)
            if self.queue:
                start = self.queue[0].seq + self.queue[0].sent
            known = max(self.acked, resume)
            if start > known:
                self.steps_lost += start - known  # sent once, never acknowledged, not kept
            self.next_send_seq = start
            self.changed.notify_all()
        self._wake.set()

    async def propose(self, schema: Schema) -> _wire.Accept | _wire.Reject:
        """Propose the first schema. If the connection is replaced before the answer comes, the
        proposal is made again on the new one (the caller's timeout bounds the whole wait)."""
        while True:
            while not self.connected and self.error is None:  # a reconnect is under way
                await asyncio.sleep(0.02)
            if self.error is not None:
                raise self.error
            try:
                return await self._propose_once(schema)
            except _ConnectionReplaced:
                continue

    async def _propose_once(self, schema: Schema) -> _wire.Accept | _wire.Reject:
        assert self.control is not None
        self._proposal = self.loop.create_future()
        self.control.send(_wire.Propose(schema.to_wire()))
        return await self._proposal

    def sync(self, seq: int) -> None:
        """Ask the learner to acknowledge once ``seq`` steps are buffered (loop thread)."""
        if self.control is not None and self.acked < seq:
            self.control.send(_wire.Sync(seq))



class _ConnectionReplaced(Exception):
    """The connection a proposal went out on was torn down before the answer came."""

