"""Actor side, connecting: open the control channel, prove the token both ways, say Hello,
and attach the data plane the learner chose (``transport/plane.py``)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import sys
from typing import Any

from ..._version import __version__
from ...errors import AuthError, ConfigError, ConnectError, PeerLost, ProtocolError, Superseded
from ...transport import hostname, shm, ucx_available
from ...transport.address import is_loopback
from ...transport.control import ControlConnection
from ...transport.plane import ActorSide, Rejected, get_plane
from ...wire import auth as _auth
from ...wire import messages as _wire
from .. import tokens

log = logging.getLogger(__name__)


__all__ = ["Handshake", "Rejected"]


class Handshake:
    """Part of :class:`ActorConnection`: everything from a closed socket to a session whose data
    plane is attached. Sets ``control``, ``welcome``, ``sender`` and ``connected``."""

    async def _open(self) -> tuple[ControlConnection, _wire.Challenge]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.config.handshake_timeout):  # one attempt; connect_timeout bounds all
                await self.loop.sock_connect(sock, (self.host, self.port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise ConnectError(f"cannot reach learner at {self.host}:{self.port}: {exc or 'timed out'}") from exc
        conn = ControlConnection(sock, self.loop, f"{self.host}:{self.port}")
        challenge = await conn.recv(self.config.max_preauth_bytes)
        if not isinstance(challenge, _wire.Challenge):
            raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
        if challenge.proto != _wire.PROTOCOL_VERSION:
            raise Rejected(f"learner speaks protocol {challenge.proto}, actor {_wire.PROTOCOL_VERSION}")
        return conn, challenge

    async def connect(self, timeout: float | None = None, answered_timeout: float | None = None) -> None:
        """One attempt: open the control channel, authenticate, attach the data plane, all
        within ``timeout`` (default: ``handshake_timeout``), or within ``answered_timeout``
        from the learner's first message where that is longer: a learner that answered is
        alive, only busy (a storm of actors connecting), and giving up on it would only add
        a retry to its load."""
        if timeout is None:
            timeout = self.config.handshake_timeout
        try:
            async with asyncio.timeout(timeout) as scope:
                self._attempt = (scope, answered_timeout)
                await self._connect()
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise ConnectError(f"handshake with {self.host}:{self.port} timed out") from exc
        except Superseded:
            raise
        except PeerLost as exc:
            raise ConnectError(f"learner at {self.host}:{self.port} closed the connection during setup: {exc}") from exc

    async def _connect(self) -> None:
        conn, challenge = await self._open()
        self._learner_answered()
        self.control = conn
        token, source = self._login_token(challenge.auth)
        self.proved_token = token  # the session's keys derive from it (None: the learner does not authenticate)
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
        conn.send(_wire.Hello(self.actor_id, self.incarnation, __version__, self.transport_wanted, ucx_available(),
                              _cuda_visible(), hostname(), os.getpid(), shm.available()))  # fmt: skip
        welcome = await self._expect(conn, _wire.Welcome)
        self.welcome = welcome
        self.latest_version = welcome.version
        self.actor_id = welcome.actor_id
        self._tasks.append(self.loop.create_task(self._read_control()))
        await self._attach_plane(welcome, conn)
        await self._ready
        if self.schema is not None:  # a reconnect: the new session needs the schema again
            await self._renegotiate()
        self._requeue(welcome.resume_seq)
        self._tasks.append(self.loop.create_task(self._heartbeat()))
        self._tasks.append(self.loop.create_task(self._send_loop()))
        self.connected = True

    def _learner_answered(self) -> None:
        scope, longer = self._attempt
        if scope is None or longer is None or scope.when() is None:
            return
        when = self.loop.time() + longer
        if when > scope.when():
            scope.reschedule(when)

    def _login_token(self, learner_auth: bool) -> tuple[bytes | None, str | None]:
        """The token to prove and, when it is the learner's generated one, the file it came
        from; (None, None) for a learner that does not authenticate (only with ``insecure``)."""
        where = f"{self.host}:{self.port}"
        if not learner_auth:
            if not self.insecure:
                raise AuthError(f"the learner at {where} does not authenticate (it runs with insecure=True), so "
                                "anyone could be listening there: refused; pass insecure=True to the actor to accept it")  # fmt: skip
            return None, None
        if self.token is not None:
            return self.token, None
        if not is_loopback(self.host):  # the generated token never leaves the learner's host
            raise AuthError(f"the learner at {where} requires a token: pass token=... or set RLINK_TOKEN / "
                            "RLINK_TOKEN_FILE (make one with `rlink token`)")  # fmt: skip
        token, source = tokens.find(self.config, self.port)
        if token is None:
            raise AuthError(f"the learner at {where} requires a token and this actor has none ({source}): pass "
                            "token=..., set RLINK_TOKEN / RLINK_TOKEN_FILE, or give it the learner's Config.token_dir")  # fmt: skip
        return token, source

    async def _expect(self, conn: ControlConnection, kind: type) -> Any:
        msg = await conn.recv(self.config.max_control_bytes)
        if isinstance(msg, _wire.Error):
            # "auth", "superseded" and "refused" are final; "timeout" (the learner was too busy
            # to finish our handshake), "protocol" (a message garbled on the way) and unknown
            # kinds may be retried.
            kind = {"auth": AuthError, "superseded": Superseded, "refused": Rejected}.get(msg.kind, ConnectError)
            raise kind(f"learner refused: {msg.text}")
        if not isinstance(msg, kind):
            raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
        return msg

    async def _attach_plane(self, welcome: _wire.Welcome, conn: ControlConnection) -> None:
        """Attach the data plane the learner chose; its sender carries the frames."""
        try:
            plane = get_plane(welcome.transport)
        except ConfigError as exc:
            raise ProtocolError(f"the learner chose an unknown data plane {welcome.transport!r}") from exc
        attached = await plane.connect(ActorSide(welcome, self.config, self.loop, self.transport_wanted,
                                                 is_loopback(self.host), conn.sock, self.weights_key(),
                                                 self.incarnation, self.memory, self._open_data_connection))  # fmt: skip
        self.welcome = attached.welcome
        self.sender = attached.sender

    async def _open_data_connection(self) -> tuple[ControlConnection, _wire.Challenge]:
        """Open the data connection. In a storm of actors the learner may turn it away at its
        cap of connections not yet authenticated, although this actor's session is already
        set up: retry it alone (within the attempt's timeout) rather than the whole session."""
        delay = 0.02
        while True:
            try:
                return await self._open()
            except (ConnectError, PeerLost):
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, 0.5)

    def release_arena(self) -> None:
        """After close: drop the frame buffers and unmap the arena (any thread)."""
        arena = self.memory.release()
        if arena is not None:
            with self.changed:
                self.free.clear()
                self.inflight.clear()
                self.queue.clear()
            self._tasks.clear()  # a stopped task's frame may still hold the frame it was sending
            arena.close()

    def frame_memory(self, nbytes: int) -> Any:
        """Memory for a new frame buffer (``transport/frame_memory.py``), or None (plain memory)."""
        return self.memory.take(nbytes)


def _cuda_visible() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())

