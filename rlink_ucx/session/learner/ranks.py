"""Rank 0 of a job of many learners: which rank serves each actor, and the links from the
other ranks that say where they listen, which actors they serve, and that they live.

Every actor knows only rank 0's address. Rank 0 answers an actor's Hello with the rank that
serves it: itself (the session opens as on a lone learner) or another rank (a ``Redirect``).
A rank is chosen once per actor id and kept while that rank lives (its link is up); a new
actor goes to the rank with the fewest actors, so the counts differ by at most one."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from ...config import Config
from ...errors import PeerLost, ProtocolError
from ...observe.ratelog import RateLimitedLog
from ...transport.control import ControlConnection
from ...wire import messages as _wire

log = logging.getLogger(__name__)

STICKY_LIMIT = 100_000  # actor ids whose rank is remembered (oldest forgotten first)


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
    """

    def __init__(self, world: int, host: str, port: int, config: Config, quiet_log: RateLimitedLog):
        self.world = world
        self.config = config
        self.links: dict[int, RankLink] = {0: RankLink(0, host, port, None)}
        self.placed: dict[int, Placement] = {}  # actor id -> the rank it was sent to (counts the load)
        self.sticky: collections.OrderedDict[int, int] = collections.OrderedDict()  # actor id -> its last rank
        self.moved = 0  # actors placed on another rank than the one they had (their rank ended)
        # Set once every rank has linked: until then an actor is not placed (the first ranks to
        # link would take every actor of a job whose actors start with its learners).
        self.complete = asyncio.Event()
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

    def redirect(self, rank: int, actor_id: int) -> _wire.Redirect:
        link = self.links[rank]
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
        up, actors may be placed there."""
        if not 0 < hello.rank < self.world or hello.world != self.world:
            raise ProtocolError(f"rank {hello.rank} of {hello.world} is not a rank of this job (world size {self.world})")
        old = self.links.get(hello.rank)
        if old is not None and old.conn is not None:
            old.conn.close()  # a restarted rank: its old link is dead or about to be
        link = RankLink(hello.rank, hello.host, hello.port, conn)
        self.links[hello.rank] = link
        if len(self.links) == self.world:
            self.complete.set()
        conn.send(_wire.RankWelcome(self.world))
        log.info("learner rank %d joined at %s:%d", hello.rank, hello.host, hello.port)
        try:
            while True:
                async with asyncio.timeout(self.config.heartbeat_timeout):
                    msg = await conn.recv(self.config.max_control_bytes)
                if isinstance(msg, _wire.RankActors):
                    self._forget_gone(hello.rank, set(msg.actors), time.monotonic())
                elif isinstance(msg, _wire.Bye):
                    log.info("learner rank %d left: %s", hello.rank, msg.reason)
                    return
                elif not isinstance(msg, _wire.Heartbeat):
                    raise ProtocolError(f"unexpected {type(msg).__name__} on rank {hello.rank}'s link")
        except (TimeoutError, PeerLost, OSError) as exc:
            self._quiet_log.warning("rank", "learner rank %d lost (%s): its actors move to the other ranks",
                                    hello.rank, exc or "no heartbeat")  # fmt: skip
        finally:
            if self.links.get(hello.rank) is link:
                del self.links[hello.rank]
                for actor_id in [a for a, p in self.placed.items() if p.rank == hello.rank]:
                    del self.placed[actor_id]

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
                link.conn.send(_wire.Bye("rank 0 closing"))
                link.conn.close()
