"""The learner's bounded receive ring: frames land here straight from the socket or UCX.

One :class:`StepRing` per schema holds ``capacity`` steps, one flat byte buffer per field.
Frames reserve a contiguous *segment* when their header arrives, the transport writes the
payload directly into the segment's field views (no intermediate copy), and the segment
becomes READY when complete or DEAD when its sender vanished mid-frame (so a torn step is
never yielded). The consumer takes READY steps in arrival order (FIFO, each step once) and
releases the space afterwards, which lets the learner grant more credit.

Memory is bounded by construction: the learner only grants credits while
``used + granted + max_frame_steps <= capacity``; the extra ``max_frame_steps`` absorbs the
one wasted tail that a wrap-around can leave.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._codec import Schema
from ._errors import Closed, ProtocolError
from ._errors import TimeoutError as RLinkTimeout


class SegState(enum.Enum):
    PENDING = 0
    READY = 1
    DEAD = 2


@dataclass(eq=False, slots=True)
class Segment:
    start: int
    n: int
    actor_id: int = 0
    seq: int = 0
    version: int = 0
    state: SegState = SegState.PENDING
    consumed: int = 0
    taken_by: int = 0  # the take() that consumed its last step
    released: bool = False  # that take's copy is finished: the space may be reused


@dataclass(slots=True)
class Piece:
    """``count`` consecutive steps at ring position ``start``, all from one frame."""

    start: int
    count: int
    actor_id: int
    seq: int
    version: int


@dataclass
class RingStats:
    steps_in: int = 0
    steps_out: int = 0
    frames_in: int = 0
    torn_frames: int = 0
    bytes_in: int = 0
    wait_seconds: float = 0.0


class StepRing:
    """A bounded FIFO of steps of one schema, written by the I/O thread, read by fetch()."""

    def __init__(self, schema: Schema, capacity_bytes: int, max_frame_steps: int, *, pin_memory: bool = False):
        import torch

        from ._torch_dtypes import torch_dtype

        self.schema = schema
        self.step_bytes = max(schema.step_bytes, 1)
        self.max_frame_steps = max_frame_steps
        self.capacity = max(capacity_bytes // self.step_bytes, 2 * max_frame_steps)
        self._flat: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []  # typed [capacity, *shape] views, for gathering
        self._bytes: list[memoryview] = []  # raw byte views, for receiving into
        self.host_bytes: list[np.ndarray] = []  # the same bytes as numpy, for CPU gathers
        for spec in schema.fields:
            flat = torch.empty(self.capacity * spec.step_bytes, dtype=torch.uint8, pin_memory=pin_memory)
            self._flat.append(flat)
            self.views.append(flat.view(torch_dtype(spec.dtype)).view(self.capacity, *spec.shape))
            self.host_bytes.append(flat.numpy())
            self._bytes.append(memoryview(self.host_bytes[-1]).cast("B"))
        self._segments: collections.deque[Segment] = collections.deque()
        self._head = 0
        self._used = 0  # steps held by live segments (waste included)
        self._granted = 0  # credit handed out but not yet used by a frame
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._closed = False
        self._takes = 0
        self.stats = RingStats()
        self.on_space_freed: Callable[[], None] | None = None

    # --- credit accounting (I/O thread) ---------------------------------------------------
    def grantable(self) -> int:
        with self._lock:
            return max(0, self.capacity - self._used - self._granted - self.max_frame_steps)

    def grant(self, steps: int) -> None:
        with self._lock:
            self._granted += steps

    def revoke(self, steps: int) -> None:
        """Return unused credit (an actor left)."""
        with self._lock:
            self._granted = max(0, self._granted - steps)

    @property
    def used(self) -> int:
        return self._used

    @property
    def buffered_bytes(self) -> int:
        return self._used * self.step_bytes

    # --- producer side (I/O thread) --------------------------------------------------------
    def reserve(self, n: int, actor_id: int, seq: int, version: int) -> Segment:
        """Claim room for a frame of ``n`` steps; the caller must hold ``n`` credit."""
        if not 0 < n <= self.max_frame_steps:
            raise ProtocolError(f"frame of {n} steps; the limit is {self.max_frame_steps}")
        with self._lock:
            if self._closed:
                raise Closed("the learner is closed")
            start = self._find_room(n)
            if start is None:  # cannot happen while actors respect their credit
                raise ProtocolError("frame exceeds the credit granted to this actor")
            seg = Segment(start, n, actor_id, seq, version)
            self._segments.append(seg)
            self._head = start + n
            self._used += n
            self._granted = max(0, self._granted - n)
            return seg

    def _find_room(self, n: int) -> int | None:
        if not self._segments:
            self._head = 0
            return 0 if n <= self.capacity else None
        tail = self._segments[0].start
        head = self._head
        if head > tail:
            if self.capacity - head >= n:
                return head
            if tail >= n:  # wrap: the unusable tail end becomes a dead "waste" segment
                if self.capacity > head:
                    waste = Segment(head, self.capacity - head, state=SegState.DEAD)
                    self._segments.append(waste)
                    self._used += waste.n
                return 0
            return None
        if head < tail and tail - head >= n:
            return head
        return None

    def field_views(self, seg: Segment) -> list[memoryview]:
        """Raw byte views of the segment, one per field, in schema order, to receive into."""
        views = []
        for spec, raw in zip(self.schema.fields, self._bytes):
            sb = spec.step_bytes
            views.append(raw[seg.start * sb : (seg.start + seg.n) * sb])
        return views

    def commit(self, seg: Segment) -> None:
        with self._ready:
            seg.state = SegState.READY
            self.stats.steps_in += seg.n
            self.stats.frames_in += 1
            self.stats.bytes_in += seg.n * self.schema.step_bytes
            self._ready.notify_all()

    def abandon(self, seg: Segment) -> None:
        """The frame will never complete (its sender died): never yield it."""
        with self._ready:
            if seg.state is SegState.PENDING:
                seg.state = SegState.DEAD
                self.stats.torn_frames += 1
            self._ready.notify_all()
        self._free_front()

    # --- consumer side (fetch) ----------------------------------------------------------------
    def take(self, count: int, timeout: float) -> tuple[list[Piece], int]:
        """Wait until ``count`` steps are ready at the front, then claim them in FIFO order.

        Returns the pieces and a take id; pass the id to :meth:`release` once copied out.
        """
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        with self._ready:
            while True:
                if self._closed:
                    raise Closed("the learner is closed")
                if self._ready_front() >= count:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLinkTimeout(
                        f"fetch timed out after {timeout:.3g}s with {self._ready_front()} of {count} steps ready"
                    )
                self._ready.wait(left)
            self.stats.wait_seconds += time.monotonic() - started
            pieces = []
            need = count
            self._takes += 1
            for seg in self._segments:
                if need == 0:
                    break
                if seg.state is SegState.DEAD:
                    continue
                k = min(need, seg.n - seg.consumed)
                if k:
                    pieces.append(Piece(seg.start + seg.consumed, k, seg.actor_id, seg.seq + seg.consumed, seg.version))
                    seg.consumed += k
                    need -= k
                    if seg.consumed == seg.n:
                        seg.taken_by = self._takes
            self.stats.steps_out += count
            return pieces, self._takes

    def _ready_front(self) -> int:
        total = 0
        for seg in self._segments:
            if seg.state is SegState.PENDING:
                break
            if seg.state is SegState.READY:
                total += seg.n - seg.consumed
        return total

    def ready_steps(self) -> int:
        with self._lock:
            return self._ready_front()

    def release(self, take_id: int) -> None:
        """The copies of take ``take_id`` (and earlier) are done: their space may be reused."""
        with self._lock:
            for seg in self._segments:
                if seg.state is SegState.PENDING:
                    break
                if seg.state is SegState.READY and not seg.taken_by:
                    break  # FIFO: nothing after a not-fully-consumed segment was taken
                if seg.taken_by and seg.taken_by <= take_id:
                    seg.released = True
        self._free_front()

    def _free_front(self) -> None:
        freed = 0
        with self._lock:
            segs = self._segments
            while segs and (segs[0].state is SegState.DEAD or segs[0].released):
                freed += segs.popleft().n
            self._used -= freed
        if freed and self.on_space_freed is not None:
            self.on_space_freed()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()
