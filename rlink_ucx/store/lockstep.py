"""On-policy lockstep: one step from each actor, taken outside the ring's FIFO order.

``RLinkDataset.fetch(one_per_actor=True)`` reads the receive ring here: for each actor, its
oldest step not taken yet, once that step's frame is complete (an actor's steps stay in their
order; other actors' frames around it do not matter). It works under the ring's own lock and
with its bookkeeping, as ``StepRing.take`` does: a frame whose last step is taken records the
take, so ``StepRing.release`` frees its space once that take's copy is done, in any order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import Closed
from ..errors import TimeoutError as RLinkTimeout
from .ring import Piece, Segment, StepRing

__all__ = ["take_one_per_actor"]


def take_one_per_actor(ring: StepRing, live: Callable[[], set[int]], timeout: float, min_actors: int = 1,
                       min_version: int = 0, watch: Callable[[], None] | None = None,
                       finished: Callable[[], bool] | None = None) -> tuple[list[Piece], int]:  # fmt: skip
    """Claim the oldest pending step of each actor, outside FIFO order: a step from every
    actor in ``live()`` (the actors connected now), waiting for stragglers until
    ``timeout``; then, if at least ``min_actors`` have one, what is here. Steps of an actor
    that has left but whose steps are here are taken too (they were whole when they came).
    ``watch`` is called, outside the ring's lock, every time the wait wakes (at least every
    0.1 s). ``finished``: a test that no more steps will come (every actor is done); once it
    holds, what is here is taken, and with nothing here :class:`Closed` is raised. Pieces come
    in actor id order. Returns the pieces and a take id for ``ring.release``.

    Raises:
        TimeoutError: fewer than ``min_actors`` actors had a step within ``timeout``.
        Closed: the ring was closed, or ``finished()`` holds and nothing is here.
    """
    started = time.monotonic()
    deadline = started + timeout
    ring.drop_below(min_version)
    while True:
        waiting = live()
        fronts, frames_seen = _actor_fronts(ring)
        have = len(fronts)
        left = deadline - time.monotonic()
        done = finished is not None and finished()
        if have >= max(1, min_actors) and (waiting <= fronts or left <= 0) or have and done:
            return _claim_fronts(ring, started)
        if done:
            raise Closed("every actor has finished; no step remains")
        if left <= 0:
            raise RLinkTimeout(f"fetch timed out after {time.monotonic() - started:.3g}s with a step from {have} "
                               f"actor(s) of {len(waiting | fronts)}, fewer than min_actors={min_actors}")  # fmt: skip
        _wait_commit(ring, frames_seen, min(left, 0.1))  # a commit, or an actor leaving (wake), ends it early
        if watch is not None:
            watch()


def _actor_fronts(ring: StepRing) -> tuple[set[int], int]:
    """The actors with a ready step not taken yet (an actor's oldest untaken step is always in
    a ready frame), and the frames committed so far (for :func:`_wait_commit`)."""
    with ring._lock:
        return set(_fronts_of(ring)), ring.stats.frames_in



def _wait_commit(ring: StepRing, frames_seen: int, timeout: float) -> None:
    """Wait up to ``timeout`` for a frame committed after the first ``frames_seen``."""
    with ring._ready:
        if ring._closed:
            raise Closed("the learner is closed")
        if ring.stats.frames_in != frames_seen:
            return
        ring._waiting_for = 1
        try:
            ring._ready.wait(timeout)
        finally:
            ring._waiting_for = 0



def _claim_fronts(ring: StepRing, started: float) -> tuple[list[Piece], int]:
    """Claim the oldest untaken step of every actor that has one, in actor id order."""
    with ring._lock:
        ring._takes += 1
        take, finished, pieces, fronts = ring._takes, [], [], _fronts_of(ring)
        for seg in (fronts[a] for a in sorted(fronts)):
            chunk, offset, _ = ring._seg_chunks(seg, seg.consumed, 1)[0]
            pieces.append(Piece(chunk * ring.chunk_steps + offset, 1, seg.actor_id, seg.seq + seg.consumed,
                                seg.version, seg.ready_at, seg.put_at))  # fmt: skip
            seg.consumed += 1
            seg.taken_by = take
            if seg.consumed == seg.n:
                finished.append(seg)
        ring.frames.prune()
        if finished:
            ring._space.finished(take, finished)
        ring.stats.wait_seconds += time.monotonic() - started
        ring.stats.steps_out += len(pieces)
        return pieces, take



def _fronts_of(ring: StepRing) -> dict[int, Segment]:
    """Each actor's first ready segment with a step not taken yet (lock held)."""
    fronts: dict[int, Segment] = {}
    for seg in ring.frames.completed:
        if seg.consumed < seg.n and seg.actor_id not in fronts:
            fronts[seg.actor_id] = seg
    return fronts
