"""The actor's step writer: ``put`` and ``put_many`` copy steps into frame buffers, and the
send policy (``policy.py``) lets each frame go: a partial frame leaves at once when the I/O
side is idle, otherwise it waits for company, at most about ``Config.frame_linger``. A put of
a whole frame or more is sent straight from the caller's arrays."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...config import Config
from ...errors import Backpressure, Closed, SchemaMismatch
from ...transport.loop import IOThread
from ...wire import messages as _wire
from ...wire.codec import Schema, infer_schema
from .fields import Field, accepted_schema, check_chunk, check_value, raise_extra
from .frames import BorrowedFrame, FrameBuffer, write_chunk, write_step
from .link import ActorConnection
from .policy import Left, SendPolicy, Why

__all__ = ["StepWriter"]


class StepWriter:
    """Coalesces one actor's steps into frames (any caller thread; one lock).

    Args:
        link: the connection; the writer uses its ``state`` (read only), ``outbox`` (frame
            pool, acknowledgements), ``connector`` (schema proposals) and ``attach`` (the
            memory of new frame buffers).
        io: the I/O thread (schema negotiation, the linger timer).
        config: sizes and timeouts.
    """

    def __init__(self, link: ActorConnection, io: IOThread, config: Config):
        self._state = link.state
        self._outbox = link.outbox
        self._connector = link.connector
        self._attach = link.attach
        self._policy = SendPolicy(link.state, link.outbox)
        self._io = io
        self.config = config
        self._closed = False
        self.policy_version = 0  # stamped on steps put without an explicit version
        self._lock = threading.Lock()
        self._current: FrameBuffer | None = None
        # The linger timer runs only while a partial frame may be waiting: armed by a step that
        # starts a frame and could not leave at once, disarmed by a tick that finds nothing to
        # send (an idle actor never wakes).
        self._armed = False
        self._stop_ticks: Any = None
        self._idle_ticks = 0  # ticks in a row that found no step waiting (loop thread only)
        self._next_seq = 0
        self._fields: list[Field] | None = None
        # (name, dtype, shape, scalar types) per field for put's one-pass fast path; None when a
        # field needs conversion (bfloat16) or before the schema is known.
        self._fast: tuple[tuple[str, np.dtype[Any], tuple[int, ...], frozenset[type]], ...] | None = None
        self._frame_steps = 0  # steps per frame, known once the schema is negotiated
        self._max_buffers = config.frame_buffers  # frame buffers allowed (resending keeps more)
        # Large puts go out zero-copy from the caller's memory unless they must be kept for resending.
        self._copy_large = config.resend_buffer_bytes > 0 and config.resend_large_puts

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def steps_put(self) -> int:
        return self._next_seq

    @property
    def has_schema(self) -> bool:
        return self._fields is not None

    def shutdown(self, disconnect: Callable[[], None]) -> None:
        """Close the writer: refuse puts, stop the linger timer and forget the partial frame
        (its memory is about to be released). ``disconnect`` closes the connection in between:
        the writer's lock is taken only after it, since a put blocked in a send holds the lock
        until the connection closes."""
        self._closed = True
        self._policy.close()
        try:
            disconnect()
        finally:
            with self._lock:
                self._armed = False
                stop, self._stop_ticks = self._stop_ticks, None
                self._current = None
            if stop is not None:
                stop()

    def negotiate(self, schema: Schema) -> None:
        # A learner busy with a storm of actors may take a while: wait as long as for connecting.
        reply = self._io.call(self._connector.propose(schema), self.config.connect_timeout, "schema negotiation")
        if isinstance(reply, _wire.Reject):
            raise SchemaMismatch(f"learner rejected the schema: {reply.reason}")
        schema = accepted_schema(schema, reply, self.config.max_fields)
        capacity = max(1, min(reply.max_steps, schema.frame_steps(self.config.frame_bytes)))
        # One frame buffer now; the others (up to frame_buffers) when a put finds none free
        # (Outbox.acquire). A slow actor's frame leaves from its buffer, which takes the next
        # step at once, so it never needs a second; and a storm of first puts does not carve
        # and populate 4 MiB per actor (docs/benchmarks.md, "Lockstep bursts").
        self._outbox.start(schema, reply.schema_id, reply.max_steps, [self._new_frame_buffer(schema, capacity)])
        self._max_buffers = max(self.config.frame_buffers,
                                self.config.resend_buffer_bytes // max(1, capacity * schema.step_bytes))  # fmt: skip
        self._fields = [Field(i, spec) for i, spec in enumerate(schema.fields)]
        if all(f.spec.dtype != "bfloat16" for f in self._fields):
            self._fast = tuple((f.name, f.dtype, f.shape, f.scalars) for f in self._fields)
        self._frame_steps = capacity

    def _ensure_schema(self, step: Mapping[str, Any], leading_dims: int) -> list[Field]:
        if self._fields is None:
            self.check_open()
            self.negotiate(infer_schema(step, leading_dims=leading_dims))
        assert self._fields is not None
        return self._fields

    def put(self, step: Mapping[str, Any], *, version: int | None = None) -> None:
        """Append one step: ``Actor.put``, which documents the conversion rule and the errors."""
        fast = self._fast
        if fast is not None and len(step) == len(fast) and self._put_in_frame(step, version, checked=False):
            return  # almost every call: exact dtypes and shapes, room in the current frame
        fields = self._fields or self._ensure_schema(step, 0)
        values = [check_value(f, step) for f in fields]
        if len(step) != len(fields):
            raise_extra(step, fields)
        if self._frame_steps == 1 and not self._copy_large and all(
            type(v) is np.ndarray and v.flags.c_contiguous for v in values
        ):
            self._send_borrowed([v.reshape(1, *v.shape) for v in values], 1, version)
            return
        if not self._put_in_frame(values, version, checked=True):
            self._append(1, version, lambda fb, at, src, k: write_step(fb, at, values))

    def _put_in_frame(self, step: Any, version: int | None, checked: bool) -> bool:
        """Write one step into the current frame if it has room (else False: nothing written).

        ``checked``: ``step`` is the list of values already checked and converted. Otherwise it
        is the caller's mapping, checked field by field while it is copied (one pass): any
        value that is not exactly the negotiated dtype and shape returns False for the general
        path, which converts it or raises a clear error. A step abandoned halfway leaves bytes
        past the frame's end, which are never sent.
        """
        v = self.policy_version if version is None else int(version)
        with self._lock:
            fb = self._current
            if (fb is None or fb.n >= fb.capacity - 1 or (fb.version != v and fb.n)
                    or self._closed or self._state.error is not None):  # fmt: skip
                return False
            at = fb.n
            if checked:
                for arr, value in zip(fb.typed, step):
                    arr[at] = value
            else:
                assert self._fast is not None
                try:
                    for (name, dtype, shape, scalars), arr in zip(self._fast, fb.typed):
                        value = step.get(name)
                        kind = type(value)
                        if kind is np.ndarray:
                            if value.shape != shape or (value.dtype is not dtype and value.dtype != dtype):
                                return False
                        elif kind not in scalars:
                            return False
                        arr[at] = value
                except OverflowError:  # a Python int out of the field's range: the checked path says so
                    return False
            fb.version = v
            fb.n = at + 1
            self._next_seq += 1
            if at == 0:
                self._first_step_locked(fb)
            return True

    def put_many(self, steps: Mapping[str, Any], *, version: int | None = None) -> None:
        """Append a chunk of steps: ``Actor.put_many``."""
        fields = self._fields or self._ensure_schema(steps, 1)
        if len(steps) != len(fields):
            raise_extra(steps, fields)
        arrays, count = check_chunk(fields, steps)
        if count == 0:
            return
        if self._borrow(count) and all(a.flags.c_contiguous for a in arrays):
            self._send_borrowed(arrays, count, version)
            return
        self._append(count, version, lambda fb, at, src, k: write_chunk(fb, at, arrays, src, k))

    def _borrow(self, count: int) -> bool:
        """Send ``count`` steps from the caller's arrays rather than copy them into a frame? A
        whole frame or more, always; on a plane the caller's thread sends on itself (tcp), half
        a frame or more already: the copy costs more than the smaller frame does (Atari steps
        put 32 at a time, 37 to a frame: docs/benchmarks.md)."""
        if self._copy_large:
            return False
        return count >= self._frame_steps or (2 * count >= self._frame_steps and self._policy.direct())

    def _send_borrowed(self, arrays: list[np.ndarray], count: int, version: int | None) -> None:
        """At least a full frame: send from the caller's memory instead of copying it (like
        ``sendall``, return once the transport has taken the bytes)."""
        v = self.policy_version if version is None else int(version)
        self.check_open()
        # Credit is waited for outside the lock; the frame is numbered, and sent or queued, under
        # it: frames leave in sequence order whatever other threads put meanwhile (the learner
        # refuses a frame out of order).
        self._policy.wait_credit_for_borrowed(time.monotonic() + self.config.put_timeout)
        with self._lock:
            self._submit_locked()  # an earlier partial frame goes first
            frame = BorrowedFrame(arrays, count, self._next_seq, v)
            self._next_seq += count
            if self._policy.leave_borrowed(frame):
                return
        done = frame.done
        assert done is not None
        try:
            if not done.wait(self.config.put_timeout):
                frame.cancelled = True
                done.wait(self.config.frame_timeout + self.config.close_timeout)
                raise Backpressure(f"no credit from the learner for {self.config.put_timeout:.3g}s; "
                                   f"{frame.sent} of {count} steps were sent")  # fmt: skip
            self.check_open()
        except Backpressure:
            with self._lock:
                self._next_seq = frame.seq + frame.sent  # unsent steps were never put
                self._outbox.rewind(self._next_seq)
            raise

    def _append(self, count: int, version: int | None, write: Any) -> None:
        v = self.policy_version if version is None else int(version)
        deadline = time.monotonic() + self.config.put_timeout
        done = 0
        while done < count:
            if self._state.error is not None or self._closed:
                self.check_open()
            with self._lock:
                fb = self._current
                if fb is not None and fb.n and fb.version != v:  # one version per frame
                    self._submit_locked()
                    fb = None
                if fb is not None:
                    k = min(count - done, fb.capacity - fb.n)
                    write(fb, fb.n, done, k)
                    first = fb.n == 0
                    if first:  # an emptied buffer keeps the version of the steps that left it
                        fb.version = v
                    fb.n += k
                    self._next_seq += k
                    done += k
                    if fb.n == fb.capacity:  # it leaves under the lock: frames leave in sequence order
                        self._current = None
                        if self._policy.leave(fb, Why.FULL, self._next_seq) is Left.EMPTIED:
                            self._current = fb  # sent from the buffer itself: it takes the next steps
                    elif first:
                        self._first_step_locked(fb)
            if fb is not None:
                continue
            fresh = self._outbox.acquire(deadline, self._max_buffers, self._new_buffer, self.check_open)
            with self._lock:
                if self._current is None:
                    fresh.reset(self._next_seq, v)
                    self._current = fresh
                else:
                    self._outbox.give_back(fresh)

    def _new_frame_buffer(self, schema: Schema, capacity: int) -> FrameBuffer:
        return FrameBuffer(schema, capacity, self._attach.frame_memory(capacity * schema.step_bytes))

    def _new_buffer(self) -> FrameBuffer:
        schema = self._outbox.schema
        assert schema is not None
        return self._new_frame_buffer(schema, self._frame_steps)

    def _submit_locked(self) -> None:
        """The current frame leaves now, partial or not: sent at once if the I/O side is idle,
        else handed to the I/O thread."""
        fb, self._current = self._current, None
        if fb is None:
            return
        if fb.n and self._policy.leave(fb, Why.NOW, self._next_seq) is Left.WHOLE:
            return
        self._outbox.give_back(fb)  # empty (or emptied): back to the pool, or it would be lost for good

    def _first_step_locked(self, fb: FrameBuffer) -> None:
        """A frame got its first steps (``fb.n`` counts them): the send policy lets it go now,
        or it waits for company and the linger timer is armed."""
        fb.started = time.monotonic()
        fb.put_time_us = time.time_ns() // 1000  # the buffer may have waited empty since its reset
        left = self._policy.leave(fb, Why.FIRST, self._next_seq)
        if left is Left.WHOLE:
            self._current = None
        elif left is Left.WAITING and not self._armed and not self._closed:
            self._armed = True
            self._io.soon(self._start_ticks)

    def _start_ticks(self) -> None:
        with self._lock:  # against shutdown on the closing thread
            if self._stop_ticks is None and self._armed and not self._closed:
                self._stop_ticks = self._io.every(self.config.frame_linger, self.linger_tick)

    def linger_tick(self) -> None:
        """On the I/O loop, every ``frame_linger`` while armed (``IOThread.every``: one timer for
        all the actors of a process): send a partial frame that waited long enough; disarm once
        nothing is waiting."""
        fb = self._current  # unlocked peek: most ticks find nothing to do
        # Half a linger old is enough: the timer is shared, so its phase is not this frame's, and
        # a frame that just missed a tick would otherwise wait almost two lingers.
        now = time.monotonic()
        if fb is not None and fb.n and now - fb.started >= self.config.frame_linger / 2:
            # Not waiting for the lock: a put holding it may be sending, and this loop serves
            # every actor of the process. The next tick tries again.
            if not self._lock.acquire(blocking=False):
                return
            try:
                if self._current is fb and fb.n:
                    if self._policy.leave(fb, Why.LINGERED, self._next_seq) is Left.WHOLE:
                        self._current = None
                    self._idle_ticks = 1  # a frame that lingered: a slow actor, stop at once
            finally:
                self._lock.release()
        self._disarm_if_idle()

    def _disarm_if_idle(self) -> None:
        """Stop ticking once no step is waiting: at once after sending a frame that lingered, else
        after two ticks in a row found none (one would disarm and re-arm a streaming actor, whose
        frame is empty just after each send, once per frame)."""
        fb = self._current
        if fb is not None and fb.n:
            self._idle_ticks = 0
            return
        self._idle_ticks += 1
        if self._idle_ticks < 2 or not self._lock.acquire(blocking=False):  # busy: a put is under way
            return
        try:
            fb = self._current
            if fb is not None and fb.n:  # a step came meanwhile: it saw _armed and relies on us
                self._idle_ticks = 0
                return
            self._armed = False
            stop, self._stop_ticks = self._stop_ticks, None
        finally:
            self._lock.release()
        self._idle_ticks = 0
        if stop is not None:
            stop()

    def flush(self, timeout: float | None = None) -> None:
        """Send any partial frame and wait until the learner holds every step put so far.

        Raises:
            TimeoutError: not acknowledged within ``timeout`` (default ``Config.flush_timeout``).
        """
        self.check_open()
        with self._lock:
            self._submit_locked()
            target = self._next_seq
        self._outbox.wait_acked(target, self.config.flush_timeout if timeout is None else timeout, self.check_open)

    def check_open(self) -> None:
        if self._closed:
            raise Closed("the actor is closed")
        err = self._state.error
        if err is not None:
            raise type(err)(str(err)) from err
