"""How one actor gets one model version: the single place that decides it.

The fan-out thread (which actors it maps a version for, which it only tells of it) and each
weights stream's thread (whether the stream stays open for the next version) both ask
:func:`delivery`, so the two can never disagree about an actor.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

from .membership import Membership

__all__ = ["Route", "delivery"]


class Route(enum.Enum):
    """The way a version reaches an actor."""

    # On the learner's host and caught up: the actor reads the version from the learner's
    # sealed shared memory, told where on its control connection (``Mapped``).
    SHARED = "shared"
    # On the learner's host but behind (it has not confirmed the last version it was sent):
    # this version comes on a weights stream that ends after it, the next from shared memory.
    CATCH_UP = "catch-up"
    # Anywhere else, and for a version outside shared memory (a CUDA one): the actor's own
    # weights stream carries this version and stays open for every later one. Off the
    # learner's host, where actors share copies, only the host's streamer (``hosts.py``).
    STREAM = "stream"
    # Off the learner's host, caught up, and not its host's streamer: the actor reads the
    # version from the memfd of an actor of its host that holds it, told where (``Mapped``)
    # once that actor confirmed it.
    FROM_PEER = "from-peer"
    # A host's streamer linked to the streamer of the host before it in the chain
    # (``chain.py``): the bytes come from that relay, the version's key and Seal from the learner.
    RELAY = "relay"
    # A host's streamer in the learner's broadcast group (``broadcast.py``,
    # ``Config.weights_fanout="broadcast"``): the bytes come by broadcast, the version's key and
    # Seal from the learner.
    BROADCAST = "broadcast"


class _Version(Protocol):
    @property
    def shared(self) -> Any: ...  # where the version lies in shared memory; None: not there


def delivery(member: Membership, version: _Version | None) -> Route:
    """How ``member``'s actor gets ``version`` (None: the first one, not published yet, which
    lands in shared memory where the learner keeps its snapshots there). Read it under the
    publisher's lock: ``member``'s fields are the publisher's to write."""
    if member.peers and not member.suspect:  # off the learner's host: shared copies, whatever the learner's memory
        if member.streamer:
            if member.cast_rank:
                return Route.BROADCAST
            return Route.RELAY if member.relay_from is not None else Route.STREAM
        return Route.CATCH_UP if member.key is None or member.acked < member.sent else Route.FROM_PEER
    if not member.shared or (version is not None and version.shared is None):
        return Route.STREAM
    if member.key is None or member.acked < member.sent:
        return Route.CATCH_UP
    return Route.SHARED
