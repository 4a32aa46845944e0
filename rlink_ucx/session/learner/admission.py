"""Admission of new connections on the learner.

Connections that have not yet proven the token (or their session's ticket) are capped apart
from the actors (``Config.max_handshakes``), so unauthenticated sockets can never take an
actor's place; at the cap the oldest is dropped: a real handshake takes milliseconds, one that
lingers is a slow link or a slowloris, and a dropped actor retries with backoff. One peer
address (an IPv6 peer: its /64) may hold at most ``Config.max_handshakes_per_peer`` of them; at
that cap its own oldest goes if it is older than half the pre-auth timeout (a slowloris), else
the newcomer is refused (a storm of one host's actors: they retry with backoff), so a flood
from one address never touches other peers' handshakes. A connection that has not authenticated within
``Config.preauth_timeout`` is dropped too. ``Config.max_connections`` caps the actors
themselves. The listen backlog and the file limit are sized for a storm of them.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import resource
import time
from typing import Any

from ...config import Config
from ...observe.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
FDS_PER_ACTOR = 4  # control and data connections, and the weights stream or the shm ring's memfd and mapping
FDS_SPARE = 256  # the listener, UCX, weights streams being opened, the user's own files
LOG_EVERY = 10.0  # seconds between two warnings of one kind: one line per storm, not per connection


def peer_key(host: str) -> str:
    """The address a per-peer cap counts by: an IPv4 address, or an IPv6 address's /64 (one
    host or site commonly holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Admission:
    """Tracks the connections not yet authenticated (on the I/O loop), and counts those shed."""

    def __init__(self, config: Config):
        self.config = config
        self._pending: collections.OrderedDict[int, tuple[asyncio.Task[Any], str]] = collections.OrderedDict()
        self._by_peer: dict[str, collections.OrderedDict[int, float]] = {}  # task id -> admitted at
        self.shed = 0  # dropped to make room for newer ones, by either cap
        self.shed_per_peer = 0  # ... of which by the per-peer cap
        self.timed_out = 0  # dropped for not authenticating within preauth_timeout
        self.auth_failures = 0  # refused for a failed authentication
        self.rejected = 0  # authenticated actors turned away at max_connections
        self._log = RateLimitedLog(log, every=LOG_EVERY, burst=1)

    def admit(self, task: asyncio.Task[Any], host: str) -> None:
        """``task`` starts a handshake with a peer at ``host``; drop the oldest unauthenticated
        one of that peer, then of all, while there are too many."""
        key = peer_key(host)
        now = time.monotonic()
        self._pending[id(task)] = (task, key)
        mine = self._by_peer.setdefault(key, collections.OrderedDict())
        mine[id(task)] = now
        while len(mine) > self.config.max_handshakes_per_peer:
            # A young handshake is most likely a real one held up by a storm of its peer's
            # actors connecting at once (all of a host's actors share its address): refuse the
            # newcomer, which retries with backoff, rather than churn the ones nearly done.
            # An old one is a slowloris or a dead link: it goes.
            oldest, since = next(iter(mine.items()))
            young = now - since < self.config.preauth_timeout / 2
            self._drop(id(task) if young else oldest)
            self.shed_per_peer += 1
            self._log.warning("peer", "more than max_handshakes_per_peer=%d unauthenticated connections from %s: "
                       "refusing the newest or dropping one older than preauth_timeout/2 (%d so far)",
                       self.config.max_handshakes_per_peer, key, self.shed_per_peer)  # fmt: skip
            if young:
                return
        while len(self._pending) > self.config.max_handshakes:
            self._drop(next(iter(self._pending)))
            self._log.warning("all", "more than max_handshakes=%d connections are handshaking: dropping the oldest "
                       "(%d so far; their actors retry)", self.config.max_handshakes, self.shed)  # fmt: skip

    def _drop(self, ident: int) -> None:
        task, _ = self._pending[ident]
        self.finished(task)
        task.cancel()
        self.shed += 1

    def finished(self, task: asyncio.Task[Any] | None) -> None:
        """``task`` authenticated, or its handshake ended (a session, a data connection, a failure)."""
        if task is None:
            return
        entry = self._pending.pop(id(task), None)
        if entry is not None:
            mine = self._by_peer[entry[1]]
            mine.pop(id(task), None)
            if not mine:
                del self._by_peer[entry[1]]

    def preauth_expired(self, peer: str) -> None:
        """Count (and log, rate-limited) a connection dropped for not authenticating in time."""
        self.timed_out += 1
        self._log.warning("timeout", "%s did not authenticate within preauth_timeout=%ss: dropped (%d so far)",
                   peer, self.config.preauth_timeout, self.timed_out)  # fmt: skip

    @property
    def in_flight(self) -> int:
        return len(self._pending)


def listen_backlog(config: Config) -> int:
    """A backlog that holds a storm of actors connecting at once (the kernel caps it at
    ``net.core.somaxconn``)."""
    return min(65535, max(512, config.max_connections + config.max_handshakes))


def raise_file_limit(config: Config) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to what ``max_connections`` actors need (up to the hard
    limit), saying clearly when that is not enough. Returns the soft limit now in force."""
    need = FDS_PER_ACTOR * config.max_connections + FDS_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft < need:
        log.warning("the open-file limit (%d, hard limit %s) holds about %d actors, fewer than "
                    "max_connections=%d: raise it (ulimit -n %d) or lower max_connections",
                    soft, hard, (soft - FDS_SPARE) // FDS_PER_ACTOR, config.max_connections, need)  # fmt: skip
    return soft
