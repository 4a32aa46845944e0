"""What a connection's handshake on the learner produced, as one typed result.

The handshake decides what a new connection is (an actor's session, its data connection, a
weights stream, another learner rank, an ``rlink stats`` query); its result carries what the
connection goes on to do, so the caller runs it without asking which kind it was.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import LearnerSession


async def _nothing() -> None:
    """Nothing left to do on the connection."""


class Kind(enum.Enum):
    """What the connection turned out to be."""

    SESSION = "session"  # an actor's control connection: its session is open
    ATTACHED = "attached"  # an actor's data connection, now owned by its session
    REDIRECTED = "redirected"  # an actor sent on to another rank of the job
    STREAM = "stream"  # an actor's weights stream
    RANK = "rank"  # another learner rank of the job, linking to rank 0
    STATS = "stats"  # an `rlink stats` query


@dataclass(frozen=True)
class Handshaken:
    """A finished handshake: what the connection is (``kind``), ``run`` serving it until it
    ends, and the actor's session when the handshake opened one (its faults end that session)."""

    kind: Kind
    run: Callable[[], Awaitable[None]] = _nothing
    session: LearnerSession | None = None

    @classmethod
    def opened(cls, session: LearnerSession) -> Handshaken:
        """An actor's session, served on its control connection."""
        return cls(Kind.SESSION, session.serve, session)
