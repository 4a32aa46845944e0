"""A learner rank other than 0: its link to rank 0, which says where this rank listens, which
actors it serves and that it lives. Rank 0 sends actors here only while the link is up; the
link is made again after it breaks (with backoff and jitter), so a rank 0 that comes back
finds it.

Both ends prove the job's rank token (``wire.auth.rank_proof`` / ``rank_0_proof``): actors do
not hold it, so an actor cannot register as a rank, and a process that took rank 0's port
cannot pass for rank 0."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import Callable

from ....config import Config
from ....errors import ConfigError, PeerLost, ProtocolError, RLinkError, refusal
from ....transport.control import ControlConnection
from ....wire import auth as _auth
from ....wire import messages as _wire
from .placement import RankRefused

log = logging.getLogger(__name__)

RETRY_FIRST = 0.1  # seconds before linking again, doubled after each failure (times 0.5-1.5 of jitter)
RETRY_MAX = 5.0  # at most this long between attempts
STEADY = 10.0  # a link that stayed up this long was healthy: the next one is tried at once again
REPORT_EVERY = 0.2  # seconds: the actor set is compared this often and sent when it changed


class RankLinkClient:
    """Keeps this rank linked to rank 0 (on this rank's I/O loop).

    Args:
        rank, world: this rank and the job's size.
        home: rank 0's ``(host, port)``.
        advertised: where actors reach this rank, ``(host, port)``.
        tokens: the actors' token (None: a learner with ``insecure=True``) and the job's rank token.
        serving: the actor ids this rank serves now.
    """

    def __init__(self, rank: int, world: int, home: tuple[str, int], advertised: tuple[str, int],
                 tokens: tuple[bytes | None, bytes], config: Config, serving: Callable[[], set[int]]):  # fmt: skip
        self.rank, self.world = rank, world
        self.home, self.advertised = home, advertised
        self.token, self.rank_token = tokens
        self.config = config
        self.serving = serving
        self.linked = asyncio.Event()  # set while the link is up
        self.links = 0  # links made (1 + the times it was made again)
        self.attempts = 0  # links tried
        self.closing = False
        self.refused: str | None = None  # why rank 0 would not start the job with this rank
        self.last_error = ""
        self._decided = asyncio.Event()  # welcomed once, or refused
        self._conn: ControlConnection | None = None

    async def started(self, timeout: float) -> None:
        """Wait until rank 0 welcomed this rank (every rank of the job linked).

        Raises:
            ConfigError: rank 0 refused this rank or did not start, or no welcome within ``timeout``.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._decided.wait()
        except TimeoutError:
            raise ConfigError(f"learner rank {self.rank} could not link to rank 0 at {self.home[0]}:{self.home[1]} "
                              f"within {timeout:g}s: {self.last_error or 'no answer'}") from None  # fmt: skip
        if self.refused is not None:
            raise ConfigError(self.refused)

    async def run(self) -> None:
        """Link, serve the link until it breaks, and link again after a backoff, until ``close``."""
        delay = RETRY_FIRST
        loop = asyncio.get_running_loop()
        while not self.closing:
            began = loop.time()
            try:
                conn = await self._link()
            except RankRefused as exc:
                if not self._decided.is_set():  # before the job started: this rank's start fails
                    self.refused = str(exc)
                    self._decided.set()
                    return
                self.last_error = str(exc)
            except (OSError, TimeoutError, RLinkError) as exc:
                self.last_error = str(exc) or type(exc).__name__
                log.debug("rank %d: no link to rank 0 at %s:%d yet: %s", self.rank, *self.home, self.last_error)
            else:
                await self._keep(conn)
            if self.closing:
                return
            delay = RETRY_FIRST if loop.time() - began >= STEADY else delay
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(2 * delay, RETRY_MAX)

    async def _keep(self, conn: ControlConnection) -> None:
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
        self.attempts += 1
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                await loop.sock_connect(sock, (host, port))
                challenge = await conn.recv(self.config.max_preauth_bytes)
                if not isinstance(challenge, _wire.Challenge) or challenge.proto != _wire.PROTOCOL_VERSION:
                    raise ProtocolError(f"rank 0 at {host}:{port} is no rlink learner of this version")
                nonce = _auth.new_nonce()
                conn.send(_wire.Login(_wire.PROTOCOL_VERSION, nonce, _auth.rank_proof(self.rank_token, challenge.nonce, nonce)))
                proof = await conn.recv(self.config.max_control_bytes)
                _refusal(proof)
                if not isinstance(proof, _wire.Proof):
                    raise ProtocolError(f"expected Proof, got {type(proof).__name__}")
                _auth.verify(_auth.rank_0_proof(self.rank_token, challenge.nonce, nonce), proof.mac,
                             f"rank 0 at {host}:{port} (the job's rank token)")  # fmt: skip
                conn.send(_wire.RankHello(self.rank, self.world, *self.advertised,
                                          _auth.rank_actor_token_proof(self.token, challenge.nonce, nonce)))  # fmt: skip
            await self._welcome(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.links += 1
        self.linked.set()
        self._decided.set()
        log.info("rank %d linked to rank 0 at %s:%d", self.rank, host, port)
        return conn

    async def _welcome(self, conn: ControlConnection) -> None:
        """Rank 0 welcomes a rank once every rank of the job linked: wait for it as long as the
        job's start may take (rank 0's heartbeats meanwhile are not for a welcomed rank)."""
        async with asyncio.timeout(self.config.connect_timeout):
            while True:
                welcome = await conn.recv(self.config.max_control_bytes)
                _refusal(welcome)
                if isinstance(welcome, _wire.RankWelcome):
                    return
                if not isinstance(welcome, _wire.Heartbeat):
                    raise ProtocolError(f"expected RankWelcome, got {type(welcome).__name__}")

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


def _refusal(msg: object) -> None:
    """Raise what rank 0's Error or goodbye before the welcome means."""
    if isinstance(msg, _wire.Error):
        if msg.kind == RankRefused.kind:
            raise RankRefused(msg.text)
        raise refusal(msg.kind, f"rank 0 refused this rank: {msg.text}")
    if isinstance(msg, _wire.Bye):
        raise RankRefused(f"rank 0 did not start: {msg.reason}")
