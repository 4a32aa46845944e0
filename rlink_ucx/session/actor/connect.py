"""Actor side, connecting: open the control channel, prove the token both ways, say Hello,
and attach the data plane the learner chose (tcp, the shm ring and arena, or ucx)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import sys
from typing import Any

import msgspec

from ..._memory import Reserve
from ..._version import __version__
from ...errors import AuthError, ConnectError, PeerLost, ProtocolError, Superseded
from ...transport import cma, hostname, shm, ucx_available, ucx_failed
from ...transport.address import is_loopback
from ...transport.control import ControlConnection
from ...transport.tcp import TcpSender
from ...wire import auth as _auth
from ...wire import messages as _wire
from .. import tokens

log = logging.getLogger(__name__)


class Rejected(ConnectError):
    """The session was refused for a reason no retry cures (no common data plane, a requested
    plane that cannot work here): raised at once, not retried until ``connect_timeout``."""


class Handshake:
    """Part of :class:`ActorConnection`: everything from a closed socket to a session whose data
    plane is attached. Sets ``control``, ``welcome``, ``sender``, ``arena`` and ``connected``."""

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
        if welcome.transport in ("tcp", "shm"):
            await self._attach_tcp(welcome)
        else:
            from ...transport.ucx_actor import UcxActorPlane
            from ...transport.ucx_setup import UcxUnavailable

            try:
                self.sender = await UcxActorPlane.connect(self.loop, welcome, self.weights_key(), self.incarnation,
                                                          self.config, loopback=is_loopback(self.host),
                                                          control=conn.sock)  # fmt: skip
            except UcxUnavailable as exc:
                ucx_failed(str(exc))  # from now on this process offers the other planes only
                why = f"the learner chose the ucx data plane, but on this actor {exc}"
                if self.transport_wanted == "ucx":
                    raise Rejected(why) from exc
                log.error("%s; reconnecting without ucx", why)
                raise ConnectError(why) from exc  # retried: the next Hello offers no ucx
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

    async def _attach_tcp(self, welcome: _wire.Welcome) -> None:
        """Open the data connection: the tcp plane, or the doorbell of the shm plane."""
        ring = self._map_shm_ring(welcome) if welcome.transport == "shm" else None
        if ring is not None and self.arena is None and self.resend:
            self.arena = self._new_arena()
        arena = self.arena.describe() if ring is not None and self.arena is not None else None
        if ring is not None and self._probe is None and self.config.shm_direct_read and cma.available():
            self._probe = cma.Probe()  # lives as long as the connection: the learner reads it at each attach
        probe = self._probe.describe() if ring is not None and self._probe is not None else None
        data, challenge = await self._open_data_connection()
        data.send(_wire.Attach(_wire.PROTOCOL_VERSION, welcome.session,
                               _auth.data_proof(self.weights_key(), challenge.nonce, welcome.session),
                               ring is not None, arena, probe))  # fmt: skip
        # A send that makes no progress for a heartbeat timeout means a frozen or vanished
        # learner; the blocking send holds the I/O thread, so the heartbeat could not tell.
        timeout = min(self.config.frame_timeout, self.config.heartbeat_timeout)
        if ring is not None:
            # The arena goes with the Attach; the learner's Ready says whether it mapped it.
            self.sender = shm.ShmSender(data.sock, ring, timeout, self.arena)
        else:
            self.sender = TcpSender(data.sock, self.loop, timeout, self.config.tcp_congestion)

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

    def _frame_memory_bytes(self) -> int:
        """Room for every frame buffer the actor may hold: those kept for resending, those
        being filled, and a few spare (beyond it, frame buffers are plain memory, and on the
        shm plane their frames go through the ring)."""
        c = self.config
        return c.resend_buffer_bytes + (c.frame_buffers + 4) * c.frame_bytes

    def _new_arena(self) -> shm.Arena | None:
        try:
            return shm.Arena(self._frame_memory_bytes(), ahead=2 * self.config.frame_bytes)
        except OSError as exc:
            log.info("no shared frame buffers (%s): frames go through the ring", exc)
            return None

    def release_arena(self) -> None:
        """After close: drop the frame buffers and unmap the arena (any thread)."""
        if self._frame_reserve is not None:
            self._frame_reserve.close()
        arena, self.arena = self.arena, None
        if arena is not None:
            with self.changed:
                self.free.clear()
                self.inflight.clear()
                self.queue.clear()
            self._tasks.clear()  # a stopped task's frame may still hold the frame it was sending
            arena.close()

    def frame_memory(self, nbytes: int) -> Any:
        """Memory for a new frame buffer: from the arena, else from a populated reserve, while
        they have room; else None (plain memory)."""
        if self.arena is not None:
            return self.arena.block(nbytes)
        if self._frame_reserve is None:
            self._frame_reserve = Reserve(self._frame_memory_bytes(), "frames", ahead=2 * self.config.frame_bytes)
        return self._frame_reserve.take(nbytes)

    def _map_shm_ring(self, welcome: _wire.Welcome) -> shm.ShmRing | None:
        """Map the learner's ring; None (tcp on the data connection instead) where it cannot be
        reached from here, e.g. another PID namespace or user, unless shm was requested."""
        try:
            pid, fd, nonce, size = welcome.shm or [0, 0, b"", 0]
            return shm.ShmRing.open(int(pid), int(fd), bytes(nonce), int(size))
        except (OSError, ValueError, TypeError) as exc:
            if self.transport_wanted == "shm":
                raise Rejected(f"shm requested but the learner's ring cannot be mapped here: {exc}") from exc
            reason = f"auto: the learner's shared-memory ring cannot be mapped here ({exc}); tcp instead"
            log.info(reason)
            self.welcome = msgspec.structs.replace(welcome, transport="tcp", reason=reason)
            return None


def _cuda_visible() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())

