"""Rank 0 of a job of many learners: which rank serves each actor, and the links from the
other ranks that say where they listen, which actors they serve, and that they live.

Every actor knows only rank 0's address. Rank 0 answers an actor's Hello with the rank that
serves it: itself (the session opens as on a lone learner) or another rank (a ``Redirect``).
A rank is chosen once per actor id and kept while that rank lives (its link is up); a new
actor goes to the rank with the fewest actors, so the counts differ by at most one.

A rank links with a Login that proves the job's rank token (not the actors' token: an actor
cannot register as a rank), then proves in its RankHello that it holds rank 0's actors' token.
A live rank's slot is not given to a second registration, and a rank's RankActors may confirm
only actors that rank 0 placed on it, at most ``Config.max_connections`` of them."""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from ....config import Config
from ....errors import PeerLost, ProtocolError
from ....observe.ratelog import RateLimitedLog
from ....transport.control import ControlConnection
from ....wire import auth as _auth
from ....wire import messages as _wire

log = logging.getLogger(__name__)

STICKY_LIMIT = 100_000  # actor ids whose rank is remembered (oldest forgotten first)


class RankRefused(ProtocolError):
    """Rank 0 will not take this rank into the job (another actors' token, another world size,
    rank 0's own start failed): the rank's start fails with this reason."""

    kind = "config"


@dataclass
class RankLink:
    """Another rank, as rank 0 knows it."""

    rank: int
    host: str
    port: int
    conn: ControlConnection | None  # None: rank 0 itself


@dataclass
class Placement:
    rank: int
    since: float  # when it was made or last confirmed


