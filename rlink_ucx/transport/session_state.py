"""The state of one actor's session on the learner, in one place.

It lives in the transport layer because the session, the weights publisher and the metrics
endpoint all read it and all sit above transport/; ``stats()`` reports ``state.value``.
"""

from __future__ import annotations

import enum


class SessionState(enum.Enum):
    """Where a session is: ``OPEN`` while its actor is connected, then exactly one end."""

    OPEN = "open"
    LOST = "lost"  # a fault: reported as PeerLost, the actor may come back and resume
    MOVED = "moved"  # the actor was asked to reconnect elsewhere (a data plane retired, a rank redirect)
    CLOSED = "closed"  # a goodbye, or the learner closing
