"""Actor side, the control reader: credit, acknowledgements, revokes, weights announcements
and heartbeats from the learner, and what happens when the connection fails."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from ..errors import AuthError, Closed, PeerLost, ProtocolError, RLinkError, SchemaMismatch
from ..transport import shm
from ..transport.loop import ticks
from ..wire import keys as _keys
from ..wire import messages as _wire
from .actor_frames import BorrowedFrame

log = logging.getLogger(__name__)
# Weights messages go to the subscriber (StoreReply too: its rendezvous waits for it).
_WEIGHTS = (_wire.Version, _wire.Publish, _wire.Group, _wire.Sealed, _wire.WeightsKey, _wire.Seal, _wire.StoreReply)


class ControlReader:
    """Part of :class:`ActorConnection`: reads the learner's control messages on the I/O loop,
    keeps the learner's liveness, and turns a failure into a reconnect or a final ``error``."""

    _attach_proof: bytes | None = None  # the learner's AttachProof, checked when Ready comes
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
                    pass
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
            self.fail(exc if isinstance(exc, RLinkError) else PeerLost(f"control connection broke: {exc}"))

    def _acknowledged(self, seq: int) -> None:
        """The learner holds every step below ``seq``: frames entirely below it are done."""
        with self.changed:
            self.acked = max(self.acked, seq)
            while self.inflight and self.inflight[0].seq + self.inflight[0].n <= self.acked:
                frame = self.inflight.popleft()
                if frame.pooled:
                    self.free.append(frame)
            self.changed.notify_all()

    def _session_token(self) -> bytes | None:
        """The token this session's handshake proved: the given one, else the learner's
        generated one (looked up as the handshake did); None for a learner that does not
        authenticate (accepted only with ``insecure=True``)."""
        if self.token is not None:
            return self.token
        try:
            return self._login_token(True)[0]
        except AuthError:
            return None

    def weights_key(self) -> bytes:
        """This session's weights key (``wire.keys.session_key``), from the token; for a learner
        that does not authenticate, from the ticket alone (which protects nothing)."""
        welcome = self.welcome
        if welcome is None:
            raise PeerLost("no session with the learner")
        cached = self._weights_key
        if cached is not None and cached[0] == welcome.ticket:  # a restarted learner reuses session ids
            return cached[1]
        key = _keys.session_key(self._session_token(), welcome.ticket, welcome.session)
        self._weights_key = (welcome.ticket, key)
        return key

    def _check_attach(self, ready: _wire.Ready) -> None:
        """A tcp or shm data plane is used only once the learner proved, with the session's
        key, that it attached it: something without the token that took the data connection
        cannot make the actor stream to it. (A ucx plane's Ready comes with the Welcome.)"""
        proof, self._attach_proof = self._attach_proof, None
        if ready.transport not in ("tcp", "shm") or self._session_token() is None or self.welcome is None:
            return
        expected = _keys.attach_proof(self.weights_key(), self.welcome.session, ready.transport)
        if proof is None or not hmac.compare_digest(expected, proof):
            raise AuthError("the learner did not prove it attached this session's data connection")

    def _on_weights(self, msg: Any) -> None:
        if isinstance(msg, _wire.Version):
            self.latest_version = max(self.latest_version, msg.version)
        elif isinstance(msg, _wire.Publish):
            self.latest_version = max(self.latest_version, msg.manifest.version)
        if self.weights_listener is not None:
            self.weights_listener(msg)
        elif not isinstance(msg, _wire.Version):
            raise ProtocolError(f"{type(msg).__name__} for an actor that did not subscribe to weights")

    async def _heartbeat(self) -> None:
        """Check the learner's liveness every interval; say we are alive only after a silence
        (frames and control messages say it already)."""
        assert self.control is not None
        interval = self.config.heartbeat_interval
        frames = self.sent_frames
        async for late in ticks(interval):
            now = time.monotonic()
            self.last_heard = min(now, self.last_heard + late)  # our own pause is not the learner's
            if now - self.last_heard > self.config.heartbeat_timeout:
                self.fail(PeerLost(f"no message from the learner for {self.config.heartbeat_timeout:.3g}s"))
                return
            if self.sent_frames == frames and now - self.control.last_send >= interval:
                self.control.send(_wire.Heartbeat())
            frames = self.sent_frames

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

