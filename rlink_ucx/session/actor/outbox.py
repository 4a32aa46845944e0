"""Actor side, the outbox: the frame pool, the credit the learner granted, and the send queue.
Frames leave in seq order, each within credit, through :meth:`Outbox.send_part`: from the I/O
loop's send loop, or from the caller's thread when the writer's send policy says so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ...errors import Backpressure, Closed, PeerLost, ProtocolError, RLinkError
from ...errors import TimeoutError as RLinkTimeout
from ...transport.loop import IOThread
from ...transport.plane import map_plane_error
from ...wire import messages as _wire
from ...wire.codec import Schema
from ...wire.frame import FRAME_HEADER, FRAME_MAGIC
from ...wire.messages import PROTOCOL_VERSION
from .frames import BorrowedFrame, FrameBuffer
from .state import LinkState

__all__ = ["Outbox", "pack_header"]

# Seconds of back-to-back sending after which the send loop lets the I/O loop run (read control
# messages). Not after every frame: each yield costs a loop pass, which a busy actor on the ucx
# plane pays in throughput (docs/benchmarks.md).
_YIELD_EVERY = 0.01


def pack_header(schema_id: int, n_steps: int, actor_id: int, incarnation: int, seq: int, version: int,
                payload_bytes: int, put_time_us: int) -> bytes:  # fmt: skip
    """``wire.frame.FrameHeader(...).pack()`` (flags 0) without building the frozen dataclass
    first: a slow actor sends a frame per step, and on a machine whose caches went cold while
    it slept every object costs. ``tests/unit/test_actor_io.py`` checks they agree."""
    return FRAME_HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 0, schema_id, n_steps, actor_id, incarnation, seq,
                             version, payload_bytes, put_time_us)  # fmt: skip


class Outbox:
    """The send queue, credit taking, the frame pool, and sending a frame's steps as wire
    frames. Frames sent and kept for resending wait in ``state.inflight``.

    Args:
        state: the connection's shared state (the fields under ``credit_cv``, ``changed`` and
            ``send_lock``, and the sender).
        io: the I/O thread whose loop runs the send loop.
        fail: called with the error when a send fails.
    """

    def __init__(self, state: LinkState, io: IOThread, fail: Callable[[RLinkError], None]):
        self._state = state
        self._io = io
        self._fail = fail
        self._yielded_at = 0.0  # when the send loop last let the I/O loop run other tasks

    # --- the frame pool (any thread) --------------------------------------------------------------
    def start(self, schema: Schema, schema_id: int, max_steps: int, buffers: list[FrameBuffer]) -> None:
        """The negotiated schema, the learner's per-frame limit, and the first frame buffers."""
        s = self._state
        s.schema, s.schema_id = schema, schema_id
        s.max_frame_steps = max_steps  # no wire frame may carry more
        with s.changed:
            s.free = buffers
            s.buffers = len(buffers)

    def acquire(self, deadline: float, most: int, new: Callable[[], FrameBuffer], check: Callable[[], None]) -> FrameBuffer:
        """A frame buffer to fill: a free one, else a new one (``new()``) while fewer than
        ``most`` exist, else the first one freed before ``deadline`` (then Backpressure).
        ``check`` raises if the actor closed or failed meanwhile."""
        s = self._state
        with s.changed:
            while not s.free:
                # Frames kept for resending do not count against the frame_buffers that may be
                # filled ahead of the network (or put would run ahead of its credit).
                kept = sum(f.pooled for f in s.inflight)  # compact copies are not pool buffers
                if s.buffers < most and s.buffers - kept < s.config.frame_buffers:
                    s.buffers += 1
                    return new()
                if s.inflight:  # every buffer waits for an acknowledgement: ask for one now
                    self.sync_soon(s.inflight[-1].seq + s.inflight[-1].sent)
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Backpressure(
                        f"no credit from the learner for {s.config.put_timeout:.3g}s "
                        f"({len(s.queue)} frames waiting); the learner is not consuming fast enough"
                    )
                s.changed.wait(min(left, 0.5))
            return s.free.pop()

    def give_back(self, fb: FrameBuffer) -> None:
        """Return an unused frame buffer to the pool (any thread) and wake a put waiting for one."""
        s = self._state
        with s.changed:
            s.free.append(fb)
            s.changed.notify_all()

    def _finished(self, frame: FrameBuffer | BorrowedFrame) -> None:
        """A frame leaves the queue for good (changed lock held)."""
        self._state.outstanding -= 1
        if isinstance(frame, FrameBuffer):
            if frame.pooled:
                self._state.free.append(frame)
        elif frame.done is not None:
            frame.done.set()

    # --- credit ------------------------------------------------------------------------------------
    def add_credit(self, steps: int, acked: int) -> None:
        """The learner's Credit (loop thread), which acknowledges up to ``acked`` as well."""
        s = self._state
        with s.credit_cv:
            s.credit += steps
            s.credit_cv.notify_all()
        s.credit_event.set()
        if acked > s.acked:
            self.acknowledged(acked)

    def revoke(self, steps: int) -> int:
        """The learner takes back up to ``steps`` of unused credit; returns how many it got."""
        s = self._state
        with s.credit_cv:
            give = max(0, min(s.credit, steps))
            s.credit -= give
        return give

    def take_all_credit(self, n: int) -> bool:
        """Take ``n`` steps of credit if all are available now (any thread)."""
        s = self._state
        with s.credit_cv:
            if s.credit < n or s.error is not None or not s.connected or n > s.max_frame_steps:
                return False
            s.credit -= n
            return True

    def _take_credit(self, want: int) -> int:
        s = self._state
        with s.credit_cv:
            k = min(want, s.credit)
            s.credit -= k
            return k

    def wait_credit(self, deadline: float) -> None:
        """Until some credit is at hand (not taken: another thread may take it first), or
        ``deadline`` passed (then the caller's frame waits in the I/O thread's queue, which
        reports Backpressure). Raises the actor's error, or Closed."""
        s = self._state
        with s.credit_cv:
            while s.credit <= 0 or not s.connected:
                if s.error is not None:
                    raise s.error
                if s.closing:
                    raise Closed("the actor is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                s.credit_waits += 1
                s.credit_cv.wait(min(left, 0.5))

    # --- sending -----------------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing handed to the I/O loop waits to be sent (nor is being sent there)."""
        with self._state.changed:
            return self._state.outstanding == 0

    def hand_off(self, frame: FrameBuffer | BorrowedFrame) -> None:
        """Queue ``frame`` for the send loop (any thread): through the loop's FIFO ready queue,
        so frames handed off by any thread keep their order."""
        with self._state.changed:
            self._state.outstanding += 1
        self._io.soon(self.submit, frame)

    def submit(self, fb: FrameBuffer | BorrowedFrame) -> None:
        """Queue a handed-off frame (loop thread). Frames arrive here in seq order (they all come
        through the loop's FIFO ready queue); the sender checks that they leave that way."""
        s = self._state
        s.queue.append(fb)
        s.wake.set()
        if s.error is not None and isinstance(fb, BorrowedFrame) and fb.done is not None:
            fb.done.set()  # failed for good before it arrived: its caller raises the error

    def keep(self, frame: FrameBuffer) -> None:
        """``frame`` is about to be sent from the caller's thread and kept until acknowledged:
        if its send fails, it is resent after the reconnect."""
        with self._state.changed:
            self._state.inflight.append(frame)

    def send_part(self, frame: FrameBuffer | BorrowedFrame, k: int) -> None:
        """Send steps ``[sent, sent + k)`` of ``frame`` as one wire frame (send_lock held): the
        one place a frame's steps go to ``FrameSender.send``."""
        s = self._state
        sender = s.sender  # read once: close() on another thread may clear it meanwhile
        if sender is None:
            raise PeerLost("the data connection is closed")
        assert s.schema is not None
        step_bytes = s.schema.step_bytes  # cached by the schema
        header = pack_header(s.schema_id, k, s.actor_id or 0, s.incarnation, frame.seq + frame.sent,
                             frame.version, k * step_bytes, frame.put_time_us)  # fmt: skip
        sender.send(header, frame.payload(frame.sent, frame.sent + k))
        frame.sent += k
        s.next_send_seq = frame.seq + frame.sent
        s.sent_steps += k
        s.sent_frames += 1
        s.frame_sent_at = time.monotonic()  # a frame says we are alive: no heartbeat needed
        s.sent_bytes += k * step_bytes

    def send_part_or_fail(self, frame: FrameBuffer | BorrowedFrame, k: int) -> bool:
        """``send_part`` from a caller's thread. A failure starts a reconnect; it is raised as
        PeerLost only for a frame that is not kept for resending (a large put then hands its
        frame to the I/O thread, which resends it after the reconnect). Returns whether it was
        sent."""
        try:
            self.send_part(frame, k)
            return True
        except Exception as exc:  # translated, and recorded for later calls too
            err = map_plane_error(exc, "data connection broke")
            self._state.loop.call_soon_threadsafe(self._fail, err)
            if self._state.resend and isinstance(frame, FrameBuffer):
                return False
            raise err from exc

    def send_direct(self, frame: BorrowedFrame) -> bool:
        """Send as much of ``frame`` as the credit at hand allows, from the calling thread (no
        hand-off; nothing else may be queued). Never waits for credit: True once all of it
        left, False when the rest must go through the I/O thread's queue."""
        s = self._state
        while frame.sent < frame.n:
            if s.error is not None or not s.connected:
                return False
            k = self._take_credit(min(frame.n - frame.sent, s.max_frame_steps))
            if k == 0:
                return False
            with s.send_lock:
                self.send_part_or_fail(frame, k)
        return True

    def rewind(self, seq: int) -> None:
        """A large put gave up (Backpressure) with its steps from ``seq`` on unsent: they were
        never put, and the next step is ``seq`` (its frame has finished: nothing is sending)."""
        self._state.next_send_seq = seq

    async def send_loop(self) -> None:
        s = self._state
        try:
            while True:
                while not s.queue:
                    if s.error is not None:
                        return
                    s.wake.clear()
                    await s.wake.wait()
                if s.error is not None:
                    return
                frame = s.queue[0]
                if frame.seq + frame.sent != s.next_send_seq:
                    raise ProtocolError(f"internal: frame seq {frame.seq} queued, {s.next_send_seq} due")
                while frame.sent < frame.n and not getattr(frame, "cancelled", False):
                    k = self._take_credit(min(frame.n - frame.sent, s.max_frame_steps))
                    if k == 0:
                        if s.error is not None:
                            return
                        s.credit_waits += 1
                        s.credit_event.clear()
                        if s.credit <= 0:
                            await s.credit_event.wait()
                        continue
                    with s.send_lock:
                        self.send_part(frame, k)
                    if time.monotonic() - self._yielded_at > _YIELD_EVERY:
                        # Each send blocks this loop: let it read the control channel now and then,
                        # so a backlogged actor answers a Revoke in time, not once its whole credit
                        # is spent (the learner ends a session that keeps revoked credit).
                        await asyncio.sleep(0)
                        self._yielded_at = time.monotonic()
                s.queue.popleft()
                with s.changed:
                    if s.resend and isinstance(frame, FrameBuffer) and not getattr(frame, "cancelled", False):
                        s.outstanding -= 1
                        s.inflight.append(frame)  # kept until acknowledged
                    else:
                        self._finished(frame)
                    s.changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self._fail(map_plane_error(exc, "data connection broke"))

    # --- acknowledgements and resending --------------------------------------------------------------
    def acknowledged(self, seq: int) -> None:
        """The learner holds every step below ``seq``: frames entirely below it are done."""
        s = self._state
        with s.changed:
            s.acked = max(s.acked, seq)
            while s.inflight and s.inflight[0].seq + s.inflight[0].n <= s.acked:
                frame = s.inflight.popleft()
                if frame.pooled:
                    s.free.append(frame)
            s.changed.notify_all()

    def sync(self, seq: int) -> None:
        """Ask the learner to acknowledge once ``seq`` steps are buffered (loop thread)."""
        s = self._state
        # Only on a session that is up: while a reconnect is handshaking, a Sync would reach
        # the learner before the Hello and end the new connection (wait_acked asks again).
        if s.control is not None and s.connected and s.acked < seq:
            s.control.send(_wire.Sync(seq))

    def sync_soon(self, seq: int) -> None:
        """``sync(seq)`` on the loop thread, from any thread."""
        self._io.soon(self.sync, seq)

    def wait_acked(self, target: int, timeout: float, check: Callable[[], None]) -> None:
        """Until the learner holds every step below ``target`` (any thread; ``check`` raises
        if the actor closed or failed meanwhile)."""
        s = self._state
        deadline = time.monotonic() + timeout
        self._soon(self.sync, target)
        with s.changed:
            while s.acked < target:
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLinkTimeout(f"flush: learner acknowledged {s.acked} of {target} steps within {timeout:.3g}s")
                if not s.changed.wait(min(left, 0.5)):
                    self._soon(self.sync, target)  # again: the first may have gone to a learner that died

    def _soon(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._state.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has stopped: check() reports why
            pass

    def requeue(self, resume: int) -> None:
        """Put every unacknowledged frame back in the queue, from where the learner stopped
        (``resume``; -1: a learner that never saw this stream gets everything unacknowledged)."""
        s = self._state
        with s.changed:
            frames = [*s.inflight, *s.queue]
            s.outstanding += len(s.inflight)  # queued again
            s.inflight.clear()
            s.queue.clear()
            if resume >= 0 and resume > s.acked:
                s.acked = resume
            start = s.next_send_seq
            base = resume if resume >= 0 else s.acked  # a new learner: from what the old one lacked
            for fb in frames:
                fb.sent = min(fb.n, max(0, base - fb.seq))
                if fb.sent == fb.n:  # the learner has all of it
                    self._finished(fb)
                else:
                    s.queue.append(fb)
            if s.queue:
                start = s.queue[0].seq + s.queue[0].sent
            known = max(s.acked, resume)
            if start > known:
                s.steps_lost += start - known  # sent once, never acknowledged, not kept
            s.next_send_seq = start
            s.changed.notify_all()
        s.wake.set()
