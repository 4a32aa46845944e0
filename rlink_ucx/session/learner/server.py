"""The learner's network side, living on its I/O loop: listener, handshakes, sessions, credit."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
import threading
import time
from typing import Any

import msgspec

from ..._memory import Reserve
from ...config import Config
from ...errors import AuthError, PeerLost, ProtocolError, Rejected, RLinkError, SchemaMismatch, Superseded
from ...observe.counters import ActorTotals
from ...observe.ratelog import RateLimitedLog
from ...observe.report import StalenessHistogram, report
from ...store.ring import StepRing
from ...transport import hostname
from ...transport.address import is_loopback
from ...transport.control import ControlConnection
from ...transport.loop import ticks
from ...transport.plane import LearnerContext, LearnerPlanes, Plane
from ...weights.publisher import Publisher
from ...wire import auth as _auth
from ...wire import messages as _wire
from ...wire.codec import Schema
from .. import tokens
from .admission import Admission, listen_backlog, raise_file_limit
from .attach import attach_data_connection
from .credit import CreditGranter
from .liveness import HeartbeatRounds
from .outcome import Handshaken, Kind
from .ranks.link import RankLinkClient
from .ranks.placement import RankTable
from .session import LearnerSession
from .table import SessionTable

log = logging.getLogger(__name__)


class Refused(ProtocolError):
    """A session the learner will never accept as asked (protocol version, data plane): the
    actor is told so ("refused") and does not retry."""

    kind = "refused"


class Busy(ProtocolError):
    """No room for another actor now (``max_connections``): the actor retries until its
    ``connect_timeout``, and its error then says why."""

    kind = "busy"


class PreauthTimeout(TimeoutError):
    """A new connection did not log in (or attach) within ``Config.preauth_timeout``."""


class LearnerServer:
    def __init__(self, host: str, port: int, *, token: bytes | None, transport: str, config: Config,
                 loop: asyncio.AbstractEventLoop, schema: Schema | None = None,
                 publish_token: bool = False, rank: int = 0, world: int = 1):  # fmt: skip
        self.host, self.port = host, port
        self.rank, self.world = rank, world  # this learner's rank in a job of many (0 of 1: alone)
        self.ranks: RankTable | None = None  # rank 0 of many: where each actor goes
        self.rank_link: RankLinkClient | None = None  # another rank: its link to rank 0
        self.token = token
        self.publish_token = publish_token  # a generated token: written for local actors once bound
        self.token_path: Any = None  # where it was written
        self.transport = transport
        self.config = config
        self.quiet_log = RateLimitedLog(log)  # refusals, accept errors, session ends: a storm is a few lines
        self.loop = loop
        self.table = SessionTable(rank)  # open and ended sessions, resume points, incarnations
        self.schema = schema
        self.ring: StepRing | None = None
        self.ring_ready = threading.Event()
        self.pin_memory = False
        # The receive ring's memory, populated from now on so the first frames land in warm
        # pages (rlink_ucx/_memory.py); handed to the ring when the schema is known.
        self.reserve: Reserve | None = Reserve(config.buffer_bytes, "learner")
        self.batch_steps: int | None = None  # the dataset's batch size: ring chunks match it
        self.version = 0
        self.credit = CreditGranter(self.sessions, config, loop)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listener: socket.socket | None = None
        self.admission = Admission(config)
        raise_file_limit(config)
        self.planes = LearnerPlanes(LearnerContext(transport, config, loop, host, is_loopback(host)))
        self.publisher = Publisher(self)
        self.staleness = StalenessHistogram()  # fed by RLinkDataset

    @property
    def sessions(self) -> dict[int, LearnerSession]:
        """Open sessions by id (the table's)."""
        return self.table.sessions

    @property
    def ended(self) -> list[dict[str, Any]]:
        """``stats()`` rows of ended sessions, newest last (the table's)."""
        return self.table.ended

    @property
    def totals(self) -> ActorTotals:
        """Ended sessions' counters (the table's)."""
        return self.table.totals

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, rank_token: bytes | None = None) -> None:
        """Bind, publish the token, start the plane asked for by name, then accept. On failure
        the caller runs ``stop()``, which undoes whatever was done. ``rank_token``: rank 0 of
        many, the job's rank token that the other ranks prove."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, backlog=listen_backlog(self.config),
                                    reuse_port=False)  # fmt: skip
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        if self.publish_token and self.token is not None:
            # After the bind (port 0 is now the real port), before the first accept: an actor
            # that connected early waits in the backlog, and finds the file once challenged.
            try:
                self.token_path = tokens.publish(self.config, self.port, self.token)
            except BaseException:
                sock.close()
                self._listener = None
                raise
            log.info("learner token for local actors written to %s", self.token_path)
        await self.planes.start()  # asked for by name: fail here, not at the first actor
        if self.rank == 0 and self.world > 1:
            assert rank_token is not None, "a job of many learners has a rank token"
            self.ranks = RankTable(self.world, self.host, self.port, self.config, self.quiet_log, rank_token)
        self._spawn(self._accept_loop())
        self._spawn(self._heartbeat_loop())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def withdraw_token(self) -> None:
        """Remove the generated token's file (idempotent; any thread)."""
        path, self.token_path = self.token_path, None
        if path is not None and self.token is not None:
            tokens.withdraw(path, self.token)

    async def link_to_rank_0(self, home: tuple[str, int], advertised: tuple[str, int], rank_token: bytes,
                             timeout: float) -> None:  # fmt: skip
        """A rank other than 0: keep a link to rank 0 at ``home``, saying actors reach this
        rank at ``advertised``; return once rank 0 welcomed it (every rank of the job linked).

        Raises:
            ConfigError: rank 0 refused this rank, its own start failed, or no welcome within
                ``timeout`` (the link is still tried in the background until ``stop``).
        """
        self.rank_link = RankLinkClient(self.rank, self.world, home, advertised, (self.token, rank_token),
                                        self.config, lambda: {s.actor_id for s in self.sessions.values()})  # fmt: skip
        self._spawn(self.rank_link.run())
        await self.rank_link.started(timeout)

    async def stop(self) -> None:
        self.publisher.closing()  # sessions end now: nothing is taken over or relinked
        self.withdraw_token()
        if self.rank_link is not None:
            self.rank_link.close()
        if self.ranks is not None:
            self.ranks.close()
        for session in list(self.sessions.values()):
            session.control.send(_wire.Bye("learner closing"))
            session.close("learner closing", lost=False)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        await self.planes.close()
        if self.ring is not None:
            self.ring.close()
        if self.reserve is not None:
            self.reserve.close()
            self.reserve = None

    # --- accepting ----------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, addr = await self.loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and friends: back off rather than spin
                self.quiet_log.warning("accept", "accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn = ControlConnection(sock, self.loop, f"{addr[0]}:{addr[1]}")
            task = self._spawn(self._handle(conn))
            # Also when the task is dropped before it ever ran (admission sheds the oldest).
            task.add_done_callback(functools.partial(_close_unless_handed_off, conn))
            self.admission.admit(task, addr[0])

    async def _handle(self, conn: ControlConnection) -> None:
        peer = conn.peer
        session: LearnerSession | None = None
        try:
            try:
                async with asyncio.timeout(self.config.handshake_timeout):
                    result = await self._handshake(conn)
                self.admission.finished(asyncio.current_task())
            except TimeoutError as exc:
                # Not a rejection: a busy learner or a slow link; the actor may try again.
                if isinstance(exc, PreauthTimeout):  # counted and logged (rate-limited) by admission
                    conn.send(_wire.Error("timeout", str(exc)))
                    return
                log.info("handshake with %s did not finish within %ss", peer, self.config.handshake_timeout)
                conn.send(_wire.Error("timeout", f"handshake did not finish within {self.config.handshake_timeout}s"))
                return
            session = result.session
            await result.run()
        except AuthError as exc:
            self.admission.auth_failures += 1
            self.quiet_log.warning("auth", "refused %s: %s", peer, exc)
            conn.send(_wire.Error("auth", str(exc)))
        except Superseded as exc:
            self.quiet_log.warning("superseded", "refused %s: %s", peer, exc)
            conn.send(_wire.Error("superseded", str(exc)))
        except (ProtocolError, SchemaMismatch) as exc:
            self.quiet_log.warning("dropped", "dropped %s: %s", peer, exc)
            conn.send(_wire.Error(getattr(exc, "kind", "protocol"), str(exc)[:500]))
            if session is not None:
                session.stats.protocol_errors += 1
        except (PeerLost, OSError, RLinkError) as exc:
            if session is not None:
                session.close(str(exc), lost=True)
        except asyncio.CancelledError:
            raise
        finally:
            self.admission.finished(asyncio.current_task())
            if session is not None:
                session.close("control connection ended", lost=True)
            elif not conn.handed_off:
                conn.close()

    async def _handshake(self, conn: ControlConnection) -> Handshaken:
        nonce = _auth.new_nonce()
        conn.send(_wire.Challenge(_wire.PROTOCOL_VERSION, nonce, self.token is not None))
        first = await _first_message(conn, self.admission, self.config)
        if isinstance(first, _wire.Attach):
            attach_data_connection(self.sessions, conn, first, nonce)
            self.grant_credits()
            return Handshaken(Kind.ATTACHED)
        if isinstance(first, _wire.OpenStream):  # an actor's weights stream
            if first.proto != _wire.PROTOCOL_VERSION:
                raise Refused(f"weights stream of protocol {first.proto}; learner speaks {_wire.PROTOCOL_VERSION}")
            member = self.publisher.verify_stream(first, nonce)
            return Handshaken(Kind.STREAM, functools.partial(self.publisher.serve_stream, conn, member, first.have))
        if not isinstance(first, _wire.Login):
            raise ProtocolError(f"expected Login or Attach, got {type(first).__name__}")
        if first.proto != _wire.PROTOCOL_VERSION:
            raise Refused(f"actor speaks protocol {first.proto}; learner speaks {_wire.PROTOCOL_VERSION}")
        if len(first.nonce) != _auth.NONCE_BYTES:
            raise ProtocolError("bad nonce length")
        # A learner rank proves the job's rank token, which actors do not hold; then its actors' token.
        a_rank = self.ranks is not None and self.ranks.proves(nonce, first.nonce, first.mac)
        if a_rank and self.ranks is not None:
            self.admission.finished(asyncio.current_task())
            conn.send(_wire.Proof(self.ranks.proof(nonce, first.nonce)))
        elif self.token is not None:
            _auth.verify(_auth.actor_proof(self.token, nonce, first.nonce), first.mac, "actor")
            self.admission.finished(asyncio.current_task())  # authenticated: no longer a pre-auth slot
            conn.send(_wire.Proof(_auth.learner_proof(self.token, nonce, first.nonce)))
        hello = await conn.recv(self.config.max_control_bytes)
        if isinstance(hello, _wire.StatsRequest):  # `rlink stats`, authenticated as an actor is
            return Handshaken(Kind.STATS, lambda: _answer_stats(conn, self.snapshot(), self.config))
        if isinstance(hello, _wire.RankHello):
            if self.ranks is None:
                raise Refused(f"a learner rank linked to rank {self.rank} of {self.world}: only rank 0 of a job of "
                              "many learners takes ranks (are two jobs given the same address?)")  # fmt: skip
            if not a_rank:
                raise AuthError("a RankHello from a peer that did not prove the job's rank token (an actor's token "
                                "does not make a learner rank)")  # fmt: skip
            self.ranks.check_hello(hello, self.token, nonce, first.nonce)
            return Handshaken(Kind.RANK, functools.partial(self.ranks.serve, conn, hello))
        if a_rank:
            raise ProtocolError(f"expected RankHello after a rank's login, got {type(hello).__name__}")
        if not isinstance(hello, _wire.Hello):
            raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
        if self.ranks is not None:  # rank 0 of many: this actor may belong to another rank
            if not await self.ranks.joined(self.config.handshake_timeout / 2):
                raise Busy("the job's learner ranks are still starting (not every rank has linked to rank 0 yet)")
            actor_id = hello.actor_id if hello.actor_id is not None else self._new_actor_id()
            rank = self.ranks.place(actor_id, [s.actor_id for s in self.sessions.values()])
            if rank != self.rank:
                conn.send(self.ranks.redirect(rank, actor_id))
                return Handshaken(Kind.REDIRECTED)
            hello = msgspec.structs.replace(hello, actor_id=actor_id)
        plane = self._choose(hello)[0]
        if plane is not None:
            await plane.prepare()  # a plane that cannot start is no longer offered: chosen again below
        return Handshaken.opened(self._open_session(conn, hello))

    def _new_actor_id(self) -> int:
        return self.table.new_actor_id(self.ranks.in_use() if self.ranks is not None else ())

    def _choose(self, hello: _wire.Hello) -> tuple[Plane | None, str]:
        return self.planes.choose(hello, same_host=hello.host == hostname())

    def _open_session(self, conn: ControlConnection, hello: _wire.Hello) -> LearnerSession:
        plane, reason = self._choose(hello)
        if plane is None:
            raise Refused(f"no common data plane: {reason}")
        if len(self.sessions) >= self.config.max_connections:
            self.admission.rejected += 1
            raise Busy(f"the learner already serves max_connections={self.config.max_connections} actors")
        if hello.actor_id is not None:
            actor_id = hello.actor_id
            self.table.claim(actor_id, hello.incarnation)
        else:
            actor_id = self._new_actor_id()
        try:  # opened last: every path from here on closes it with the session
            opening = plane.open(reason)
        except Rejected as exc:
            raise Refused(str(exc)) from exc
        transport, reason = opening.plane.name, opening.reason
        session = LearnerSession(self, self.table.next_id(), conn, hello, actor_id, transport, reason,
                                 secrets.token_bytes(32))  # fmt: skip
        session.opening = opening
        resume = self.table.add(session)
        conn.send(_wire.Welcome(
            session.id, actor_id, self.version, transport, reason, session.ticket,
            self.config.max_frame_bytes, self.config.heartbeat_interval, self.config.heartbeat_timeout,
            -1 if resume is None else resume, opening.answer,
        ))  # fmt: skip
        self.quiet_log.info("connected", "actor %s (%s pid %s) connected; data plane %s (%s)", actor_id, hello.host,
                            hello.pid, transport, reason)  # fmt: skip
        if not opening.plane.data_connection:  # attached at the Welcome
            session.opening = None
            session.receiver, ready = opening.attach(session, None, None)
            conn.send(ready)
        return session

    # --- schema and credit ----------------------------------------------------------------------
    def negotiate_schema(self, schema: Schema) -> tuple[int, StepRing]:
        """The schema id and ring for an actor's proposal. The first proposal (or a declared
        schema) is the learner's schema; a later one is accepted as it when its values can be
        cast to it without a change of kind (``Schema.casts_to``): the session answers with
        the ring's schema, which the actor then puts as."""
        if self.schema is not None and schema != self.schema:
            if not schema.casts_to(self.schema):
                raise SchemaMismatch(self._mismatch(schema))
            schema = self.schema
        if self.ring is None:
            if schema.step_bytes > self.config.max_frame_bytes:
                raise SchemaMismatch(
                    f"one step is {schema.step_bytes} bytes, over max_frame_bytes={self.config.max_frame_bytes}: "
                    f"start the learner with Config(max_frame_bytes={schema.step_bytes}, buffer_bytes="
                    f"{max(self.config.buffer_bytes, 2 * schema.step_bytes)}) or more (RLINK_MAX_FRAME_BYTES, "
                    "RLINK_BUFFER_BYTES)"
                )
            smallest_ring = 2 * schema.frame_steps(self.config.frame_bytes) * schema.step_bytes  # two frames at least
            if smallest_ring > self.config.buffer_bytes:
                raise SchemaMismatch(f"one step is {schema.step_bytes} bytes: the receive ring must hold two frames, "
                                     f"{smallest_ring} bytes, over buffer_bytes={self.config.buffer_bytes}: start the "
                                     f"learner with Config(buffer_bytes={smallest_ring}) or more (RLINK_BUFFER_BYTES)")  # fmt: skip
            reserve, self.reserve = self.reserve, None
            self.ring = _new_ring(schema, self.config, self.batch_steps, self.pin_memory, reserve)
            self.schema = schema  # only now: a refused proposal must not become the learner's schema
            self.credit.ring = self.ring
            self.ring.on_space_freed = self.credit.space_freed
            self.ring_ready.set()
            log.info("schema %s accepted: %s", schema.fingerprint, schema.describe())
        return 1, self.ring

    def _mismatch(self, schema: Schema) -> str:
        assert self.schema is not None
        return (f"actor schema {schema.describe()} does not match the learner's {self.schema.describe()}: "
                f"{self.schema.compare(schema)}")  # fmt: skip

    def grant_credits(self) -> None:
        self.credit.request_grant()  # coalesced: one walk of the sessions per loop pass

    def credit_low(self) -> None:
        self.credit.credit_low()

    # --- liveness and bookkeeping -------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        rounds = HeartbeatRounds()  # a slice of the sessions per tick (liveness.py says why)
        async for late in ticks(self.config.heartbeat_interval / rounds.slices):
            now = time.monotonic()
            turn, owed = rounds.tick(late)
            for session in rounds.members(turn, list(self.sessions.items())):
                session.heartbeat(now, owed)
            if turn == 0:
                if self.ranks is not None:
                    self.ranks.heartbeat()
                self.credit.reclaim_idle(now)

    def session_ended(self, session: LearnerSession, error: PeerLost | None) -> None:
        if not self.table.remove(session):
            return
        self.publisher.on_session_end(session)
        if self.ring is not None:
            self.ring.wake()
        self.grant_credits()

    def actors_done(self) -> bool:
        """Every actor that connected has left and none is expected back: no session is open,
        and the last one that ended without a goodbye did so over ``reconnect_timeout`` ago
        (any thread)."""
        return self.table.all_done(self.config.reconnect_timeout)

    def snapshot(self) -> dict[str, Any]:
        """The learner's stats (on the I/O loop)."""
        return report(self)


async def _first_message(conn: ControlConnection, admission: Admission, config: Config) -> _wire.Message:
    """A new connection's first message, within ``Config.preauth_timeout``: what follows is
    verified at once, so only this wait is unauthenticated."""
    limit = min(config.preauth_timeout, config.handshake_timeout)
    try:
        async with asyncio.timeout(limit):
            return await conn.recv(config.max_preauth_bytes)
    except TimeoutError:
        admission.preauth_expired(conn.peer)
        raise PreauthTimeout(f"no login within {limit}s (Config.preauth_timeout)") from None


async def _answer_stats(conn: ControlConnection, stats: dict[str, Any], config: Config) -> None:
    """Send ``stats`` to an authenticated client, then wait (bounded) for it to close: a reply
    larger than the socket's buffer is still being written when ``send`` returns."""
    conn.send(_wire.StatsReply(stats))
    with contextlib.suppress(TimeoutError, PeerLost, ProtocolError, OSError):
        async with asyncio.timeout(config.handshake_timeout):
            await conn.recv(config.max_preauth_bytes)


def _close_unless_handed_off(conn: ControlConnection, _task: asyncio.Task[Any]) -> None:
    if not conn.handed_off:
        conn.close()


def _new_ring(schema: Schema, config: Config, batch_steps: int | None, pinned: bool, reserve: Reserve | None) -> StepRing:
    """The receive ring for ``schema``: in the memory reserved at start, unless it must be pinned."""
    max_steps = schema.frame_steps(config.frame_bytes)
    ring = StepRing(schema, config.buffer_bytes, max_steps, chunk_steps=batch_steps, pin_memory=pinned,
                    reserve=None if pinned else reserve)  # fmt: skip
    if reserve is not None and pinned:
        reserve.close()
    return ring
