"""Actor side, the control reader: credit, acknowledgements, revokes, weights announcements
and heartbeats from the learner, and what happens when the connection fails."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from ...errors import AuthError, Closed, PeerLost, ProtocolError, RLinkError, SchemaMismatch
from ...transport import shm
from ...transport.plane import attach_proven, map_plane_error
from ...wire import keys as _keys
from ...wire import messages as _wire
from .frames import BorrowedFrame

log = logging.getLogger(__name__)
# Weights messages go to the subscriber (StoreReply too: its rendezvous waits for it).
_WEIGHTS = (_wire.Version, _wire.Publish, _wire.Mapped, _wire.Group, _wire.Sealed, _wire.WeightsKey, _wire.Seal,
            _wire.StoreReply)
# Without a learner's heartbeat to answer, the actor says it is alive after this many heartbeat
# intervals of silence: the learner's heartbeats (one interval apart) come first, and answering
# them keeps an idle actor's wake-ups at one per learner heartbeat, not two.
OWN_HEARTBEAT_AFTER = 1.5
# A heartbeat timer this much later than due (in heartbeat intervals) means our own pause.
PAUSED_AFTER = 0.25
SLACK = 0.001  # timers are armed this long after their moment, so the check at it holds


class ControlReader:
    """Part of :class:`ActorConnection`: reads the learner's control messages on the I/O loop,
    keeps the learner's liveness, and turns a failure into a reconnect or a final ``error``."""

    _attach_proof: bytes | None = None  # the learner's AttachProof, checked when Ready comes
    _heartbeat_wake: asyncio.Future[None] | None = None  # what the heartbeat task waits on
    _heartbeat_timer: asyncio.TimerHandle | None = None  # resolves it when something is due
    _heartbeat_at = 0.0  # when that timer is due
    _weights_key: tuple[bytes, bytes] | None = None  # (the session's ticket, its weights key)

    async def _read_control(self) -> None:
        assert self.control is not None
        try:
            while True:
                msg = await self.control.recv(self.config.max_control_bytes)
                self.last_heard = time.monotonic()
                if isinstance(msg, _wire.Credit):
                    with self.credit_cv:
                        self.credit += msg.steps
                        self.credit_cv.notify_all()
                    self._credit_event.set()
                    if msg.acked > self.acked:
                        self._acknowledged(msg.acked)
                elif isinstance(msg, _wire.Ack):
                    self._acknowledged(msg.next_seq)
                elif isinstance(msg, _wire.Revoke):
                    with self.credit_cv:
                        give = max(0, min(self.credit, msg.steps))
                        self.credit -= give
                    self.control.send(_wire.Returned(give))
                elif isinstance(msg, _wire.Heartbeat):
                    self._answer_heartbeat()
                elif isinstance(msg, _WEIGHTS):
                    self._on_weights(msg)
                elif isinstance(msg, _wire.AttachProof):
                    self._attach_proof = msg.mac
                elif isinstance(msg, _wire.Ready):
                    self._check_attach(msg)
                    if isinstance(self.sender, shm.ShmSender):
                        if not msg.arena:
                            self.sender.arena = None  # the learner could not map it: use the ring
                        self.sender.direct = msg.cma
                    if not self._ready.done():
                        self._ready.set_result(msg.transport)
                elif isinstance(msg, (_wire.Accept, _wire.Reject)):
                    if self._proposal is not None and not self._proposal.done():
                        self._proposal.set_result(msg)
                elif isinstance(msg, _wire.Error):
                    kind = AuthError if msg.kind == "auth" else ProtocolError
                    raise kind(f"learner reported: {msg.text}")
                elif isinstance(msg, _wire.Bye):  # the learner is finishing: final, no reconnect
                    raise Closed(f"the learner closed the session ({msg.reason})")
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from the learner")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self.fail(map_plane_error(exc, "control connection broke"))

    def _acknowledged(self, seq: int) -> None:
        """The learner holds every step below ``seq``: frames entirely below it are done."""
        with self.changed:
            self.acked = max(self.acked, seq)
            while self.inflight and self.inflight[0].seq + self.inflight[0].n <= self.acked:
                frame = self.inflight.popleft()
                if frame.pooled:
                    self.free.append(frame)
            self.changed.notify_all()

    def weights_key(self) -> bytes:
        """This session's weights key (``wire.keys.session_key``), from the token; for a learner
        that does not authenticate, from the ticket alone (which protects nothing)."""
        welcome = self.welcome
        if welcome is None:
            raise PeerLost("no session with the learner")
        cached = self._weights_key
        if cached is not None and cached[0] == welcome.ticket:  # a restarted learner reuses session ids
            return cached[1]
        key = _keys.session_key(self.proved_token, welcome.ticket, welcome.session)
        self._weights_key = (welcome.ticket, key)
        return key

    def _check_attach(self, ready: _wire.Ready) -> None:
        """A plane with a data connection is used only once the learner proved, with the
        session's key, that it attached it: something without the token that took the data
        connection cannot make the actor stream to it. (A plane without one, such as ucx, is
        attached with the Welcome.)"""
        proof, self._attach_proof = self._attach_proof, None
        if not attach_proven(ready.transport) or self.proved_token is None or self.welcome is None:
            return
        expected = _keys.attach_proof(self.weights_key(), self.welcome.session, ready.transport)
        if proof is None or not hmac.compare_digest(expected, proof):
            raise AuthError("the learner did not prove it attached this session's data connection")

    def _on_weights(self, msg: Any) -> None:
        if isinstance(msg, _wire.Version):
            self.latest_version = max(self.latest_version, msg.version)
        elif isinstance(msg, (_wire.Publish, _wire.Mapped)):
            self.latest_version = max(self.latest_version, msg.manifest.version)
        if self.weights_listener is not None:
            self.weights_listener(msg)
        elif not isinstance(msg, _wire.Version):
            raise ProtocolError(f"{type(msg).__name__} for an actor that did not subscribe to weights")

    def _said_alive(self) -> float:
        """When we last said something to the learner: a control message or a frame."""
        assert self.control is not None
        return max(self.control.last_send, self.frame_sent_at)

    def _answer_heartbeat(self) -> None:
        """The learner's heartbeat (it was silent for an interval): answer it unless we spoke
        lately, and push our own heartbeat timer back, so it does not wake us as well."""
        if self.control is None:
            return
        if time.monotonic() - self._said_alive() >= self.config.heartbeat_interval / 2:
            self.control.send(_wire.Heartbeat())
        self._arm_heartbeat()

    def _heartbeat_due(self) -> float:
        """The next moment the heartbeat has work: our silence is long enough to speak, or the
        learner's long enough to give up on it (monotonic time, as the loop's)."""
        c = self.config
        speak = self._said_alive() + OWN_HEARTBEAT_AFTER * c.heartbeat_interval
        return min(speak, self.last_heard + c.heartbeat_timeout)

    def _arm_heartbeat(self) -> None:
        """(Re)schedule the heartbeat's one timer (loop thread): nothing else wakes an idle actor."""
        wake = self._heartbeat_wake
        if wake is None or wake.done():
            return
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
        self._heartbeat_at = max(self._heartbeat_due(), time.monotonic()) + SLACK
        self._heartbeat_timer = self.loop.call_at(self._heartbeat_at, _wake_up, wake)

    async def _heartbeat(self) -> None:
        """Keep the liveness both ways, from one timer armed for the next moment something is
        due (not a periodic tick): say we are alive after a silence (frames and control
        messages say it already; the learner's heartbeats are answered as they come), and give
        the learner up after ``heartbeat_timeout`` without a message from it."""
        assert self.control is not None
        c = self.config
        wake = None
        try:
            while True:
                self._heartbeat_wake = wake = self.loop.create_future()
                self._arm_heartbeat()
                await wake
                now = time.monotonic()
                # A timer that fires late means this process was paused (SIGSTOP, a VM stall) or
                # its loop blocked: what the learner sent meanwhile is still unread, so our own
                # pause is not the learner's silence. (Only a real pause: the timer is armed for
                # the very moment the learner would be given up, and crediting every small
                # lateness would push that moment on, again and again.)
                late = now - self._heartbeat_at
                if late > PAUSED_AFTER * c.heartbeat_interval:
                    self.last_heard = min(now, self.last_heard + late)
                if now - self.last_heard >= c.heartbeat_timeout:
                    self.fail(PeerLost(f"no message from the learner for {c.heartbeat_timeout:.3g}s"))
                    return
                if now - self._said_alive() >= OWN_HEARTBEAT_AFTER * c.heartbeat_interval:
                    self.control.send(_wire.Heartbeat())
        finally:
            if wake is not None and self._heartbeat_wake is wake:  # not a newer connection's
                if self._heartbeat_timer is not None:
                    self._heartbeat_timer.cancel()
                self._heartbeat_timer = self._heartbeat_wake = None

    def fail(self, exc: RLinkError) -> None:
        """The connection broke (any task on the loop): reconnect if it was up and the error
        is one a reconnect can cure, else record ``exc`` for every caller."""
        if self.closing or self.error is not None:
            return
        if self.reconnecting:  # a reconnect attempt failed: let it notice at once
            for fut in (self._ready, self._proposal):
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # retrieved here: the attempt sees it through await
            return
        if self.connected and self.config.reconnect_timeout > 0 and not isinstance(exc, (AuthError, SchemaMismatch, Closed)):
            self.connected = False
            self.reconnecting = True
            log.warning("actor %s: %s; reconnecting", self.actor_id, exc)
            self._tasks.append(self.loop.create_task(self._reconnect(exc)))
            return
        self._fail_for_good(exc)

    def _fail_for_good(self, exc: RLinkError) -> None:
        self.connected = False
        self.error = exc
        (log.info if isinstance(exc, Closed) else log.warning)("actor %s: %s", self.actor_id, exc)
        for frame in self.queue:
            if isinstance(frame, BorrowedFrame) and frame.done is not None:
                frame.done.set()  # the caller raises self.error
        for fut in (self._ready, self._proposal):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        with self.changed:
            self.changed.notify_all()
        with self.credit_cv:
            self.credit_cv.notify_all()
        self._wake.set()
        self._credit_event.set()


def _wake_up(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)
