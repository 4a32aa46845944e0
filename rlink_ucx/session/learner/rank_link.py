"""A learner rank other than 0: its link to rank 0, which says where this rank listens, which
actors it serves and that it lives. Rank 0 sends actors here only while the link is up; the
link is made again (every second) after it breaks, so a rank 0 that comes back finds it."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from ...config import Config
from ...errors import AuthError, PeerLost, ProtocolError, RLinkError
from ...transport.control import ControlConnection
from ...wire import auth as _auth
from ...wire import messages as _wire

log = logging.getLogger(__name__)

RETRY = 1.0  # seconds between attempts to link to rank 0
REPORT_EVERY = 0.2  # seconds: the actor set is compared this often and sent when it changed


class RankLinkClient:
    """Keeps this rank linked to rank 0 (on this rank's I/O loop).

    Args:
        rank, world: this rank and the job's size.
        home: rank 0's ``(host, port)``.
        advertised: where actors reach this rank, ``(host, port)``.
        token: the job's token (None: a learner with ``insecure=True``).
        serving: the actor ids this rank serves now.
    """

    def __init__(self, rank: int, world: int, home: tuple[str, int], advertised: tuple[str, int],
                 token: bytes | None, config: Config, serving: Callable[[], set[int]]):  # fmt: skip
        self.rank, self.world = rank, world
        self.home, self.advertised = home, advertised
        self.token = token
        self.config = config
        self.serving = serving
        self.linked = asyncio.Event()  # set while the link is up
        self.links = 0  # links made (1 + the times it was made again)
        self.closing = False
        self._conn: ControlConnection | None = None

    async def run(self) -> None:
        """Link, serve the link until it breaks, and link again, until ``close``."""
        while not self.closing:
            try:
                conn = await self._link()
            except (OSError, TimeoutError, RLinkError) as exc:
                log.debug("rank %d: no link to rank 0 at %s:%d yet: %s", self.rank, *self.home, exc)
                await asyncio.sleep(RETRY)
                continue
            try:
                await self._serve(conn)
            except (OSError, TimeoutError, PeerLost, ProtocolError) as exc:
                if not self.closing:  # rank 0 closing first is the usual end of a job
                    (log.info if isinstance(exc, RankZeroLeft) else log.warning)(
                        "rank %d: the link to rank 0 ended (%s); linking again", self.rank, exc or "no heartbeat")
            finally:
                self.linked.clear()
                self._conn = None
                conn.close()

    async def _link(self) -> ControlConnection:
        host, port = self.home
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        conn = ControlConnection(sock, loop, f"{host}:{port}")
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                await loop.sock_connect(sock, (host, port))
                challenge = await conn.recv(self.config.max_preauth_bytes)
                if not isinstance(challenge, _wire.Challenge) or challenge.proto != _wire.PROTOCOL_VERSION:
                    raise ProtocolError(f"rank 0 at {host}:{port} is no rlink learner of this version")
                nonce = _auth.new_nonce()
                mac = b"" if self.token is None else _auth.actor_proof(self.token, challenge.nonce, nonce)
                conn.send(_wire.Login(_wire.PROTOCOL_VERSION, nonce, mac))
                if self.token is not None:
                    proof = await conn.recv(self.config.max_control_bytes)
                    if isinstance(proof, _wire.Error):
                        raise AuthError(f"rank 0 refused this rank: {proof.text}")
                    if not isinstance(proof, _wire.Proof):
                        raise ProtocolError(f"expected Proof, got {type(proof).__name__}")
                    _auth.verify(_auth.learner_proof(self.token, challenge.nonce, nonce), proof.mac, "rank 0")
                conn.send(_wire.RankHello(self.rank, self.world, *self.advertised))
                welcome = await conn.recv(self.config.max_control_bytes)
                if isinstance(welcome, _wire.Error):
                    raise ProtocolError(f"rank 0 refused this rank: {welcome.text}")
                if not isinstance(welcome, _wire.RankWelcome):
                    raise ProtocolError(f"expected RankWelcome, got {type(welcome).__name__}")
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.links += 1
        self.linked.set()
        log.info("rank %d linked to rank 0 at %s:%d", self.rank, host, port)
        return conn

    async def _serve(self, conn: ControlConnection) -> None:
        reader = asyncio.get_running_loop().create_task(self._read(conn))
        sent: set[int] | None = None
        since_beat = 0.0
        try:
            while not reader.done():
                now = set(self.serving())
                if now != sent:
                    conn.send(_wire.RankActors(sorted(now)))
                    sent = now
                    since_beat = 0.0
                elif since_beat >= self.config.heartbeat_interval:
                    conn.send(_wire.Heartbeat())
                    since_beat = 0.0
                await asyncio.wait([reader], timeout=REPORT_EVERY)
                since_beat += REPORT_EVERY
            await reader  # raises what ended the link
        finally:
            reader.cancel()

    async def _read(self, conn: ControlConnection) -> None:
        while True:
            async with asyncio.timeout(self.config.heartbeat_timeout):
                msg = await conn.recv(self.config.max_control_bytes)
            if isinstance(msg, _wire.Bye):
                raise RankZeroLeft(f"rank 0 said goodbye: {msg.reason}")
            if isinstance(msg, _wire.Error):
                raise ProtocolError(f"rank 0: {msg.text}")

    def close(self) -> None:
        """Say goodbye to rank 0 (its actors move to the other ranks) and stop linking."""
        self.closing = True
        if self._conn is not None:
            self._conn.send(_wire.Bye(f"rank {self.rank} closing"))
            self._conn.close()


class RankZeroLeft(PeerLost):
    """Rank 0 closed (said goodbye)."""
