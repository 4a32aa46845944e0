"""Where one session's frame in progress lands (``LearnerSession._land``)."""

from __future__ import annotations

from ...store.ring import Segment, StepRing
from ...wire.frame import FrameHeader


class Landing:
    """The frame between ``begin`` and its commit, and the scratch buffer for a frame that
    cannot be received straight into the ring: one whose plane wants one buffer per field
    (ucx) while its place in the ring wraps or crosses a chunk, or a duplicate whose payload
    is read and dropped. Used under the session's lock; no lock of its own."""

    __slots__ = ("buffer", "frame", "scatter")

    def __init__(self) -> None:
        self.frame: tuple[FrameHeader, Segment | None] | None = None  # None segment: a duplicate
        self.buffer: memoryview | None = None  # kept between frames: one allocation per session
        self.scatter: list[list[memoryview]] | None = None  # the ring's views the buffer goes to on commit

    def _buffer_for(self, size: int) -> memoryview:
        if self.buffer is None or len(self.buffer) < size:
            self.buffer = memoryview(bytearray(size))
        return self.buffer

    def scratch(self, size: int, n_steps: int, ring: StepRing) -> list[memoryview]:
        """Views the payload of a duplicate frame is received into and forgotten."""
        landing, out, offset = self._buffer_for(size), [], 0
        for spec in ring.schema.fields:
            out.append(landing[offset : offset + n_steps * spec.step_bytes])
            offset += n_steps * spec.step_bytes
        return out

    def staged(self, views: list[list[memoryview]], size: int) -> list[memoryview]:
        """One buffer per field, in the scratch buffer, for a frame whose place in the ring is
        ``views``; ``scatter_into_ring`` copies it there on commit."""
        self.scatter = views
        landing = self._buffer_for(size)
        out, offset = [], 0
        for field_views in views:
            n = sum(len(v) for v in field_views)
            out.append(landing[offset : offset + n])
            offset += n
        return out

    def scatter_into_ring(self) -> None:
        assert self.buffer is not None and self.scatter is not None
        offset = 0
        for field_views in self.scatter:
            for view in field_views:
                view[:] = self.buffer[offset : offset + len(view)]
                offset += len(view)
        self.scatter = None

    def drop(self) -> tuple[FrameHeader, Segment | None] | None:
        """Forget the frame in progress and free the buffer (up to a frame's bytes) now: the
        session may sit in a reference cycle with its receiver until the garbage collector's
        next full pass. Returns the frame that was in progress."""
        frame, self.frame = self.frame, None
        self.scatter = self.buffer = None
        return frame
