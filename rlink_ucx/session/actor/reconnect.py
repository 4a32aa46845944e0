"""Actor side, failing and reconnecting: a broken connection is retried with backoff and
jitter, then the stream resumes where the learner says it stopped (schema again,
unacknowledged frames resent); an error no retry cures is recorded for every caller."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ...errors import AuthError, Closed, ConnectError, PeerLost, RLinkError, SchemaMismatch, Superseded
from ...transport.plane import map_plane_error
from .connect import ConnectionReplaced, Connector
from .outbox import Outbox
from .state import LinkState, Rejected

__all__ = ["FINAL", "REFUSED_BACKOFF", "Reconnect"]

log = logging.getLogger(__name__)
# Rejections no retry can cure: the token, the schema, a refused protocol version or data plane,
# a newer incarnation, or a learner that said it is finishing.
FINAL = (AuthError, Closed, Rejected, SchemaMismatch, Superseded)


REFUSED_BACKOFF = 0.5  # seconds (times 0.5-1.5 of jitter) between attempts nobody answers
# Seconds the control reader is given to read a Bye already sent when the data plane broke:
# the Bye went out before the data plane was closed, so it only waits for the loop to read it.
# A data plane that broke on its own (a UCX endpoint error) is retried this much later.
GOODBYE_GRACE = 0.5


def _refused(error: BaseException) -> bool:
    """Whether the connection was refused: nothing listens there (yet)."""
    while error is not None:
        if isinstance(error, ConnectionRefusedError):
            return True
        error = error.__cause__  # type: ignore[assignment]
    return False


class Reconnect:
    """What happens when the connection fails: a reconnect, or a final ``state.error``.

    It owns whether a reconnect is under way and how many succeeded (:attr:`count`).

    Args:
        state: the connection's shared state.
        connector: makes each connection attempt.
        outbox: its waiters are woken when the connection comes back or fails for good.
    """

    def __init__(self, state: LinkState, connector: Connector, outbox: Outbox):
        self._state = state
        self._connector = connector
        self._outbox = outbox
        self._reconnecting = False  # a reconnect is under way (loop thread)
        self._goodbye: Closed | None = None  # the learner's Bye, read after the data plane broke
        self._listening = False  # the reconnect waits for the old control reader (GOODBYE_GRACE)
        self.count = 0  # reconnects that succeeded (loop thread)

    def fail(self, exc: RLinkError, *, bye_may_follow: bool = False) -> None:
        """The connection broke (any task on the loop): reconnect if it was up and the error
        is one a reconnect can cure, else record ``exc`` for every caller. ``bye_may_follow``:
        it broke on the data plane, and the control connection may still carry a goodbye."""
        s = self._state
        if s.closing or s.error is not None:
            return
        if self._reconnecting:  # a reconnect attempt failed: let it notice at once
            if isinstance(exc, Closed):  # a Bye: the learner is finishing, no attempt can succeed
                self._goodbye = exc
            if self._listening:  # the old control connection's own end: the teardown follows
                return
            for fut in (s.ready, s.proposal):
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # retrieved here: the attempt sees it through await
            return
        if s.connected and s.config.reconnect_timeout > 0 and not isinstance(exc, (AuthError, SchemaMismatch, Closed)):
            s.connected = False
            self._reconnecting = True
            log.warning("actor %s: %s; reconnecting", s.actor_id, exc)
            s.tasks.append(s.loop.create_task(self._reconnect(exc, bye_may_follow)))
            return
        self._fail_for_good(exc)

    def _fail_for_good(self, exc: RLinkError) -> None:
        s = self._state
        s.connected = False
        s.error = exc
        (log.info if isinstance(exc, Closed) else log.warning)("actor %s: %s", s.actor_id, exc)
        for fut in (s.ready, s.proposal):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                # Marked as seen: the next call raises s.error, and a future nobody awaits any
                # more would print "Future exception was never retrieved" when collected.
                fut.exception()
        self._outbox.fail_waiters()  # the callers raise state.error

    async def open_session(self) -> None:
        """Connect for the first time, retrying with backoff and jitter until
        ``Config.connect_timeout``: an actor may start before its learner, or during a storm of
        others connecting. Only a real rejection (token, schema, protocol) fails at once."""
        s = self._state
        started = time.monotonic()
        last = await self._retry_connect(started + s.config.connect_timeout, None)
        if last is None:
            return
        if isinstance(last, FINAL):
            raise last
        raise ConnectError(f"cannot reach the learner at {s.host}:{s.port}: tried for "
                           f"{time.monotonic() - started:.0f}s (Config.connect_timeout); last error: {last}") from last

    async def _reconnect(self, cause: RLinkError, bye_may_follow: bool = False) -> None:
        """Retry the learner with backoff and jitter until ``reconnect_timeout``; then resume
        the stream where the learner says it stopped (resending what it lacks)."""
        s = self._state
        if bye_may_follow:
            await self._hear_goodbye()
        self._teardown()
        last = self._goodbye or await self._retry_connect(time.monotonic() + s.config.reconnect_timeout, cause)
        self._reconnecting, self._goodbye = False, None
        if last is None:
            self.count += 1
            log.info("actor %s reconnected (resuming at seq %d)", s.actor_id, self._outbox.next_send_seq)
            if s.subscription is not None and s.control is not None:
                s.control.send(s.subscription)
            self._outbox.wake_callers()
        elif not s.closing:
            if isinstance(last, FINAL):
                self._fail_for_good(last)
            else:
                self._fail_for_good(PeerLost(f"learner unreachable for {s.config.reconnect_timeout:.3g}s: {last}"))

    async def _hear_goodbye(self) -> None:
        """A learner that finishes sends Bye on the control connection, then closes the data
        plane: the actor may notice that first, with the Bye still unread. Give the control
        reader a moment to read it (it ends at once on a Bye or on the connection's end), so
        that a goodbye is not taken for a crash and retried for ``reconnect_timeout``."""
        reader = self._connector.reader_task
        if reader is not None and not reader.done():
            self._listening = True
            try:
                await asyncio.wait({reader}, timeout=GOODBYE_GRACE)
            finally:
                self._listening = False

    async def _retry_connect(self, deadline: float, cause: RLinkError | None) -> RLinkError | None:
        """Attempt ``connect`` until one succeeds (None), a final error, or ``deadline`` (the
        last error). With a ``cause`` (a reconnect) the first attempt waits a jittered moment too."""
        s = self._state
        delay, last = 0.05, cause
        # An attempt made while the link is still down can be swallowed whole (a blackholed
        # route, a cut that TCP does not see), and would then hold the actor for the full
        # handshake timeout after the link is back. A healthy learner answers within a
        # heartbeat interval, so each attempt gets twice that (at least 1 s), doubling after
        # each failure up to twice the handshake timeout: a busy learner is still reached.
        cap = 2 * s.config.handshake_timeout
        attempt_timeout = min(cap, max(1.0, 2 * s.config.heartbeat_interval))
        waiting_logged = False
        at_once = False  # the next attempt goes without a wait (to rank 0, after a rank did not answer)
        while not s.closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if last is not None and not at_once:
                # Jitter spreads the retries of many actors that lost (or wait for) one learner.
                await asyncio.sleep(min(left, delay * (0.5 + random.random())))
                # Nobody listening yet (refused: the kernel answers, the learner does no work)
                # is retried at least every 0.75 s, so an actor started first meets a learner
                # soon after it comes up; a busy or unanswering learner backs off to 3 s.
                delay = min(2 * delay, REFUSED_BACKOFF if _refused(last) else 2.0)
            at_once = False
            try:
                left = max(0.1, deadline - time.monotonic())
                await self._connector.connect(min(attempt_timeout, left), answered_timeout=min(cap, left))
                return None
            except (RLinkError, OSError) as exc:
                last = map_plane_error(exc)
                # Only rank 0 (the address the actor was given) refuses for good: what answers on a
                # rank's address may be a process that took the port of a rank that died, whose
                # refusal (a failed proof, no rlink) says nothing about the job. Rank 0 decides.
                if isinstance(exc, FINAL) and (s.host, s.port) == s.home:
                    return exc
                attempt_timeout = min(cap, 2 * attempt_timeout)
                self._teardown()
                if (s.host, s.port) != s.home:  # the rank it was sent to did not answer: rank 0 places it anew
                    log.info("actor %s: learner rank %d at %s:%s did not answer (%s); asking rank 0 at %s:%s",
                             s.actor_id, s.rank, s.host, s.port, exc, *s.home)  # fmt: skip
                    s.go_home()
                    # at once, unless the rank refused: rank 0 may place the actor there again
                    at_once, delay = not isinstance(exc, FINAL), 0.05
                if cause is None and not waiting_logged:
                    waiting_logged = True
                    log.warning("actor: waiting for the learner at %s:%s (%s); retrying for up to %.0fs",
                             s.host, s.port, exc, s.config.connect_timeout)
        return last

    def _teardown(self) -> None:
        """Drop the broken connection (not the frames: they are resent)."""
        s = self._state
        current = asyncio.current_task()
        for task in s.tasks:
            if task is not current:
                task.cancel()
        s.tasks = [t for t in s.tasks if t is current]
        if s.sender is not None:
            s.sender.close()
            s.sender = None
        if s.control is not None:
            s.control.close()
            s.control = None
        self._outbox.credit.clear()
        s.ready = s.loop.create_future()
        if s.proposal is not None and not s.proposal.done():
            s.proposal.set_exception(ConnectionReplaced())  # propose() asks the new connection
            s.proposal.exception()  # retrieved: a proposal nobody awaits any more stays quiet
        s.proposal = None
