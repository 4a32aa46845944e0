"""Admission of new connections on the learner.

Connections that have not finished their handshake are capped apart from the actors
(``Config.max_handshakes``), so unauthenticated sockets can never take an actor's place; at the
cap the oldest is dropped: a real handshake takes milliseconds, one that lingers is a slow link
or a slowloris, and a dropped actor retries with backoff. ``Config.max_connections`` caps the
actors themselves. The listen backlog and the file limit are sized for a storm of them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time
from typing import Any

from ..config import Config

log = logging.getLogger(__name__)
FDS_PER_ACTOR = 4  # control and data connections, the shm ring's memfd and the arena's mapping
FDS_SPARE = 256  # the listener, UCX, the weights store, pulls, the user's own files


class Admission:
    """Tracks the handshakes in flight (on the I/O loop)."""

    def __init__(self, config: Config):
        self.config = config
        self._pending: collections.OrderedDict[int, asyncio.Task[Any]] = collections.OrderedDict()
        self.shed = 0  # handshakes dropped to make room for newer ones
        self._logged = 0.0

    def admit(self, task: asyncio.Task[Any]) -> None:
        """``task`` starts a handshake; drop the oldest one in flight if that makes too many."""
        self._pending[id(task)] = task
        while len(self._pending) > self.config.max_handshakes:
            _, oldest = self._pending.popitem(last=False)
            oldest.cancel()
            self.shed += 1
            now = time.monotonic()
            if now - self._logged > 10:  # one line per storm, not one per connection
                self._logged = now
                log.warning("more than max_handshakes=%d connections are handshaking: dropping the oldest "
                            "(%d so far; their actors retry)", self.config.max_handshakes, self.shed)  # fmt: skip

    def finished(self, task: asyncio.Task[Any] | None) -> None:
        """``task``'s handshake ended (it became a session, a data connection, or failed)."""
        if task is not None:
            self._pending.pop(id(task), None)

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
