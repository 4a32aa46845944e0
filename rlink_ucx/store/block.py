"""Many whole frames landed in the receive ring at once (``StepRing.land_block``, ``land_many``).

A pump's pass brings one small frame from each of hundreds of actors. Landed one by one, each
costs a claim of ring space, a copy per field and the bookkeeping of a frame, all in the
interpreter: most of the learner's CPU per frame. Frames of the same number of steps land
here as one *block*: one claim of ring space for all of them, side by side from the cursor,
and one numpy copy per field and ring chunk, whatever their number. Each is still a frame of
its own in the ring (a ``Segment``: its actor, seq, version and put time for the takes), made
in one tight loop. Called by the ring with its lock held.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..errors import Closed, ProtocolError
from .segments import Segment, SegState

# ``ring`` below is the ``StepRing`` that calls in, its lock held (not imported: it imports this).
StepRing = Any
__all__ = ["land_block_locked", "land_each_locked"]

_READY = SegState.READY


def land_block_locked(ring: StepRing, n_steps: int, actor_ids: list[int], seqs: list[int], versions: list[int],
                      put_at: list[float], payload: np.ndarray) -> int | None:  # fmt: skip
    """Frames of ``n_steps`` steps each, frame ``i`` from ``actor_ids[i]`` and so on, whose
    payloads are the rows of ``payload`` (uint8, one row of ``n_steps * step_bytes`` a frame,
    each field's bytes one after another as on the wire). Lands them side by side from the
    ring's cursor and returns the steps freed (frames older than ``min_version``, dropped at
    once); None, landing nothing, when there is no such run of free space (the caller lands
    them one by one). Raises :class:`Closed` once the ring is closed."""
    if ring._closed:
        raise Closed("the learner is closed")
    count = len(actor_ids)
    total = count * n_steps
    if not 0 < n_steps <= ring.max_frame_steps or payload.shape != (count, n_steps * ring.schema.step_bytes):
        raise ProtocolError(f"a block of {count} frames of {n_steps} steps with payload {payload.shape}")
    space = ring._space
    if space.used + total > ring.capacity:
        return None
    start = space.claim_run(total)
    if start is None:
        return None
    _copy_fields(ring, start, n_steps, payload)
    now = time.monotonic()
    segs = [Segment(start + i * n_steps, n_steps, a, q, v, _READY, 0, 0, False, 0.0, now, p)
            for i, (a, q, v, p) in enumerate(zip(actor_ids, seqs, versions, put_at))]  # fmt: skip
    ring.frames.landed(segs)
    stats = ring.stats
    stats.steps_in += total
    stats.frames_in += count
    stats.bytes_in += total * ring.schema.step_bytes
    stats.peak_used = max(stats.peak_used, space.used)
    ring._granted = max(0, ring._granted - total)
    freed = 0
    if ring.min_version and min(versions) < ring.min_version:  # rare: a burst of frames already stale
        freed = sum(ring._drop(seg) for seg in segs if seg.version < ring.min_version)
    return freed


def _copy_fields(ring: StepRing, start: int, n_steps: int, payload: np.ndarray) -> None:
    """Each field's columns of ``payload`` into the ring from position ``start`` on: one copy
    per field and chunk the block touches."""
    count = payload.shape[0]
    runs = ring._split(start, count * n_steps)
    col = 0
    for f, sb in enumerate(ring._sizes):
        width = n_steps * sb
        field = payload[:, col : col + width]  # frame i's steps of this field, which lie side by side in the ring
        col += width
        if len(runs) == 1:
            chunk, offset, k = runs[0]
            ring.chunks[chunk][f][offset * sb : (offset + k) * sb].reshape(count, width)[:] = field
            continue
        flat = np.ascontiguousarray(field).reshape(-1)  # a frame may straddle two chunks
        done = 0
        for chunk, offset, k in runs:
            ring.chunks[chunk][f][offset * sb : (offset + k) * sb] = flat[done * sb : (done + k) * sb]
            done += k


def land_each_locked(ring: StepRing, frames: list[tuple[int, int, int, int, float, memoryview]]) -> tuple[list[tuple[int, Exception]], int]:
    """Whole frames ``(n, actor_id, seq, version, put_at, payload)`` one by one (``StepRing.land_many``):
    a frame the ring refuses does not stop the others. Returns ``(index, error)`` for each one
    refused, and the steps freed."""
    refused: list[tuple[int, Exception]] = []
    freed = 0
    for i, (n, actor_id, seq, version, put_at, payload) in enumerate(frames):
        try:
            freed += ring._land_locked(n, actor_id, seq, version, put_at, payload, wake=False)
        except (ProtocolError, Closed) as exc:
            refused.append((i, exc))
    return refused, freed
