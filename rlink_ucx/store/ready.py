"""Which complete frames of the receive ring (``ring.py``) a take gets, and in what order.

A take gets the first untaken steps in *ring order* when every frame holding them is complete:
consecutive ring positions, so a batch that is one chunk is lent without a copy. Otherwise it
gets them in the order their frames *completed*, so that a frame still arriving holds back no
other (docs/architecture.md, "No head-of-line blocking"). A take waits for a frame ahead of it
only while that frame is young, begun less than ``IN_ORDER_GRACE`` ago: frames read from several
connections at once complete a little out of order all the time, and without the wait most
batches were copied (4 actors x 64 KiB over tcp lost 10-20%, docs/benchmarks.md). Each actor's
frames come in its order either way: a session has one frame open at a time, placed after its
previous one completed. Not thread-safe: the ring calls it under its lock.
"""

from __future__ import annotations

import collections
import time

from .segments import Segment, SegState

__all__ = ["IN_ORDER_GRACE", "ReadyFrames"]

IN_ORDER_GRACE = 0.002  # seconds a take waits for a young frame ahead of it in ring order
_COMPACT_MIN = 1024
_DEAD, _PENDING, _READY = SegState.DEAD, SegState.PENDING, SegState.READY


class ReadyFrames:
    """The ring's live frames in the order they were placed, and its complete ones in the
    order they completed."""

    def __init__(self) -> None:
        self.completed: collections.deque[Segment] = collections.deque()  # READY, in completion order
        self._placed: collections.deque[Segment] = collections.deque()  # live, in ring order
        self._compact_at = _COMPACT_MIN  # forget dead frames behind the front at this length

    def placed(self, seg: Segment) -> None:
        placed = self._placed
        placed.append(seg)
        if len(placed) >= self._compact_at:
            # Torn and taken frames leave from the front only; behind a front nobody takes
            # (no fetch yet) they would pile up, one per frame ever torn. Amortised O(1).
            self._placed = collections.deque(self._live())
            self._compact_at = max(_COMPACT_MIN, 2 * len(self._placed))

    def complete(self, seg: Segment) -> None:
        self.completed.append(seg)

    def landed(self, segs: list[Segment]) -> None:
        """Frames placed and completed at once, in this order (``block.py``)."""
        self._placed.extend(segs[:-1])  # placed() for each but the last, without its compaction check
        if segs:
            self.placed(segs[-1])
        self.completed.extend(segs)

    def count(self, enough: int | None = None) -> int:
        """Steps ready to take, counted up to ``enough`` (all when None): a backlog of many
        small frames (hundreds of actors) is not walked whole on every take."""
        total = 0
        for seg in self.completed:
            total += seg.n - seg.consumed
            if enough is not None and total >= enough:
                break
        return total

    def first_untaken(self) -> Segment | None:
        return next((s for s in self.completed if s.consumed < s.n), None)

    def young_ahead(self, need: int) -> tuple[float, Segment | None]:
        """A frame still arriving among the first ``need`` untaken steps in ring order that
        began less than ``IN_ORDER_GRACE`` ago, and the seconds left of its grace; else (0, None)."""
        total = 0
        for seg in self._placed:  # the frames of _live(), without a generator: a take walks hundreds
            state, untaken = seg.state, seg.n - seg.consumed
            if state is _DEAD or untaken <= 0:
                continue
            if state is _PENDING:
                left = seg.placed_at + IN_ORDER_GRACE - time.monotonic()
                return (left, seg) if left > 0 else (0.0, None)
            total += untaken
            if total >= need:
                break
        return 0.0, None

    def order_for(self, need: int) -> collections.deque[Segment]:
        """The frames a take of ``need`` steps reads from, first to last: in ring order when
        those are all complete, else in completion order."""
        frames: collections.deque[Segment] = collections.deque()
        total = 0
        for seg in self._placed:  # as in young_ahead
            state, untaken = seg.state, seg.n - seg.consumed
            if state is _DEAD or untaken <= 0:
                continue
            if state is not _READY:
                return self.completed
            frames.append(seg)
            total += untaken
            if total >= need:
                return frames
        return self.completed

    def prune(self) -> None:
        """Forget fully taken frames at the front of both orders (after a take)."""
        for frames in (self.completed, self._placed):
            while frames and ((seg := frames[0]).state is _DEAD or seg.consumed >= seg.n):
                frames.popleft()

    def _live(self) -> collections.abc.Iterator[Segment]:
        """Frames in ring order that still hold untaken steps (torn ones hold none)."""
        return (s for s in self._placed if s.state is not _DEAD and s.consumed < s.n)  # the rule young_ahead and order_for inline
