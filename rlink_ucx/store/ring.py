"""The learner's bounded receive ring: frames land here straight from the socket or UCX.

One :class:`StepRing` per schema holds ``capacity`` steps in ``capacity / chunk_steps``
*chunks*; each chunk holds ``chunk_steps`` steps of every field as one flat byte buffer per
field. Frames reserve a *segment* of ring positions when their header arrives (from a cursor
that cycles around the ring: consecutive positions while frames come and go in order), the
transport writes the payload directly into the segment's views (no intermediate copy), and the
segment becomes READY when complete or DEAD when its sender vanished mid-frame (a torn step is
never yielded). The consumer takes READY steps in the order their frames *completed* (an
actor's frames complete in its order) and releases the space afterwards, in any order
(``extents.py``): a frame still arriving holds its own steps only, so a slow or trickling
sender delays nobody but itself (docs/architecture.md, "No head-of-line blocking").

When the chunk size equals the dataset's batch size, a batch that is exactly one chunk is
*lent* to the caller without a copy: the chunk's buffers become the batch tensors and a pooled
(or new) chunk takes their place in the ring, so a batch the user keeps never blocks the ring.

Memory is bounded by construction: the learner only grants credits while
``used + granted <= capacity``.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from .._memory import Reserve
from ..errors import Closed, ProtocolError
from ..errors import TimeoutError as RLinkTimeout
from ..wire.codec import Schema
from . import block
from .payload import copy_whole, fields_of, slices
from .ready import ReadyFrames
from .segments import Piece, RingStats, Segment, SegState, pieces_of
from .space import RingSpace

__all__ = ["Piece", "RingStats", "SegState", "Segment", "StepRing"]

_POOL_CHUNKS = 4  # spare chunks kept for lending (more are freed)
_MAX_CHUNKS = 256


def _split(start: int, n: int, capacity: int, chunk_steps: int) -> list[tuple[int, int, int]]:
    """Positions ``[start, start + n)`` of a ring of ``capacity`` as ``(chunk, offset, count)`` runs."""
    runs = []
    pos = start % capacity
    while n:
        chunk, offset = divmod(pos, chunk_steps)
        k = min(n, chunk_steps - offset)
        runs.append((chunk, offset, k))
        n -= k
        pos = (pos + k) % capacity
    return runs


def _runs_of(runs: list[tuple[int, int]], skip: int, count: int, capacity: int,
             chunk_steps: int) -> list[tuple[int, int, int]]:  # fmt: skip
    """Steps ``[skip, skip + count)`` of a frame held in ``runs`` (``Segment.runs``) as
    ``(chunk, offset, count)`` runs."""
    out = []
    for start, k in runs:
        if skip >= k:
            skip -= k
            continue
        m = min(k - skip, count)
        out += _split(start + skip, m, capacity, chunk_steps)
        count -= m
        skip = 0
        if not count:
            break
    return out


def _reclaim(lent: list[list[np.ndarray]], pool: list[list[np.ndarray]], reserved: set[int]) -> list[list[np.ndarray]]:
    """Move the chunks of ``lent`` nobody references any more to ``pool``; returns the rest."""
    still = []
    for arrays in lent:
        # Tensors made from an array (and their views) keep it referenced through their
        # storage; 3 = the list slot, the loop variable and getrefcount's argument.
        if any(sys.getrefcount(a) > 3 for a in arrays):
            still.append(arrays)
        elif len(pool) < _POOL_CHUNKS or id(arrays) in reserved:
            # A chunk carved from a reserve is kept whatever the pool's size: dropping it
            # would free nothing (the reserve stays mapped) and the next spare would come
            # from fresh memory.
            pool.append(arrays)
    return still


class StepRing:
    """A bounded queue of steps of one schema, written by the I/O threads, read by fetch()."""

    def __init__(self, schema: Schema, capacity_bytes: int, max_frame_steps: int, *,
                 chunk_steps: int | None = None, pin_memory: bool = False,
                 reserve: Reserve | None = None):  # fmt: skip
        self.schema = schema
        self.step_bytes = max(schema.step_bytes, 1)
        self.max_frame_steps = max_frame_steps
        wanted = max(capacity_bytes // self.step_bytes, 2 * max_frame_steps)
        chunk = max(1, chunk_steps or max_frame_steps)
        if wanted // chunk > _MAX_CHUNKS:  # tiny batches: lending saves little, many chunks cost
            chunk = max(max_frame_steps, -(-wanted // _MAX_CHUNKS))
        self.chunk_steps = chunk
        wanted = max(wanted, 2 * max_frame_steps + chunk)
        self.capacity = max(2, -(-wanted // chunk)) * chunk
        self._sizes = [spec.step_bytes for spec in schema.fields]
        self._pin_memory = pin_memory
        # Chunks (and the spares lending swaps in) come from populated memory: the learner's
        # reserve, made when it started, and one made here for what does not fit in it.
        self._reserves: list[Reserve] = []
        self._reserved: set[int] = set()  # ids of the chunks (lists) carved from the reserves
        if not pin_memory:  # pinned chunks are allocated (and so populated) by CUDA
            chunk_bytes = sum(-(-chunk * sb // 64) * 64 for sb in self._sizes)
            short = (self.capacity // chunk + _POOL_CHUNKS) * chunk_bytes - (reserve.free if reserve else 0)
            self._reserves = [r for r in (reserve, Reserve(short, "ring") if short > 0 else None) if r is not None]
        self.chunks: list[list[np.ndarray]] = [self._new_chunk() for _ in range(self.capacity // chunk)]
        self._pool: list[list[np.ndarray]] = []  # spare chunks, ready to swap in
        self._lent: list[list[np.ndarray]] = []  # chunks handed out as batches
        self._space = RingSpace(self.capacity)
        self.frames = ReadyFrames()  # which complete frames a take gets, in what order
        self._granted = 0  # credit handed out but not yet used by a frame
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._closed = False
        self._takes = 0
        self._waiting_for = 0  # steps the blocked consumer needs (0: nobody waits)
        self._waiting_on: Segment | None = None  # or the young frame it waits for (ready.py)
        self.stats = RingStats()
        self.min_version = 0  # READY steps of an older behaviour version are dropped, not yielded
        self.on_space_freed: Callable[[], None] | None = None

    def _new_chunk(self) -> list[np.ndarray]:
        if self._pin_memory:
            import torch

            return [torch.empty(self.chunk_steps * sb, dtype=torch.uint8, pin_memory=True).numpy() for sb in self._sizes]
        arrays = [self._empty(self.chunk_steps * sb) for sb in self._sizes]
        if all(a is not None for a in arrays):
            self._reserved.add(id(arrays))  # kept for good (see _reclaim): never dropped, so the id stays its own
            return arrays  # type: ignore[return-value]
        return [np.empty(self.chunk_steps * sb, dtype=np.uint8) for sb in self._sizes]

    def _empty(self, nbytes: int) -> np.ndarray | None:
        for reserve in self._reserves:
            out = reserve.take(nbytes)
            if out is not None:
                return out
        return None

    # --- credit accounting (I/O thread) ---------------------------------------------------
    def grantable(self) -> int:
        with self._lock:
            return max(0, self.capacity - self._space.used - self._granted)

    def grant(self, steps: int) -> None:
        with self._lock:
            self._granted += steps

    def revoke(self, steps: int) -> None:
        """Return unused credit (an actor left)."""
        with self._lock:
            self._granted = max(0, self._granted - steps)

    @property
    def used(self) -> int:
        return self._space.used

    @property
    def buffered_bytes(self) -> int:
        return self._space.used * self.step_bytes

    # --- producer side (I/O thread) --------------------------------------------------------
    def reserve(self, n: int, actor_id: int, seq: int, version: int, put_at: float = 0.0) -> Segment:
        """Claim room for a frame of ``n`` steps; the caller must hold ``n`` credit."""
        placed_at = time.monotonic()
        with self._lock:
            seg = self._reserve_locked(n, actor_id, seq, version, put_at)
            seg.placed_at = placed_at
            return seg

    def _reserve_locked(self, n: int, actor_id: int, seq: int, version: int, put_at: float) -> Segment:
        if not 0 < n <= self.max_frame_steps:
            raise ProtocolError(f"frame of {n} steps; the limit is {self.max_frame_steps}")
        if self._closed:
            raise Closed("the learner is closed")
        space = self._space
        if space.used + n > self.capacity:  # cannot happen while actors respect their credit
            raise ProtocolError("frame exceeds the credit granted to this actor")
        start, runs = space.claim(n)
        seg = Segment(start, n, actor_id, seq, version, put_at=put_at, runs=runs)
        self.frames.placed(seg)
        self.stats.peak_used = max(self.stats.peak_used, space.used)
        self._granted = max(0, self._granted - n)
        return seg

    def land(self, n: int, actor_id: int, seq: int, version: int, put_at: float,
             payload: memoryview | list[memoryview]) -> None:  # fmt: skip
        """A whole frame of ``n`` steps whose payload is in hand: reserve, copy and commit it in
        one hold of the lock (``reserve``, a copy into ``field_views`` and ``commit`` cost a
        small frame three times as much). ``payload``: each field's bytes, one field after
        another, in one buffer or in several (one per field is copied from directly)."""
        with self._ready:
            freed = self._land_locked(n, actor_id, seq, version, put_at, payload)
        if freed:
            self._space_freed()

    def land_many(self, frames: list[tuple[int, int, int, int, float, memoryview]]) -> list[tuple[int, Exception]]:
        """Whole frames ``(n, actor_id, seq, version, put_at, payload)``, as :meth:`land` takes
        them, in one hold of the lock: a pump's burst from many actors. A frame the ring
        refuses does not stop the others; returns ``(index, error)`` for each one refused."""
        with self._ready:
            refused, freed = block.land_each_locked(self, frames)
            self._wake_consumer(None)  # once for the burst: the consumer cannot run before it ends anyway
        if freed:
            self._space_freed()
        return refused

    def land_block(self, n_steps: int, actor_ids: list[int], seqs: list[int], versions: list[int],
                   put_at: list[float], payload: np.ndarray) -> bool:  # fmt: skip
        """Whole frames of ``n_steps`` steps each, side by side, payloads the rows of ``payload``
        (``block.land_block_locked``); False, landing none, where free space is not one run."""
        with self._ready:
            freed = block.land_block_locked(self, n_steps, actor_ids, seqs, versions, put_at, payload)
            if freed is not None:
                self._wake_consumer(None)
        if freed:
            self._space_freed()
        return freed is not None

    def _land_locked(self, n: int, actor_id: int, seq: int, version: int, put_at: float,
                     payload: memoryview | list[memoryview], *, wake: bool = True) -> int:  # fmt: skip
        """:meth:`land` with the lock held; returns the steps freed (see ``_commit_locked``)."""
        if isinstance(payload, list) and len(payload) == 1:
            payload = payload[0]  # one buffer of every field's bytes (an shm ring frame): no join
        parts = fields_of(payload, n, self._sizes)  # None: one buffer, the frame's size (checked)
        seg = self._reserve_locked(n, actor_id, seq, version, put_at)
        chunk, offset = divmod(seg.start, self.chunk_steps)
        if parts is None and seg.runs is None and offset + n <= self.chunk_steps:  # almost always
            copy_whole(self.chunks[chunk], self._sizes, offset, n, cast(memoryview, payload))
        else:
            parts = parts or slices(cast(memoryview, payload), n, self._sizes)
            runs = self._seg_chunks(seg, 0, n)  # once: the same for every field
            for f, (sb, src) in enumerate(zip(self._sizes, parts)):
                at = 0
                for c, o, k in runs:
                    self.chunks[c][f].data[o * sb : (o + k) * sb] = src[at : at + k * sb]
                    at += k * sb
        return self._commit_locked(seg, time.monotonic(), wake=wake)

    def _split(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """Ring positions ``[start, start + n)`` as ``(chunk, offset, count)`` runs."""
        return _split(start, n, self.capacity, self.chunk_steps)

    def _seg_chunks(self, seg: Segment, skip: int, count: int) -> list[tuple[int, int, int]]:
        """Steps ``[skip, skip + count)`` of ``seg`` as ``(chunk, offset, count)`` runs."""
        if seg.runs is None:
            return self._split(seg.start + skip, count)
        return _runs_of(seg.runs, skip, count, self.capacity, self.chunk_steps)

    def field_views(self, seg: Segment) -> list[list[memoryview]]:
        """Raw byte views of the segment: per field (schema order), one view per chunk run."""
        runs = self._seg_chunks(seg, 0, seg.n)
        views = []
        for f, sb in enumerate(self._sizes):
            views.append([self.chunks[c][f].data[o * sb : (o + k) * sb] for c, o, k in runs])
        return views

    def piece_bytes(self, field: int, piece: Piece) -> np.ndarray:
        """The bytes of one field for a piece (which never crosses a chunk)."""
        chunk, offset = divmod(piece.start, self.chunk_steps)
        sb = self._sizes[field]
        return self.chunks[chunk][field][offset * sb : (offset + piece.count) * sb]

    def lend_chunk(self, pieces: list[Piece], replacement: list[np.ndarray] | None = None) -> list[np.ndarray] | None:
        """If ``pieces`` are exactly one whole chunk, hand its buffers out and put a spare
        chunk in its place (the caller releases the take as usual); else None.

        ``replacement``: the buffers to put in its place instead (one flat uint8 array of
        ``chunk_steps * step_bytes`` per field); the chunk handed out is then its new owner's
        for good, not taken back for reuse. A replay gives its own free table rows this way."""
        if not pieces or pieces[0].start % self.chunk_steps or sum(p.count for p in pieces) != self.chunk_steps:
            return None
        for a, b in itertools.pairwise(pieces):
            if a.start + a.count != b.start:
                return None
        chunk = pieces[0].start // self.chunk_steps
        with self._lock:
            if replacement is not None:
                lent, self.chunks[chunk] = self.chunks[chunk], replacement
                return lent
            self._reclaim()
            spare = self._pool.pop() if self._pool else self._new_chunk()
            lent, self.chunks[chunk] = self.chunks[chunk], spare
            self._lent.append(lent)
        return lent

    def _reclaim(self) -> None:
        """Move lent chunks nobody references any more back to the pool (lock held)."""
        self._lent = _reclaim(self._lent, self._pool, self._reserved)

    def commit(self, seg: Segment) -> None:
        ready_at = time.monotonic()  # read before taking the lock, to keep the critical section short
        with self._ready:
            freed = self._commit_locked(seg, ready_at)
        if freed:
            self._space_freed()

    def _commit_locked(self, seg: Segment, ready_at: float, *, wake: bool = True) -> int:
        """``seg`` is complete (lock held); returns the steps freed because it was dropped as
        too stale (the caller then says so, outside the lock). ``wake``: wake the consumer if
        its batch is complete now (else the caller calls ``_wake_consumer`` once for many)."""
        if seg.state is not SegState.PENDING:
            return 0  # abandoned meanwhile: its space is another frame's already
        seg.state = SegState.READY
        seg.ready_at = ready_at
        self.frames.complete(seg)
        stats = self.stats
        stats.steps_in += seg.n
        stats.frames_in += 1
        stats.bytes_in += seg.n * self.schema.step_bytes
        freed = self._drop(seg) if seg.version < self.min_version else 0
        if wake:
            self._wake_consumer(seg)
        return freed

    def _wake_consumer(self, seg: Segment | None) -> None:
        """Wake the consumer only once its batch can be complete (lock held; ``seg``: the
        frame just completed, None after a burst): one wake-up per batch, not per frame (each
        costs a thread switch and a GIL hand-off)."""
        if (seg is not None and seg is self._waiting_on) or (
            self._waiting_for and self.frames.count(self._waiting_for) >= self._waiting_for
        ):
            self._ready.notify_all()

    def _drop(self, seg: Segment) -> int:
        """Never yield the rest of ``seg`` (too stale); lock held. Its space is reused once no
        take still copies from it: at once if none does, else with the last take that did.
        Returns the steps freed now."""
        self.stats.stale_dropped += seg.n - seg.consumed
        seg.consumed = seg.n
        return self._space.give_after_takes(seg)

    def _drop_stale(self) -> int:
        old = [s for s in self.frames.completed if s.consumed < s.n and s.version < self.min_version]
        return sum(self._drop(seg) for seg in old)

    def abandon(self, seg: Segment) -> None:
        """The frame will never complete (its sender died): never yield it, and give its space
        back now (nothing writes into it any more)."""
        freed = 0
        with self._ready:
            if seg.state is SegState.PENDING:
                seg.state = SegState.DEAD
                self.stats.torn_frames += 1
                freed = self._space.give(seg)
            self._ready.notify_all()
        if freed:
            self._space_freed()

    # --- consumer side (fetch) ----------------------------------------------------------------
    def take(self, count: int, timeout: float, min_version: int = 0, *,
             finished: Callable[[], bool] | None = None, partial: bool = True) -> tuple[list[Piece], int]:  # fmt: skip
        """Wait until ``count`` steps are ready, then claim them in the order their frames
        completed (a frame still arriving holds back no other). Steps of a behaviour version
        below ``min_version`` are dropped (and counted) instead. ``finished``: a test that no
        more steps will come (every actor is done); once it holds, what is ready is taken even
        if short of ``count`` (unless not ``partial``), and with nothing to take :class:`Closed`
        is raised. Returns the pieces and a take id; pass the id to :meth:`release` once copied out.
        """
        started = time.monotonic()
        deadline = started + timeout
        self.drop_below(min_version)
        with self._ready:
            while True:
                if self._closed:
                    raise Closed("the learner is closed")
                ready = self.frames.count(count)
                young, frame = self.frames.young_ahead(count) if ready >= count else (0.0, None)  # ready.py
                if (ready >= count and frame is None) or (frame is not None and time.monotonic() >= deadline):
                    break
                if ready < count and finished is not None and finished():
                    if not ready or not partial:
                        raise Closed(f"every actor has finished; {ready} steps remain, fewer than {count}")
                    count = ready
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLinkTimeout(f"{ready} of {count} steps ready")  # the caller says how long it waited
                self._waiting_for, self._waiting_on = (0, frame) if frame else (count, None)
                try:
                    # With a finished test, look again now and then: an actor that crashed is
                    # given up on by the clock, not by an event.
                    self._ready.wait(min(left, young or (left if finished is None else 0.5)))
                finally:
                    self._waiting_for, self._waiting_on = 0, None
            self.stats.wait_seconds += time.monotonic() - started
            self.stats.steps_out += count
            return self._claim(count), self._takes

    def _claim(self, need: int) -> list[Piece]:
        """The next ``need`` READY steps, in ring order or in completion order (``ready.py``);
        lock held."""
        pieces: list[Piece] = []
        self._takes += 1
        take, finished = self._takes, []
        chunk_steps = self.chunk_steps
        segs = self.frames.order_for(need)
        while need and segs:
            seg = segs[0]
            at, n = seg.consumed, seg.n
            k = min(need, n - at)
            if k:
                pos = seg.start + at
                if seg.runs is None and pos % chunk_steps + k <= chunk_steps:  # one piece: most frames
                    pieces.append(Piece(pos, k, seg.actor_id, seg.seq + at, seg.version, seg.ready_at, seg.put_at))
                else:
                    pieces += pieces_of(seg, at, self._seg_chunks(seg, at, k), chunk_steps)
                seg.consumed = at = at + k
                seg.taken_by = take
                need -= k
                if at == n:
                    finished.append(seg)
            if at == n:
                segs.popleft()
        self.frames.prune()
        if finished:
            self._space.finished(take, finished)
        return pieces

    def drop_below(self, min_version: int) -> None:
        """Raise the ring's ``min_version``: ready steps of older behaviour versions are dropped."""
        with self._lock:
            self.min_version, raised = max(self.min_version, min_version), min_version > self.min_version
            freed = self._drop_stale() if raised else 0
        if freed:
            self._space_freed()

    def ready_steps(self) -> int:
        with self._lock:
            return self.frames.count()

    def wait_ready(self, count: int, timeout: float, finished: Callable[[], bool] | None = None) -> tuple[int, int]:
        """Wait until ``count`` steps are ready at the front, ``timeout`` passes or ``finished()``
        holds, claiming nothing. Returns the steps ready then and the ring position of the
        first of them (of the next step to arrive when none is)."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while not self._closed and self.frames.count(count) < count and not (finished is not None and finished()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._waiting_for = count
                try:
                    self._ready.wait(left if finished is None else min(left, 0.5))
                finally:
                    self._waiting_for = 0
            if self._closed:
                raise Closed("the learner is closed")
            first = self.frames.first_untaken()
            if first is None:
                return 0, self._space.head if self._space.used else 0
            chunk, offset, _ = self._seg_chunks(first, first.consumed, 1)[0]
            return self.frames.count(), chunk * self.chunk_steps + offset

    def release(self, take_id: int) -> None:
        """The copies of take ``take_id`` (and earlier) are done: their space may be reused."""
        with self._lock:
            freed = self._space.release(take_id)
        if freed:
            self._space_freed()

    def _space_freed(self) -> None:
        """Steps were freed: tell the credit granter (never under the lock)."""
        if self.on_space_freed is not None:
            self.on_space_freed()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for reserve in self._reserves:
            reserve.close()

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()
