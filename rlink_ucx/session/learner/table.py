"""The learner's table of actors' sessions: the open ones by id, the rows of ended ones, where
each (actor id, incarnation) stopped, and the newest incarnation seen per actor id.

A reconnecting actor resumes where its incarnation stopped, and what it resends below that
point is recognised as a duplicate; an older incarnation than the newest is refused. Used on
the learner's I/O loop only.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ...errors import Superseded
from ...observe.counters import ActorTotals
from ...observe.report import describe_session
from ...transport.session_state import SessionState

if TYPE_CHECKING:
    from .session import LearnerSession

MAX_RESUME_POINTS = 10_000  # stopped streams remembered for a reconnect (oldest forgotten first)
MAX_INCARNATIONS = 100_000  # actor ids whose newest incarnation is remembered
MAX_ENDED_ROWS = 1000  # ended sessions' rows kept for stats()


class SessionTable:
    """Every actor session of one learner, open and ended."""

    def __init__(self, rank: int):
        self.sessions: dict[int, LearnerSession] = {}
        self.ended: list[dict[str, Any]] = []  # stats() rows of ended sessions, newest last
        self.last_unclean_end: float | None = None  # when a session last ended without a goodbye
        self.totals = ActorTotals()  # ended sessions' counters, for the metrics endpoint
        self._resume: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self._incarnations: dict[int, int] = {}
        self._ids = itertools.count(1)
        # Automatic actor ids: rank 0 gives every actor of the job one; an actor that reaches
        # another rank directly gets one of that rank's own range.
        self._auto_actor_ids = itertools.count(1 + (rank << 40))

    def next_id(self) -> int:
        """A new session id."""
        return next(self._ids)

    def new_actor_id(self, placed: Iterable[int] = ()) -> int:
        """An automatic actor id that no open session and none of ``placed`` uses."""
        in_use = {s.actor_id for s in self.sessions.values()} | set(placed)
        return next(i for i in self._auto_actor_ids if i not in in_use)

    def claim(self, actor_id: int, incarnation: int) -> None:
        """Make ``incarnation`` the newest of ``actor_id``, ending its older sessions; raises
        :class:`Superseded` for an incarnation older than one already seen."""
        newest = self._incarnations.get(actor_id, -1)
        if incarnation < newest:
            raise Superseded(f"actor id {actor_id}: incarnation {incarnation} was superseded by {newest}")
        self._incarnations[actor_id] = incarnation
        while len(self._incarnations) > MAX_INCARNATIONS:
            self._incarnations.pop(next(iter(self._incarnations)))
        for other in list(self.sessions.values()):
            if other.actor_id == actor_id:
                # The same incarnation reconnecting (its old connection may not look dead
                # yet), or a restarted actor: either way the old session ends here, and
                # nothing more from its connections is accepted.
                why = "reconnected" if other.incarnation == incarnation else f"replaced by incarnation {incarnation}"
                other.close(why, lost=True)

    def add(self, session: LearnerSession) -> int | None:
        """Open ``session``, resuming its stream where its incarnation stopped; returns that
        point (None: the first frame says where the stream starts)."""
        resume = self._resume.pop((session.actor_id, session.incarnation), None)
        session.next_seq = resume
        session.resumed = resume is not None
        self.totals.reconnects += session.resumed
        self.sessions[session.id] = session
        return resume

    def remove(self, session: LearnerSession) -> bool:
        """Record that ``session`` ended (its resume point, its row, its totals); False if it
        was not open here."""
        if self.sessions.pop(session.id, None) is None:
            return False
        if session.next_seq is not None:
            self._resume[(session.actor_id, session.incarnation)] = session.next_seq
            while len(self._resume) > MAX_RESUME_POINTS:
                self._resume.popitem(last=False)
        self.ended.append(describe_session(session))
        self.totals.ended(session.actor_id, session.stats, lost=session.state is SessionState.LOST)
        del self.ended[:-MAX_ENDED_ROWS]
        if session.state is not SessionState.CLOSED:  # lost or moved: its actor may come back
            self.last_unclean_end = time.monotonic()
        return True

    def all_done(self, reconnect_timeout: float) -> bool:
        """Every actor that connected has left and none is expected back (see
        ``LearnerServer.actors_done``)."""
        if self.sessions or not self.ended:
            return False
        last = self.last_unclean_end
        return last is None or time.monotonic() - last > reconnect_timeout
