"""One session's credit and flush accounting on the learner (``LearnerSession.flow``)."""

from __future__ import annotations

import time

IDLE_SECONDS = 1.0  # an actor that sent no frame for this long is idle (its credit may be reclaimed)


class SessionFlow:
    """Credit granted to one actor and not yet used, the mark below which it is topped up, an
    outstanding Revoke and the debt it leaves, when a frame last completed, and the seq a flush
    waits for. No lock of its own: the frame path writes ``credit``, ``last_frame`` under the
    session's lock, on every frame, so one more lock here would cost every frame."""

    __slots__ = ("ack_wanted", "credit", "last_frame", "low_water", "owed_keep", "owed_since", "revoking")

    def __init__(self) -> None:
        self.credit = 0  # steps granted to this actor and not yet used
        self.low_water = 0  # wake the loop for more credit once credit falls to this
        self.revoking = False  # a Revoke is outstanding
        # Since when the session owes revoked credit (None: it owes none): from the first Revoke
        # until it has answered (Returned) and holds no more than ``owed_keep`` steps (frames it
        # sent before it read the Revoke have landed), or the learner granted it more. Past
        # ``LearnerSession.revoke_deadline()`` the session is ended: credit it sits on is credit
        # others wait for.
        self.owed_since: float | None = None
        self.owed_keep = 0
        self.last_frame = time.monotonic()  # when a frame last completed (idle actors give credit back)
        self.ack_wanted = 1 << 62  # a flush waits for this seq: acknowledge when reached

    @property
    def low(self) -> bool:
        """At or below the low-water mark: the only state in which the granter gives more."""
        return self.credit <= self.low_water

    def idle(self, now: float) -> bool:
        """No frame for ``IDLE_SECONDS``: its credit is better spent on actors still sending."""
        return now - self.last_frame > IDLE_SECONDS

    def owes(self) -> bool:
        """Still owes revoked credit: no Returned yet, or more than it was asked to keep (the
        frames in flight when it answered have not all landed). Clears the debt once met."""
        if self.owed_since is not None and not self.revoking and self.credit <= self.owed_keep:
            self.owed_since = None
        return self.owed_since is not None
