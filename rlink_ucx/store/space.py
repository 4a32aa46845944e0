"""The receive ring's space: which positions each frame holds, and when they come back.

A frame's steps are claimed from the free extents after a cursor (``extents.py``) and given
back when the frame is done with, in whatever order: at once when it is torn or dropped before
any take touched it, else when the take that finished it is released (its steps copied out).
Not thread-safe: the ring calls it under its lock.
"""

from __future__ import annotations

import collections

from .extents import FreeExtents
from .segments import Segment

__all__ = ["RingSpace"]


class RingSpace:
    """Steps in use out of ``capacity``, the cursor the next frame starts from, and the
    segments each unreleased take finished."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0  # steps held by live segments
        self.head = 0  # where the next frame's steps begin (the next free position from here)
        self._free = FreeExtents(capacity)
        self._held: collections.deque[tuple[int, list[Segment]]] = collections.deque()  # take id -> its segments
        self._released_upto = 0  # release() was called for this take id (and earlier ones)

    def claim(self, n: int) -> tuple[int, list[tuple[int, int]] | None]:
        """Room for ``n`` steps: the first's position, and the ``(position, count)`` runs when
        they are several (else None). The caller checks ``used + n <= capacity``."""
        if not self.used:
            self.head = 0  # an empty ring starts over at a chunk boundary
        head = self.head
        self.used += n
        if self._free.take_at(n, head):
            self.head = head + n  # take_at left free steps after them: never the ring's end
            return head, None
        runs = self._free.take(n, head)
        start, count = runs[-1]
        self.head = (start + count) % self.capacity
        return runs[0][0], runs if len(runs) > 1 else None

    def claim_run(self, n: int) -> int | None:
        """Room for ``n`` steps in one run from the cursor (a burst of frames landed side by
        side), or None, claiming nothing, when the free run there is shorter."""
        if not self.used:
            self.head = 0
        head = self.head
        if not self._free.take_at(n, head):
            return None
        self.used += n
        self.head = head + n
        return head

    def give(self, seg: Segment) -> int:
        """Give ``seg``'s space back now; returns the steps freed (0 if given back already)."""
        if seg.released:
            return 0
        seg.released = True
        for start, count in seg.places():
            self._free.give(start, count)
        self.used -= seg.n
        return seg.n

    def finished(self, take_id: int, segs: list[Segment]) -> None:
        """Take ``take_id`` consumed the last steps of ``segs``: free them when it is released."""
        held = self._held
        if held and held[-1][0] >= take_id:  # kept sorted: freed with a later take at worst
            held[-1][1].extend(segs)
        else:
            held.append((take_id, segs))

    def give_after_takes(self, seg: Segment) -> int:
        """``seg`` will not be taken further (dropped as stale): free it once no take still
        copies from it, at once if none does. Returns the steps freed now."""
        if seg.taken_by > self._released_upto:
            self.finished(seg.taken_by, [seg])
            return 0
        return self.give(seg)

    def release(self, take_id: int) -> int:
        """The copies of take ``take_id`` and earlier are done; returns the steps freed."""
        self._released_upto = max(self._released_upto, take_id)
        freed, held = 0, self._held
        lo = hi = 0  # a stretch of consecutive positions freed so far, given back in one call
        while held and held[0][0] <= take_id:
            for seg in held.popleft()[1]:
                if seg.released:
                    continue
                seg.released = True
                freed += seg.n
                for start, count in seg.runs or ((seg.start, seg.n),):
                    if start != hi:
                        if hi > lo:
                            self._free.give(lo, hi - lo)
                        lo = start
                    hi = start + count
        if hi > lo:
            self._free.give(lo, hi - lo)
        self.used -= freed
        return freed
