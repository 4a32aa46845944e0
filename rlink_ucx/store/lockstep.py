"""On-policy lockstep: one step from each actor, taken outside the ring's FIFO order.

``RLinkDataset.fetch(one_per_actor=True)`` reads the receive ring here: for each actor, its
oldest step not taken yet, once that step's frame is complete (an actor's steps stay in their
order; other actors' frames around it do not matter). The claim itself is the ring's
(``StepRing.claim_fronts``): a frame whose last step is taken records the take, so
``StepRing.release`` frees its space once that take's copy is done, in any order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import Closed
from ..errors import TimeoutError as RLinkTimeout
from .ring import Piece, StepRing

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
        fronts, frames_seen = ring.actor_fronts()
        have = len(fronts)
        left = deadline - time.monotonic()
        done = finished is not None and finished()
        if have >= max(1, min_actors) and (waiting <= fronts or left <= 0) or have and done:
            return ring.claim_fronts(started)
        if done:
            raise Closed("every actor has finished; no step remains")
        if left <= 0:
            raise RLinkTimeout(f"fetch timed out after {time.monotonic() - started:.3g}s with a step from {have} "
                               f"actor(s) of {len(waiting | fronts)}, fewer than min_actors={min_actors}")  # fmt: skip
        ring.wait_commit(frames_seen, min(left, 0.1))  # a commit, or an actor leaving (wake), ends it early
        if watch is not None:
            watch()
