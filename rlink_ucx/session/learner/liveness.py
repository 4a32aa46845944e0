"""The learner's heartbeat round: every session is looked at once per heartbeat interval, a
slice of them at a time.

Looking at all of them on one tick sent a heartbeat to every actor at once: with 1,024 actors
that tick took the I/O loop about 35 ms once a second (docs/benchmarks.md), a send and a GIL
hand-off per actor, which the receiving threads and the consumer waited out (a latency spike
on whatever burst of steps it met). In slices, the same heartbeats go out an eighth at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

__all__ = ["SLICES", "HeartbeatRounds"]

SLICES = 8  # ticks per heartbeat interval; each looks at the sessions of one slice

S = TypeVar("S")


class HeartbeatRounds:
    """Whose turn each tick is, and the lateness each slice is owed.

    A late tick means the learner itself was paused (or its loop blocked): that silence must
    not count against any actor, so each tick's lateness is owed to every slice and handed to
    a slice's sessions on its next turn.
    """

    def __init__(self, slices: int = SLICES):
        self.slices = slices
        self._turn = 0
        self._owed = [0.0] * slices

    def tick(self, late: float) -> tuple[int, float]:
        """The next tick, ``late`` seconds late: the slice whose turn it is and the lateness
        owed to its sessions (which is then paid)."""
        for i in range(self.slices):
            self._owed[i] += late
        turn, self._turn = self._turn, (self._turn + 1) % self.slices
        owed, self._owed[turn] = self._owed[turn], 0.0
        return turn, owed

    def members(self, turn: int, sessions: Iterable[tuple[int, S]]) -> list[S]:
        """The sessions (``(id, session)`` pairs) in slice ``turn``: a session keeps its slice
        for its life, so each is looked at once per round."""
        return [s for sid, s in sessions if sid % self.slices == turn]
