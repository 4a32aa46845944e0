"""Actor side, connecting: open the control channel, prove the token both ways, say Hello,
have the data plane attached, and propose the schema (again after a reconnect)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from ..._version import __version__
from ...errors import AuthError, ConnectError, PeerLost, ProtocolError, SchemaMismatch, Superseded, refusal
from ...transport import hostname
from ...transport.address import is_loopback
from ...transport.control import ControlConnection
from ...transport.plane import actor_offers
from ...wire import auth as _auth
from ...wire import messages as _wire
from ...wire.codec import Schema
from .. import tokens
from .attach import PlaneAttach, cuda_visible
from .control import ControlReader
from .heartbeat import Heartbeat
from .outbox import Outbox
from .state import LinkState, Rejected

__all__ = ["ConnectionReplaced", "Connector", "Rejected", "open_channel"]

log = logging.getLogger(__name__)


async def open_channel(state: LinkState, accepted: Callable[[], None] | None = None,
                       ) -> tuple[ControlConnection, _wire.Challenge]:  # fmt: skip
    """Open a connection to the learner and read its Challenge (one attempt); ``accepted`` is
    called once the TCP connection is up.

    Raises:
        Rejected: the peer sent bytes that are no rlink message: another service listens there.
    """
    family = socket.AF_INET6 if ":" in state.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(state.config.handshake_timeout):  # one attempt; connect_timeout bounds all
            await state.loop.sock_connect(sock, (state.host, state.port))
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise ConnectError(f"cannot reach learner at {state.host}:{state.port}: {exc or 'timed out'}") from exc
    conn = ControlConnection(sock, state.loop, f"{state.host}:{state.port}")
    if accepted is not None:
        accepted()
    try:
        challenge = await conn.recv(state.config.max_preauth_bytes)
    except ProtocolError as exc:  # an rlink learner's first bytes are always its Challenge
        conn.close()
        raise Rejected(f"{state.host}:{state.port} is not an rlink learner: what it sent first is no rlink "
                       f"message ({exc}); check the address and port") from exc  # fmt: skip
    if not isinstance(challenge, _wire.Challenge):
        raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
    if challenge.proto != _wire.PROTOCOL_VERSION:
        raise Rejected(f"learner speaks protocol {challenge.proto}, actor {_wire.PROTOCOL_VERSION}")
    return conn, challenge


class Connector:
    """Everything from a closed socket to a session whose data plane is attached (one attempt:
    the reconnect part retries), and the schema proposals. Sets ``control``, ``welcome`` and
    ``connected`` in ``state``; ``attach`` sets the ``sender``. It owns the tokens.

    Args:
        state: the connection's shared state.
        attach: attaches the data plane the learner chose.
        reader: its task reads the control channel from the Welcome on.
        heartbeat: its task keeps the liveness once the session is up.
        outbox: holds the schema, requeues what the learner lacks, and its task sends the frames.
        token: the token to prove; None: the learner's generated token, looked up at each attempt.
        insecure: accept a learner that does not authenticate.
    """

    def __init__(self, state: LinkState, attach: PlaneAttach, reader: ControlReader, heartbeat: Heartbeat,
                 outbox: Outbox, *, token: bytes | None, insecure: bool):  # fmt: skip
        self._state = state
        self._attach = attach
        self._reader = reader
        self._heartbeat = heartbeat
        self._outbox = outbox
        self._token = token
        self._insecure = insecure
        self._token_for_ranks: bytes | None = None  # the generated token rank 0 took: the other ranks' too
        self._attempt: tuple[Any, float | None] = (None, None)  # the connect attempt's timeout scope
        self.reader_task: asyncio.Task[None] | None = None  # the control reader of the newest session
        self._accepted = False  # this attempt's TCP connection is up
        self._answered = False  # and the learner's Challenge came on it

    async def connect(self, timeout: float | None = None, answered_timeout: float | None = None) -> None:
        """One attempt: open the control channel, authenticate, attach the data plane, all
        within ``timeout`` (default: ``handshake_timeout``), or within ``answered_timeout``
        from the learner's first message where that is longer: a learner that answered is
        alive, only busy (a storm of actors connecting), and giving up on it would only add
        a retry to its load."""
        if timeout is None:
            timeout = self._state.config.handshake_timeout
        self._accepted = self._answered = False
        try:
            async with asyncio.timeout(timeout) as scope:
                self._attempt = (scope, answered_timeout)
                await self._connect()
        except TimeoutError as exc:
            where = f"{self._state.host}:{self._state.port}"
            if self._accepted and not self._answered:
                raise ConnectError(f"{where} accepted the connection but sent no rlink challenge within {timeout:g}s: "
                                   "is an rlink learner listening there, or another service (HTTP, SSH, ...)?") from exc
            raise ConnectError(f"handshake with {where} timed out") from exc
        except Superseded:
            raise
        except PeerLost as exc:
            raise ConnectError(f"learner at {self._state.host}:{self._state.port} closed the connection during setup: {exc}") from exc

    async def _connect(self) -> None:
        s = self._state
        conn, challenge = await open_channel(s, self._on_accepted)
        self._answered = True
        self._learner_answered()
        s.control = conn
        token, source = self._login_token(challenge.auth)
        s.proved_token = token  # the session's keys derive from it (None: the learner does not authenticate)
        nonce = _auth.new_nonce()
        mac = _auth.actor_proof(token, challenge.nonce, nonce) if token is not None else b""
        conn.send(_wire.Login(_wire.PROTOCOL_VERSION, nonce, mac))
        if token is not None:
            try:
                proof = await self._expect(conn, _wire.Proof)
                _auth.verify(_auth.learner_proof(token, challenge.nonce, nonce), proof.mac, "learner")
            except AuthError as exc:
                if source is None:
                    raise
                raise AuthError(f"{exc} (with the token in {source}: left by an earlier learner on this port? "
                                "pass token=... or set RLINK_TOKEN)") from exc  # fmt: skip
        conn.send(_wire.Hello(s.actor_id, s.incarnation, __version__, s.transport_wanted, cuda_visible(), hostname(),
                              os.getpid(), actor_offers()))  # fmt: skip
        welcome = await self._expect(conn, (_wire.Welcome, _wire.Redirect))
        if isinstance(welcome, _wire.Redirect):
            await self._follow(conn, welcome)
            return
        s.welcome = welcome
        s.latest_version = welcome.version
        s.actor_id = welcome.actor_id
        self.reader_task = s.loop.create_task(self._reader.run())
        s.tasks.append(self.reader_task)
        await self._attach.attach(welcome)
        await s.ready
        if self._outbox.schema is not None:  # a reconnect: the new session needs the schema again
            await self._renegotiate()
        self._outbox.requeue(welcome.resume_seq)
        s.tasks.append(s.loop.create_task(self._heartbeat.run()))
        s.tasks.append(s.loop.create_task(self._outbox.send_loop()))
        s.connected = True

    async def _follow(self, conn: ControlConnection, redirect: _wire.Redirect) -> None:
        """Rank 0 of a job of many learners sent this actor to another rank: connect there
        (same attempt, same timeout), as the actor id it was given, with the token it proved."""
        s = self._state
        conn.close()
        s.control = None
        if (s.host, s.port) != s.home or redirect.rank == 0:
            raise ProtocolError(f"learner at {s.host}:{s.port} sent this actor on to rank {redirect.rank} although "
                                "only rank 0 places actors")  # fmt: skip
        log.debug("actor %s: rank 0 sends it to rank %d at %s:%d", s.actor_id, redirect.rank, redirect.host, redirect.port)
        s.host, s.port, s.rank = redirect.host, redirect.port, redirect.rank
        s.actor_id = redirect.actor_id
        if self._token is None:
            self._token_for_ranks = s.proved_token  # the job's ranks share rank 0's token
        self._accepted = self._answered = False
        await self._connect()

    def _on_accepted(self) -> None:
        self._accepted = True

    def _learner_answered(self) -> None:
        scope, longer = self._attempt
        if scope is None or longer is None or scope.when() is None:
            return
        when = self._state.loop.time() + longer
        if when > scope.when():
            scope.reschedule(when)

    def _login_token(self, learner_auth: bool) -> tuple[bytes | None, str | None]:
        """The token to prove and, when it is the learner's generated one, the file it came
        from; (None, None) for a learner that does not authenticate (only with ``insecure``)."""
        where = f"{self._state.host}:{self._state.port}"
        if not learner_auth:
            if not self._insecure:
                raise AuthError(f"the learner at {where} does not authenticate (it runs with insecure=True), so "
                                "anyone could be listening there: refused; pass insecure=True to the actor to accept it")  # fmt: skip
            return None, None
        if self._token is not None:
            return self._token, None
        if self._state.rank != 0 and self._token_for_ranks is not None:
            return self._token_for_ranks, None
        if not is_loopback(self._state.host):  # the generated token never leaves the learner's host
            raise AuthError(f"the learner at {where} requires a token: pass token=... or set RLINK_TOKEN / "
                            "RLINK_TOKEN_FILE (make one with `rlink token`)")  # fmt: skip
        token, source = tokens.find(self._state.config, self._state.port)
        if token is None:
            raise AuthError(f"the learner at {where} requires a token and this actor has none ({source}): pass "
                            "token=..., set RLINK_TOKEN / RLINK_TOKEN_FILE, or give it the learner's Config.token_dir. "
                            "A learner's generated token is found by the port it listens on: through a port "
                            "forward or proxy, point RLINK_TOKEN_FILE at its file (learner.token_file)")  # fmt: skip
        return token, source

    async def _expect(self, conn: ControlConnection, kind: type | tuple[type, ...]) -> Any:
        msg = await conn.recv(self._state.config.max_control_bytes)
        if isinstance(msg, _wire.Error):
            # "auth", "superseded" and "refused" are final; "timeout" (the learner was too busy
            # to finish our handshake), "protocol" (a message garbled on the way) and unknown
            # kinds may be retried.
            raise refusal(msg.kind, f"learner refused: {msg.text}", otherwise=ConnectError)
        if not isinstance(msg, kind):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ProtocolError(f"expected {expected}, got {type(msg).__name__}")
        return msg

    # --- the schema ----------------------------------------------------------------------------
    async def propose(self, schema: Schema) -> _wire.Accept | _wire.Reject:
        """Propose the first schema. If the connection is replaced before the answer comes, the
        proposal is made again on the new one (the caller's timeout bounds the whole wait)."""
        s = self._state
        while True:
            while not s.connected and s.error is None:  # a reconnect is under way
                await asyncio.sleep(0.02)
            if s.error is not None:
                raise s.error
            try:
                return await self._propose_once(schema)
            except ConnectionReplaced:
                continue

    async def _renegotiate(self) -> None:
        schema = self._outbox.schema
        assert schema is not None
        reply = await self._propose_once(schema)
        if isinstance(reply, _wire.Reject):
            raise SchemaMismatch(f"after reconnecting, the learner rejected the schema: {reply.reason}")
        if reply.fields is not None:
            # This actor's frames are laid out in its schema already: a learner restarted with
            # another one (castable, set by another actor) cannot take them.
            theirs = Schema.from_wire(reply.fields)
            raise SchemaMismatch(f"after reconnecting, the learner's schema is {theirs.describe()}, "
                                 f"this actor's {schema.describe()}")
        self._outbox.renegotiated(reply.schema_id, reply.max_steps)

    async def _propose_once(self, schema: Schema) -> _wire.Accept | _wire.Reject:
        s = self._state
        assert s.control is not None
        s.proposal = s.loop.create_future()
        s.control.send(_wire.Propose(schema.to_wire()))
        return await s.proposal


class ConnectionReplaced(Exception):
    """The connection a proposal went out on was torn down before the answer came."""
