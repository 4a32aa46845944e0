"""What a connection's handshake on the learner produced, as one typed result.

The handshake decides what a new connection is (an actor's session, its data connection, a
weights pull, another learner rank, an ``rlink stats`` query); its result carries what the
connection goes on to do, so the caller runs it without asking which kind it was.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import LearnerSession


async def _nothing() -> None:
    """Nothing left to do on the connection."""


@dataclass(frozen=True)
class Handshaken:
    """A finished handshake: ``run`` serves the connection until it ends; ``session`` is the
    actor's session when the handshake opened one (its faults end that session)."""

    run: Callable[[], Awaitable[None]]
    session: LearnerSession | None = None

    @classmethod
    def handed_off(cls) -> Handshaken:
        """The connection needs nothing more here: a data connection now owned by its session,
        or an actor sent on to another rank."""
        return cls(_nothing)

    @classmethod
    def opened(cls, session: LearnerSession) -> Handshaken:
        """An actor's session, served on its control connection."""
        return cls(session.serve, session)
