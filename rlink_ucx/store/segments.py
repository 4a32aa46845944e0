"""What the receive ring (``ring.py``) keeps about each frame, each piece it hands out, and its counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Piece", "RingStats", "SegState", "Segment", "pieces_of"]


class SegState(enum.Enum):
    PENDING = 0
    READY = 1
    DEAD = 2


@dataclass(eq=False, slots=True)
class Segment:
    """One frame's place in the ring: ``n`` steps from ``start`` on, or in ``runs``."""

    start: int
    n: int
    actor_id: int = 0
    seq: int = 0
    version: int = 0
    state: SegState = SegState.PENDING
    consumed: int = 0
    taken_by: int = 0  # the last take() that consumed steps of it
    released: bool = False  # its space was given back (taken and copied out, torn or dropped)
    placed_at: float = 0.0  # time.monotonic() when its header came and it took its place (0: landed whole)
    ready_at: float = 0.0  # time.monotonic() when it became READY (for the latency metric)
    put_at: float = 0.0  # the actor's wall clock when its first step was put (seconds; 0: unknown)
    # Its (ring position, steps) runs in step order when it lies in several (around frames
    # still arriving, or across the ring's end); None for one run, [start, start + n).
    runs: list[tuple[int, int]] | None = None

    def places(self) -> list[tuple[int, int]]:
        """Its ``(ring position, steps)`` runs, in step order."""
        return self.runs if self.runs is not None else [(self.start, self.n)]


@dataclass(slots=True)
class Piece:
    """``count`` consecutive steps at ring position ``start``, from one frame and one chunk."""

    start: int
    count: int
    actor_id: int
    seq: int
    version: int
    ready_at: float = 0.0  # when its frame landed (time.monotonic())
    put_at: float = 0.0  # when its frame's first step was put (the actor's time.time())


@dataclass
class RingStats:
    steps_in: int = 0
    steps_out: int = 0
    frames_in: int = 0
    torn_frames: int = 0
    bytes_in: int = 0
    wait_seconds: float = 0.0
    stale_dropped: int = 0  # steps dropped for being older than min_version
    peak_used: int = 0  # most steps ever held at once: how close the learner came to its cap


def pieces_of(seg: Segment, at: int, runs: list[tuple[int, int, int]], chunk_steps: int) -> list[Piece]:
    """The pieces of ``seg``'s steps from ``at`` on that lie in ``runs`` (``(chunk, offset,
    count)``, in step order)."""
    pieces, seq = [], seg.seq + at
    for chunk, offset, m in runs:
        pieces.append(Piece(chunk * chunk_steps + offset, m, seg.actor_id, seq, seg.version, seg.ready_at, seg.put_at))
        seq += m
    return pieces
