"""On-policy lockstep: one step from each actor, taken outside the ring's FIFO order.

``RLinkDataset.fetch(one_per_actor=True)`` reads the receive ring here: for each actor, its
oldest step not taken yet, once that step's frame is complete (an actor's steps stay in their
order; other actors' frames around it do not matter). It works under the ring's own lock and
with its segment bookkeeping, as ``StepRing.take`` does: a segment whose last step is taken
records the take, so ``StepRing.release`` frees the space once that take's copy is done and
every segment before it is freed (space is reused from the front, as always).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import Closed
from ..errors import TimeoutError as RLinkTimeout
from .ring import Piece, Segment, SegState, StepRing

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
    if min_version > ring.min_version:
        with ring._lock:
            ring.min_version = min_version
            dropped = ring._drop_stale()
        if dropped:
            ring._free_front()
    while True:
        waiting = live()
        with ring._ready:
            if ring._closed:
                raise Closed("the learner is closed")
            fronts = _actor_fronts(ring)
            have = len(fronts)
            left = deadline - time.monotonic()
            done = finished is not None and finished()
            if have >= max(1, min_actors) and (waiting <= fronts.keys() or left <= 0) or have and done:
                return _claim_fronts(ring, fronts, started)
            if done:
                raise Closed("every actor has finished; no step remains")
            if left <= 0:
                raise RLinkTimeout(f"fetch timed out after {timeout:.3g}s with a step from {have} actor(s) "
                                   f"of {len(waiting | fronts.keys())}, fewer than min_actors={min_actors}")
            ring._waiting_for = 1  # woken by a commit (or an actor that left: wake())
            try:
                ring._ready.wait(min(left, 0.1))
            finally:
                ring._waiting_for = 0
        if watch is not None:
            watch()


def _actor_fronts(ring: StepRing) -> dict[int, Segment]:
    """Each actor's first segment with a step not taken yet, if it is READY (lock held):
    an actor whose oldest is still arriving has nothing to take (its steps stay in order)."""
    fronts: dict[int, Segment] = {}
    seen: set[int] = set()
    for seg in ring._segments:
        if seg.state is SegState.DEAD or seg.consumed >= seg.n or seg.actor_id in seen:
            continue
        seen.add(seg.actor_id)
        if seg.state is SegState.READY:
            fronts[seg.actor_id] = seg
    return fronts


def _claim_fronts(ring: StepRing, fronts: dict[int, Segment], started: float) -> tuple[list[Piece], int]:
    """Take one step of each segment in ``fronts`` (lock held)."""
    ring.stats.wait_seconds += time.monotonic() - started
    ring._takes += 1
    pieces = []
    for actor_id in sorted(fronts):
        seg = fronts[actor_id]
        pos = (seg.start + seg.consumed) % ring.capacity
        pieces.append(Piece(pos, 1, actor_id, seg.seq + seg.consumed, seg.version, seg.ready_at, seg.put_at))
        seg.consumed += 1
        if seg.consumed == seg.n:
            seg.taken_by = ring._takes
    ring.stats.steps_out += len(pieces)
    return pieces, ring._takes
