"""Actor side, reconnecting: retry a lost learner with backoff and jitter, then resume the
stream where the learner says it stopped (schema again, unacknowledged frames resent)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ...errors import AuthError, Closed, ConnectError, PeerLost, RLinkError, SchemaMismatch, Superseded
from ...transport.plane import map_plane_error
from ...wire import messages as _wire
from ...wire.codec import Schema
from .connect import Rejected

log = logging.getLogger(__name__)
# Rejections no retry can cure: the token, the schema, a refused protocol version or data plane,
# a newer incarnation, or a learner that said it is finishing.
FINAL = (AuthError, Closed, Rejected, SchemaMismatch, Superseded)


REFUSED_BACKOFF = 0.5  # seconds (times 0.5-1.5 of jitter) between attempts nobody answers


def _refused(error: BaseException) -> bool:
    """Whether the connection was refused: nothing listens there (yet)."""
    while error is not None:
        if isinstance(error, ConnectionRefusedError):
            return True
        error = error.__cause__  # type: ignore[assignment]
    return False


class Reconnect:
    """Part of :class:`ActorConnection`: the reconnect loop, schema proposals (which survive a
    reconnect) and the requeueing of frames the learner does not hold."""

    async def open_session(self) -> None:
        """Connect for the first time, retrying with backoff and jitter until
        ``Config.connect_timeout``: an actor may start before its learner, or during a storm of
        others connecting. Only a real rejection (token, schema, protocol) fails at once."""
        started = time.monotonic()
        last = await self._retry_connect(started + self.config.connect_timeout, None)
        if last is None:
            return
        if isinstance(last, FINAL):
            raise last
        raise ConnectError(f"cannot reach the learner at {self.host}:{self.port}: tried for "
                           f"{time.monotonic() - started:.0f}s (Config.connect_timeout); last error: {last}") from last

    async def _reconnect(self, cause: RLinkError) -> None:
        """Retry the learner with backoff and jitter until ``reconnect_timeout``; then resume
        the stream where the learner says it stopped (resending what it lacks)."""
        self._teardown()
        last = await self._retry_connect(time.monotonic() + self.config.reconnect_timeout, cause)
        self.reconnecting = False
        if last is None:
            self.reconnects += 1
            log.info("actor %s reconnected (resuming at seq %d)", self.actor_id, self.next_send_seq)
            if self.subscription is not None and self.control is not None:
                self.control.send(self.subscription)
            with self.changed:
                self.changed.notify_all()
            with self.credit_cv:
                self.credit_cv.notify_all()
        elif not self.closing:
            if isinstance(last, FINAL):
                self._fail_for_good(last)
            else:
                self._fail_for_good(PeerLost(f"learner unreachable for {self.config.reconnect_timeout:.3g}s: {last}"))

    async def _retry_connect(self, deadline: float, cause: RLinkError | None) -> RLinkError | None:
        """Attempt ``connect`` until one succeeds (None), a final error, or ``deadline`` (the
        last error). With a ``cause`` (a reconnect) the first attempt waits a jittered moment too."""
        delay, last = 0.05, cause
        # An attempt made while the link is still down can be swallowed whole (a blackholed
        # route, a cut that TCP does not see), and would then hold the actor for the full
        # handshake timeout after the link is back. A healthy learner answers within a
        # heartbeat interval, so each attempt gets twice that (at least 1 s), doubling after
        # each failure up to twice the handshake timeout: a busy learner is still reached.
        cap = 2 * self.config.handshake_timeout
        attempt_timeout = min(cap, max(1.0, 2 * self.config.heartbeat_interval))
        waiting_logged = False
        while not self.closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if last is not None:
                # Jitter spreads the retries of many actors that lost (or wait for) one learner.
                await asyncio.sleep(min(left, delay * (0.5 + random.random())))
                # Nobody listening yet (refused: the kernel answers, the learner does no work)
                # is retried at least every 0.75 s, so an actor started first meets a learner
                # soon after it comes up; a busy or unanswering learner backs off to 3 s.
                delay = min(2 * delay, REFUSED_BACKOFF if _refused(last) else 2.0)
            try:
                left = max(0.1, deadline - time.monotonic())
                await self.connect(min(attempt_timeout, left), answered_timeout=min(cap, left))
                return None
            except FINAL as exc:
                return exc
            except (RLinkError, OSError) as exc:
                last = map_plane_error(exc)
                attempt_timeout = min(cap, 2 * attempt_timeout)
                self._teardown()
                if cause is None and not waiting_logged:
                    waiting_logged = True
                    log.warning("actor: waiting for the learner at %s:%s (%s); retrying for up to %.0fs",
                             self.host, self.port, exc, self.config.connect_timeout)
        return last

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

