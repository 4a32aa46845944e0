"""The actor's frames: reusable frame buffers that steps are coalesced into, and borrowed
frames that send a large put straight from the caller's arrays."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np

from ...wire.codec import DTYPES, Schema

__all__ = ["BorrowedFrame", "FrameBuffer", "write_chunk", "write_step"]


class FrameBuffer:
    """A reusable frame of up to ``capacity`` steps: one flat byte array per field, carved
    from ``memory`` (a uint8 array, e.g. from the shm plane's arena) when given."""

    def __init__(self, schema: Schema, capacity: int, memory: Any = None):
        self.capacity = capacity
        self.flat: list[Any]  # uint8 arrays (bytes in a compact copy)
        if memory is None:
            self.flat = [np.empty(capacity * f.step_bytes, dtype=np.uint8) for f in schema.fields]
        else:
            bounds = np.cumsum([0] + [capacity * f.step_bytes for f in schema.fields]).tolist()
            self.flat = [memory[a:b] for a, b in itertools.pairwise(bounds)]
        self.typed = [
            flat.view(DTYPES[f.dtype]).reshape((capacity, *f.shape)) for f, flat in zip(schema.fields, self.flat)
        ]
        self._sizes = [f.step_bytes for f in schema.fields]
        self.n = 0
        self.seq = 0
        self.version = 0
        self.sent = 0
        self.started = 0.0
        self.put_time_us = 0  # wall clock of the first put, for the learner's put->fetch latency
        self.pooled = True  # goes back to the connection's pool once sent (and acknowledged)

    def compact(self, schema: Schema) -> FrameBuffer:
        """A right-sized copy of this frame's steps, outside the pool: a partial frame that
        lingered leaves in it, and this buffer takes the next steps at once (a slow actor would
        otherwise hold one full-size buffer per step until the learner acknowledges it)."""
        # Plain bytes, no numpy arrays: a slow actor makes one of these per step, and on a
        # machine whose caches went cold while it slept each object touched is costly.
        n = self.n
        small = FrameBuffer.__new__(FrameBuffer)
        small.flat = [bytes(memoryview(flat)[: n * sb]) for flat, sb in zip(self.flat, self._sizes)]
        small.typed = []  # it only leaves: never written
        small._sizes, small.capacity = self._sizes, n
        small.n, small.seq, small.version, small.sent, small.started = n, self.seq, self.version, 0, self.started
        small.put_time_us = self.put_time_us
        small.pooled = False
        return small

    def reset(self, seq: int, version: int) -> None:
        self.n, self.seq, self.version, self.sent = 0, seq, version, 0
        self.started = time.monotonic()
        self.put_time_us = time.time_ns() // 1000

    def payload(self, start: int, stop: int) -> list[memoryview]:
        return [memoryview(flat)[start * sb : stop * sb] for flat, sb in zip(self.flat, self._sizes)]


class BorrowedFrame:
    """Steps sent straight from the caller's arrays (large puts): no copy into a frame buffer.

    The caller waits on :attr:`done` before returning, so the arrays are never read after
    ``put`` returns; ``cancelled`` asks the sender to stop at the next sub-frame boundary.
    """

    def __init__(self, arrays: list[Any], n: int, seq: int, version: int):
        self.flat = [memoryview(a).cast("B") for a in arrays]
        self._sizes = [len(f) // n for f in self.flat]
        self.n, self.seq, self.version, self.sent = n, seq, version, 0
        self.put_time_us = time.time_ns() // 1000
        self.done: threading.Event | None = None  # made when handed to the I/O thread
        self.cancelled = False

    def payload(self, start: int, stop: int) -> list[memoryview]:
        return [flat[start * sb : stop * sb] for flat, sb in zip(self.flat, self._sizes)]


def write_step(fb: FrameBuffer, at: int, values: list[Any]) -> None:
    """Write one step's checked ``values`` at row ``at`` of ``fb``."""
    for arr, value in zip(fb.typed, values):
        arr[at] = value


def write_chunk(fb: FrameBuffer, at: int, arrays: list[np.ndarray], src: int, k: int) -> None:
    """Write rows ``[src, src + k)`` of a checked chunk at rows ``[at, at + k)`` of ``fb``."""
    for arr, value in zip(fb.typed, arrays):
        arr[at : at + k] = value[src : src + k]
