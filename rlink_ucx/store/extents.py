"""Which positions of the receive ring are free: sorted, coalesced extents.

The ring frees a frame's space when the frame is done with (taken and copied out, torn, or
dropped as stale), in whatever order that happens, so free space is a set of extents rather than
one gap behind the oldest frame. A frame takes its steps from the extents that follow a cursor
(next-fit, wrapping at the end), in one run while the ring cycles in order and in several around
a frame still arriving: a sender that holds a frame open holds only that frame's steps, never
the space after it.
"""

from __future__ import annotations

import bisect

__all__ = ["FreeExtents"]


class FreeExtents:
    """Free positions of ``[0, capacity)`` as sorted, disjoint, non-adjacent ``[start, end)``
    extents. Not thread-safe: the ring calls it under its lock."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts = [0]
        self._ends = [capacity]
        self.free = capacity  # steps free in all

    def take(self, n: int, cursor: int) -> list[tuple[int, int]]:
        """Claim ``n`` steps, the first at ``cursor`` or the next free position after it
        (wrapping): ``(start, count)`` runs in ring order. The caller checks ``n <= free``."""
        assert 0 < n <= self.free
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(starts, cursor) - 1
        if i < 0 or ends[i] <= cursor:  # cursor is in used space: begin at the next extent
            i = (i + 1) % len(starts)
            cursor = starts[i]
        runs: list[tuple[int, int]] = []
        self.free -= n
        while n:
            start = max(starts[i], cursor) if not runs else starts[i]
            k = min(n, ends[i] - start)
            runs.append((start, k))
            n -= k
            i = self._cut(i, start, start + k)
            if i >= len(starts):
                i = 0
        return runs

    def take_at(self, n: int, cursor: int) -> bool:
        """Claim ``[cursor, cursor + n)`` if it begins a free extent and leaves some of it:
        the ring cycling in order, each frame right after the last (the fast path)."""
        starts = self._starts
        i = bisect.bisect_right(starts, cursor) - 1
        if i < 0 or starts[i] != cursor or self._ends[i] - cursor <= n:
            return False
        starts[i] = cursor + n
        self.free -= n
        return True

    def _cut(self, i: int, lo: int, hi: int) -> int:
        """Remove ``[lo, hi)`` from extent ``i``; returns the index of the extent after it."""
        starts, ends = self._starts, self._ends
        if lo == starts[i]:
            if hi == ends[i]:
                del starts[i], ends[i]
                return i
            starts[i] = hi
            return i + 1
        if hi == ends[i]:
            ends[i] = lo
            return i + 1
        starts.insert(i + 1, hi)  # from the middle: the extent splits in two
        ends.insert(i + 1, ends[i])
        ends[i] = lo
        return i + 2

    def give(self, start: int, n: int) -> None:
        """Free ``[start, start + n)`` (a run taken earlier), joining its neighbours."""
        starts, ends = self._starts, self._ends
        end = start + n
        i = bisect.bisect_left(starts, start)
        joins_next = i < len(starts) and starts[i] == end
        joins_prev = i > 0 and ends[i - 1] == start
        if joins_prev and joins_next:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif joins_prev:
            ends[i - 1] = end
        elif joins_next:
            starts[i] = start
        else:
            starts.insert(i, start)
            ends.insert(i, end)
        self.free += n

    def extents(self) -> list[tuple[int, int]]:
        """The free ``(start, end)`` extents, in order (for tests and diagnostics)."""
        return list(zip(self._starts, self._ends))