class RankTable:
    """Rank 0's view of the job's ranks and its actors' placement (on rank 0's I/O loop).

    Args:
        world: the number of ranks.
        host, port: rank 0's own address (where actors placed on rank 0 already are).
        config: heartbeats and the grace a redirected actor has to reach its rank.
        rank_token: the job's rank token, which every rank proves.
    """

    def __init__(self, world: int, host: str, port: int, config: Config, quiet_log: RateLimitedLog,
                 rank_token: bytes):  # fmt: skip
        self.world = world
        self._rank_token = rank_token
        self.config = config
        self.links: dict[int, RankLink] = {0: RankLink(0, host, port, None)}
        self.placed: dict[int, Placement] = {}  # actor id -> the rank it was sent to (counts the load)
        self.sticky: collections.OrderedDict[int, int] = collections.OrderedDict()  # actor id -> its last rank
        self.moved = 0  # actors placed on another rank than the one they had (their rank ended)
        self.redirected = 0  # actors sent on to another rank
        # Set once every rank has linked: until then an actor is not placed (the first ranks to
        # link would take every actor of a job whose actors start with its learners).
        self.complete = asyncio.Event()
        self.failure: str | None = None  # why the job cannot start (a rank that cannot join)
        self._decided = asyncio.Event()  # complete, or failed
        self.refused_claims = 0  # actor ids a rank claimed that rank 0 had not placed on it
        self._quiet_log = quiet_log
        self._grace = 2 * config.handshake_timeout + config.heartbeat_timeout

    # --- placing actors -----------------------------------------------------------------------
    def place(self, actor_id: int, local: Collection[int]) -> int:
        """The rank that serves ``actor_id``: the one it had while that rank lives, else the
        live rank with the fewest actors (the lowest such rank). ``local`` are the ids rank 0
        serves now."""
        now = time.monotonic()
        self._forget_gone(0, local, now)
        had = self.sticky.get(actor_id)
        if had is not None and had in self.links:
            rank = had
        else:
            load = collections.Counter(p.rank for p in self.placed.values())
            rank = min(self.links, key=lambda r: (load[r], r))
            self.moved += had is not None
        self.placed[actor_id] = Placement(rank, now)
        self.sticky[actor_id] = rank
        self.sticky.move_to_end(actor_id)
        while len(self.sticky) > STICKY_LIMIT:
            self.sticky.popitem(last=False)
        return rank

    async def joined(self, wait: float) -> bool:
        """Whether every rank has linked once, waiting up to ``wait`` seconds for it."""
        if not self.complete.is_set():
            try:
                async with asyncio.timeout(wait):
                    await self.complete.wait()
            except TimeoutError:
                return False
        return True

    async def started(self, wait: float) -> str | None:
        """Rank 0's start: wait up to ``wait`` seconds until every rank has linked; None then,
        else why the job did not start."""
        try:
            async with asyncio.timeout(wait):
                await self._decided.wait()
        except TimeoutError:
            missing = sorted(set(range(self.world)) - set(self.links))
            self.fail(f"learner rank(s) {', '.join(map(str, missing))} did not link to rank 0 within {wait:g}s "
                      "(Config.connect_timeout; see their logs)")  # fmt: skip
        return self.failure

    def fail(self, reason: str) -> None:
        """The job cannot start: every waiting rank hears ``reason``."""
        if self.failure is None and not self.complete.is_set():
            self.failure = reason
            self._decided.set()

    # --- proofs -------------------------------------------------------------------------------
    def proves(self, learner_nonce: bytes, rank_nonce: bytes, mac: bytes) -> bool:
        """Whether a Login's ``mac`` proves the job's rank token."""
        return hmac.compare_digest(_auth.rank_proof(self._rank_token, learner_nonce, rank_nonce), mac)

    def proof(self, learner_nonce: bytes, rank_nonce: bytes) -> bytes:
        return _auth.rank_0_proof(self._rank_token, learner_nonce, rank_nonce)

    def check_hello(self, hello: _wire.RankHello, token: bytes | None, learner_nonce: bytes, rank_nonce: bytes) -> None:
        """Refuse (and, before the job started, fail it) a rank that is none of this job's or
        holds another actors' token than rank 0."""
        why = ""
        if not 0 < hello.rank < self.world or hello.world != self.world:
            why = f"rank {hello.rank} of {hello.world} is not a rank of this job (world size {self.world})"
        elif not hmac.compare_digest(_auth.rank_actor_token_proof(token, learner_nonce, rank_nonce), hello.token_proof):
            why = (f"learner rank {hello.rank} holds another token than rank 0 (or none, or one runs with insecure=True): "
                   "give every rank the same RLINK_TOKEN / RLINK_TOKEN_FILE")  # fmt: skip
        if why:
            self.fail(f"learner rank {hello.rank} of {self.world} did not start: {why}")
            raise RankRefused(why)

    def redirect(self, rank: int, actor_id: int) -> _wire.Redirect:
        """The Redirect that sends ``actor_id`` on to ``rank`` (counted)."""
        link = self.links[rank]
        self.redirected += 1
        return _wire.Redirect(rank, link.host, link.port, actor_id)

    def in_use(self) -> set[int]:
        """Actor ids placed anywhere in the job (an automatic id must be none of them)."""
        return set(self.placed)

    def actors_per_rank(self) -> dict[int, int]:
        load = collections.Counter(p.rank for p in self.placed.values())
        return {rank: load[rank] for rank in sorted(self.links)}

    def _forget_gone(self, rank: int, serving: Collection[int], now: float) -> None:
        """``rank`` serves exactly ``serving`` now: confirm those, and forget placements on it
        that are not among them and older than the grace a redirected actor has to arrive."""
        for actor_id in serving:
            self.placed[actor_id] = Placement(rank, now)
            self.sticky[actor_id] = rank
        gone = [a for a, p in self.placed.items() if p.rank == rank and a not in serving and now - p.since > self._grace]
        for actor_id in gone:
            del self.placed[actor_id]

    # --- the other ranks' links ---------------------------------------------------------------
    async def serve(self, conn: ControlConnection, hello: _wire.RankHello) -> None:
        """Keep rank ``hello.rank``'s link until it ends (the rank closed or died): while it is
        up, actors may be placed there. Welcomed once every rank has linked."""
        old = self.links.get(hello.rank)
        if old is not None and old.conn is not None and not old.conn.closed:
            raise ProtocolError(f"learner rank {hello.rank} is linked already: a second registration is refused "
                                "(a restarted rank links once rank 0 has seen the old link end)")  # fmt: skip
        link = RankLink(hello.rank, hello.host, hello.port, conn)
        self.links[hello.rank] = link
        if len(self.links) == self.world and self.failure is None:
            self.complete.set()
            self._decided.set()
        log.info("learner rank %d linked from %s (actors reach it at %s:%d)", hello.rank, conn.peer, hello.host,
                 hello.port)  # fmt: skip
        try:
            await self._decided.wait()  # no heartbeat is read meanwhile: the rank waits for its welcome
            if self.failure is not None:
                conn.send(_wire.Error(RankRefused.kind, self.failure))
                return
            conn.send(_wire.RankWelcome(self.world))
            await self._follow(conn, hello.rank)
        except (TimeoutError, PeerLost, OSError) as exc:
            self._quiet_log.warning("rank", "learner rank %d lost (%s): its actors move to the other ranks",
                                    hello.rank, exc or "no heartbeat")  # fmt: skip
        finally:
            if self.links.get(hello.rank) is link:
                del self.links[hello.rank]
                for actor_id in [a for a, p in self.placed.items() if p.rank == hello.rank]:
                    del self.placed[actor_id]

    async def _follow(self, conn: ControlConnection, rank: int) -> None:
        while True:
            async with asyncio.timeout(self.config.heartbeat_timeout):
                msg = await conn.recv(self.config.max_control_bytes)
            if isinstance(msg, _wire.RankActors):
                self._forget_gone(rank, self._claims(rank, msg.actors), time.monotonic())
            elif isinstance(msg, _wire.Bye):
                log.info("learner rank %d left: %s", rank, msg.reason)
                return
            elif not isinstance(msg, _wire.Heartbeat):
                raise ProtocolError(f"unexpected {type(msg).__name__} on rank {rank}'s link")

    def _claims(self, rank: int, actors: list[int]) -> set[int]:
        """The actors of a rank's RankActors that rank 0 placed on that rank (others ignored,
        counted): a rank cannot take another rank's actors."""
        if len(actors) > self.config.max_connections:
            raise ProtocolError(f"learner rank {rank} claims {len(actors)} actors, more than max_connections="
                                f"{self.config.max_connections}")  # fmt: skip
        mine = {a for a in actors if self.sticky.get(a) == rank}
        if len(mine) < len(actors):
            self.refused_claims += len(actors) - len(mine)
            self._quiet_log.warning("claims", "learner rank %d claimed %d actors rank 0 did not place on it (ignored)",
                                    rank, len(actors) - len(mine))  # fmt: skip
        return mine

    def heartbeat(self) -> None:
        """Tell every linked rank that rank 0 lives (from the learner's heartbeat loop)."""
        for link in self.links.values():
            if link.conn is not None:
                link.conn.send(_wire.Heartbeat())

    def describe(self) -> dict[int, dict[str, object]]:
        per_rank = self.actors_per_rank()
        return {rank: {"address": f"{link.host}:{link.port}", "actors": per_rank[rank]}
                for rank, link in sorted(self.links.items())}  # fmt: skip

    def close(self) -> None:
        for link in self.links.values():
            if link.conn is not None:
                link.conn.send(_wire.Bye(self.failure or "rank 0 closing"))
                link.conn.close()
