"""The actor's step writer: ``put`` and ``put_many`` copy steps into frame buffers, and full
frames go to the connection's outbox. A partial frame leaves at once, from the caller's thread,
when the I/O side is idle; otherwise it waits for company, at most about ``Config.frame_linger``.
A put of a whole frame or more is sent straight from the caller's arrays."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...config import Config
from ...errors import Backpressure, Closed, PeerLost, ProtocolError, RLinkError, SchemaMismatch
from ...transport.loop import IOThread
from ...wire import messages as _wire
from ...wire.codec import Schema, infer_schema
from .fields import Field, check_chunk, check_value, raise_extra
from .frames import BorrowedFrame, FrameBuffer, write_chunk, write_step
from .link import ActorConnection

__all__ = ["StepWriter"]


# A partial frame up to this size leaves the writer as a copy (see FrameBuffer.compact), and its
# buffer stays the current frame; a larger one leaves in its own buffer.
_COMPACT_BYTES = 64 << 10
# Copies kept for resending are freed by the learner's acknowledgements, which come unasked
# only with credit (a slow actor may wait hours for that): ask for one every so many copies.
_ACK_EVERY = 256


class StepWriter:
    """Coalesces one actor's steps into frames (any caller thread; one lock)."""

    def __init__(self, conn: ActorConnection, io: IOThread, config: Config):
        self._conn = conn
        self._io = io
        self.config = config
        self.closed = False
        self.policy_version = 0  # stamped on steps put without an explicit version
        self._lock = threading.Lock()
        self._current: FrameBuffer | None = None
        # The linger timer runs only while a partial frame may be waiting: armed by a step that
        # starts a frame and could not leave at once, disarmed by a tick that finds nothing to
        # send (an idle actor never wakes).
        self._armed = False
        # When a frame last left this writer. Like Nagle's unacknowledged segment, a frame sent
        # less than frame_linger ago counts as in flight (the learner is still taking it): a
        # step that comes meanwhile waits for company, so a busy actor fills its frames.
        self._last_sent = 0.0
        self._stop_ticks: Any = None
        self._idle_ticks = 0  # ticks in a row that found no step waiting (loop thread only)
        self._next_seq = 0
        self._fields: list[Field] | None = None
        # (name, dtype, shape, scalar types) per field for put's one-pass fast path; None when a
        # field needs conversion (bfloat16) or before the schema is known.
        self._fast: tuple[tuple[str, np.dtype, tuple, frozenset], ...] | None = None
        self._frame_steps = 0  # steps per frame, known once the schema is negotiated
        self._max_buffers = config.frame_buffers  # frame buffers allowed (resending keeps more)
        # Large puts go out zero-copy from the caller's memory unless they must be kept for resending.
        self._copy_large = config.resend_buffer_bytes > 0 and config.resend_large_puts

    @property
    def steps_put(self) -> int:
        return self._next_seq

    @property
    def has_schema(self) -> bool:
        return self._fields is not None

    def drop_current(self) -> None:
        """After close: forget the partial frame (its memory is about to be released)."""
        with self._lock:
            self._current = None

    def negotiate(self, schema: Schema) -> None:
        # A learner busy with a storm of actors may take a while: wait as long as for connecting.
        reply = self._io.call(self._conn.propose(schema), self.config.connect_timeout, "schema negotiation")
        if isinstance(reply, _wire.Reject):
            raise SchemaMismatch(f"learner rejected the schema: {reply.reason}")
        capacity = max(1, min(reply.max_steps, schema.frame_steps(self.config.frame_bytes)))
        self._conn.schema, self._conn.schema_id = schema, reply.schema_id
        self._conn.max_frame_steps = reply.max_steps  # no wire frame may carry more
        self._conn.free = [self._new_frame_buffer(schema, capacity) for _ in range(self.config.frame_buffers)]
        self._conn.buffers = self.config.frame_buffers
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
                    or self.closed or self._conn.error is not None):  # fmt: skip
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
        a frame or more already: the copy costs more than the smaller frame (Atari steps put 32
        at a time, 37 to a frame: 0.31 -> 0.18 ms of the actor's CPU per put_many)."""
        if self._copy_large:
            return False
        return count >= self._frame_steps or (2 * count >= self._frame_steps and self._direct())

    def _send_borrowed(self, arrays: list[np.ndarray], count: int, version: int | None) -> None:
        """At least a full frame: send from the caller's memory instead of copying it (like
        ``sendall``, return once the transport has taken the bytes)."""
        v = self.policy_version if version is None else int(version)
        self.check_open()
        conn = self._conn
        # Credit is waited for outside the lock (close() is never held up by a put); the frame
        # is numbered, and sent or queued, under it: frames leave in sequence order whatever
        # other threads put meanwhile (the learner refuses a frame out of order).
        any_thread = self._direct()
        if any_thread:
            conn.wait_credit(time.monotonic() + self.config.put_timeout)
        with self._lock:
            self._submit_locked()  # an earlier partial frame goes first
            frame = BorrowedFrame(arrays, count, self._next_seq, v)
            self._next_seq += count
            self._last_sent = time.monotonic()
            with conn.changed:
                direct = conn.outstanding == 0 and any_thread
            if direct:  # nothing queued: send on this thread, no hand-off to the I/O thread
                try:
                    if conn.send_direct(frame):
                        return
                except (PeerLost, ProtocolError):
                    # The connection broke mid-put. The caller's arrays stay ours until we
                    # return, so the frame goes to the I/O thread, which resends it from where
                    # the learner stopped once it has reconnected (or fails it for good).
                    if conn.error is not None or self.config.reconnect_timeout <= 0:
                        raise
            frame.done = done = threading.Event()
            self._hand_off(frame)  # the rest, once credit comes
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
                conn.next_send_seq = self._next_seq
            raise

    def _append(self, count: int, version: int | None, write: Any) -> None:
        v = self.policy_version if version is None else int(version)
        conn = self._conn
        deadline = time.monotonic() + self.config.put_timeout
        done = 0
        while done < count:
            if conn.error is not None or self.closed:
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
                    if fb.n == fb.capacity:
                        self._current = None
                        self._dispatch_locked(fb, v)  # under the lock: frames leave in sequence order
                    elif first:
                        self._first_step_locked(fb)
            if fb is not None:
                continue
            fresh = self._acquire(deadline)
            with self._lock:
                if self._current is None:
                    fresh.reset(self._next_seq, v)
                    self._current = fresh
                else:
                    conn.give_back(fresh)

    def _dispatch_locked(self, fb: FrameBuffer, version: int) -> None:
        """Send a full frame. With nothing queued and credit at hand, send it on this thread
        (and reuse the cache-warm buffer unless it must be kept for resending); otherwise hand
        it to the I/O thread."""
        conn = self._conn
        self._last_sent = time.monotonic()
        with conn.changed:
            idle = conn.outstanding == 0 and self._direct()
        if idle and conn.take_all_credit(fb.n):
            with conn.send_lock:
                if conn.resend:  # kept until acknowledged; if the send fails, resent after reconnecting
                    with conn.changed:
                        conn.inflight.append(fb)
                conn.send_part_or_fail(fb, fb.n)
            if conn.resend:
                return
            if self._current is None:
                fb.reset(self._next_seq, version)
                self._current = fb
                return
            conn.give_back(fb)
            return
        self._hand_off(fb)

    def _acquire(self, deadline: float) -> FrameBuffer:
        conn = self._conn
        with conn.changed:
            while not conn.free:
                # Frames kept for resending do not count against the frame_buffers that may be
                # filled ahead of the network (or put would run ahead of its credit).
                kept = sum(f.pooled for f in conn.inflight)  # compact copies are not pool buffers
                if conn.buffers < self._max_buffers and conn.buffers - kept < self.config.frame_buffers:
                    conn.buffers += 1
                    return self._new_frame_buffer(self._conn.schema, self._frame_steps)
                if conn.inflight:  # every buffer waits for an acknowledgement: ask for one now
                    self._io.soon(conn.sync, conn.inflight[-1].seq + conn.inflight[-1].sent)
                self.check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Backpressure(
                        f"no credit from the learner for {self.config.put_timeout:.3g}s "
                        f"({len(conn.queue)} frames waiting); the learner is not consuming fast enough"
                    )
                conn.changed.wait(min(left, 0.5))
            return conn.free.pop()

    def _new_frame_buffer(self, schema: Schema, capacity: int) -> FrameBuffer:
        return FrameBuffer(schema, capacity, self._conn.frame_memory(capacity * schema.step_bytes))

    def _direct(self) -> bool:
        """May the caller's thread send itself? Only on a transport that allows any thread (tcp);
        asked per send, because a reconnect may land on another transport."""
        return bool(getattr(self._conn.sender, "any_thread", False))

    def _submit_locked(self) -> None:
        """The current frame leaves now, partial or not: sent at once if the I/O side is idle,
        else handed to the I/O thread."""
        fb = self._current
        if fb is not None and fb.n and self._send_idle_locked(fb, time.monotonic()):
            fb = self._current  # its buffer, emptied, when it left as a copy
        self._current = None
        if fb is None:
            return
        if fb.n:
            self._hand_off(fb)
        else:  # an empty (reused) buffer goes back to the pool, or it would be lost for good
            self._conn.give_back(fb)

    def _hand_off(self, frame: FrameBuffer | BorrowedFrame) -> None:
        self._last_sent = time.monotonic()
        with self._conn.changed:
            self._conn.outstanding += 1
        self._io.soon(self._conn.submit, frame)

    def _first_step_locked(self, fb: FrameBuffer) -> None:
        """A frame got its first steps (``fb.n`` counts them): send it now if the I/O side is
        idle, else let it wait for company and arm the linger timer."""
        now = time.monotonic()
        fb.started = now
        fb.put_time_us = time.time_ns() // 1000  # the buffer may have waited empty since its reset
        if now - self._last_sent >= self.config.frame_linger and (
            self._send_idle_locked(fb, now) or self._hand_off_idle_locked(fb)
        ):
            return
        if not self._armed and not self.closed:
            self._armed = True
            self._io.soon(self._start_ticks)

    def _send_idle_locked(self, fb: FrameBuffer, now: float) -> bool:
        """Send the partial frame ``fb`` on this thread if the I/O side is idle: no send under
        way, nothing queued before it, and credit for all of it. Returns whether it was sent.

        No thread hand-off and no timer: a slow actor's step is on the wire when ``put``
        returns.
        """
        conn = self._conn
        if self.closed or not self._direct():
            return False
        if not conn.send_lock.acquire(blocking=False):  # a send is under way: this frame follows
            return False
        try:
            # Plain reads: next_send_seq moves under the send lock, which we hold, and a frame
            # handed off meanwhile is an earlier one (next_send_seq stays below ours until it
            # is sent).
            if conn.next_send_seq != fb.seq or conn.outstanding:  # earlier frames go first
                return False
            if not conn.take_all_credit(fb.n):
                return False
            keep = conn.resend
            frame = self._detach_locked(fb) if keep else fb
            if keep:  # kept until acknowledged; if the send fails, resent after reconnecting
                with conn.changed:
                    conn.inflight.append(frame)
            self._last_sent = now
            try:
                conn.send_part_or_fail(frame, frame.n)
            except RLinkError:
                # Not kept for resending: the reconnect (or the final error, raised by the next
                # call) is under way, and the learner counts the steps lost when it resumes.
                pass
            if not keep:  # sent from the buffer itself: it takes the next steps
                fb.reset(self._next_seq, fb.version)
            return True
        finally:
            conn.send_lock.release()

    def _hand_off_idle_locked(self, fb: FrameBuffer) -> bool:
        """On a plane that only the I/O thread may send on (ucx), the same send-when-idle: hand
        the partial frame ``fb`` to that thread now if it has nothing queued and no send under
        way. Waking its loop costs tens of microseconds; lingering cost ``frame_linger`` (a
        slow ucx actor's steps arrived 6 ms after their put, against under 1 ms on tcp)."""
        conn = self._conn
        # Without credit for it the frame would only wait in the queue: better fill it meanwhile.
        if self.closed or self._direct() or not conn.connected or conn.credit < fb.n:
            return False
        with conn.changed:
            if conn.outstanding:  # counts the frame being sent too
                return False
        self._hand_off(self._detach_locked(fb))
        return True

    def _detach_locked(self, fb: FrameBuffer) -> FrameBuffer:
        """The partial (current) frame ``fb`` leaves: as a right-sized copy while small, and
        ``fb`` stays the current frame, empty; else whole, and the next step takes a fresh one."""
        conn = self._conn
        if fb.n * conn.schema.step_bytes <= _COMPACT_BYTES:
            frame = fb.compact(conn.schema)
            fb.reset(self._next_seq, fb.version)  # stays the current frame, empty
            if conn.resend and len(conn.inflight) % _ACK_EVERY == _ACK_EVERY - 1:
                self._io.soon(conn.sync, self._next_seq)
            return frame
        self._current = None
        return fb

    def _start_ticks(self) -> None:
        with self._lock:  # against stop_ticks on the closing thread
            if self._stop_ticks is None and self._armed and not self.closed:
                self._stop_ticks = self._io.every(self.config.frame_linger, self.linger_tick)

    def stop_ticks(self) -> None:
        """At close: no more linger ticks."""
        with self._lock:
            self._armed = False
            stop, self._stop_ticks = self._stop_ticks, None
        if stop is not None:
            stop()

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
                    # Through the loop's ready queue, like every other hand-off: an earlier
                    # full frame handed off by the caller's thread may still be waiting there,
                    # and frames must reach the wire in seq order. (Sent from there, not under
                    # this lock: a busy actor's puts do not wait for it.)
                    self._hand_off(self._detach_locked(fb))
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
        self._conn.wait_acked(target, self.config.flush_timeout if timeout is None else timeout, self.check_open)

    def check_open(self) -> None:
        if self.closed:
            raise Closed("the actor is closed")
        err = self._conn.error
        if err is not None:
            raise type(err)(str(err)) from err
