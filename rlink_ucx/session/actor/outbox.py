"""Actor side, the outbox: the frame pool, the credit the learner granted, and the send queue.
Frames leave in seq order, each within credit, through :meth:`Outbox.send_part`: from the I/O
loop's send loop, or from the caller's thread when the writer's send policy says so."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable

from ...errors import Backpressure, PeerLost, ProtocolError, RLinkError
from ...errors import TimeoutError as RLinkTimeout
from ...transport.loop import IOThread
from ...transport.plane import map_plane_error
from ...wire import messages as _wire
from ...wire.codec import Schema
from ...wire.frame import FRAME_HEADER, FRAME_MAGIC
from ...wire.messages import PROTOCOL_VERSION
from .credit import Credit
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
    frames; it owns these fields, and the other parts ask it through its methods. Frames sent
    and kept for resending wait in ``inflight``.

    Args:
        state: the connection's shared state (read: the sender, the session's ids, whether it
            is connected, failed or closing).
        io: the I/O thread whose loop runs the send loop.
        fail: called with the error when a send fails.
    """

    def __init__(self, state: LinkState, io: IOThread, fail: Callable[[RLinkError], None]):
        self._state = state
        self._io = io
        self._fail = fail
        self._yielded_at = 0.0  # when the send loop last let the I/O loop run other tasks
        self.credit = Credit(state)  # the learner's grant: other parts take, wait for or revoke it there

        # The schema: set once by the writer's negotiation (before any frame), again by a
        # reconnect's renegotiation on the loop thread (while no frame is sent).
        self.schema: Schema | None = None
        self.schema_id = 0
        self.max_frame_steps = 1 << 62  # the learner's per-frame limit (from Accept)

        # Frames, guarded by changed, which also signals free buffers, acknowledgements and
        # errors to callers. ``queue`` is the I/O loop's (it appends and pops there; the
        # reconnect's requeue and the release at close rebuild it under changed).
        self.outstanding = 0  # frames handed to the loop and not yet sent
        self.acked = 0  # the learner holds every step with seq < acked
        self.queue: collections.deque[FrameBuffer | BorrowedFrame] = collections.deque()
        self.free: list[FrameBuffer] = []
        self.inflight: collections.deque[FrameBuffer] = collections.deque()  # sent, kept for resending
        self.buffers = 0  # frame buffers allocated (more while resending needs them)
        self.steps_lost = 0  # sent, unacknowledged and not kept for resending when a link broke
        self.changed = threading.Condition()

        # What goes on the wire, guarded by send_lock (one frame on the wire at a time, any thread).
        self.next_send_seq = 0  # seq of the next step to go on the wire
        self.sent_steps = 0
        self.sent_frames = 0
        self.sent_bytes = 0
        self.frame_sent_at = 0.0  # when the last frame went out: it says we are alive, as a control message does
        self.send_lock = threading.Lock()

        self.wake = asyncio.Event()  # the send loop's wake-up (loop thread): a frame was queued, or an error

    # --- the frame pool (any thread) --------------------------------------------------------------
    def start(self, schema: Schema, schema_id: int, max_steps: int, buffers: list[FrameBuffer]) -> None:
        """The negotiated schema, the learner's per-frame limit, and the first frame buffers."""
        self.schema, self.schema_id = schema, schema_id
        self.max_frame_steps = max_steps  # no wire frame may carry more
        with self.changed:
            self.free = buffers
            self.buffers = len(buffers)

    def acquire(self, deadline: float, most: int, new: Callable[[], FrameBuffer], check: Callable[[], None]) -> FrameBuffer:
        """A frame buffer to fill: a free one, else a new one (``new()``) while fewer than
        ``most`` exist, else the first one freed before ``deadline`` (then Backpressure).
        ``check`` raises if the actor closed or failed meanwhile."""
        s = self._state
        with self.changed:
            while not self.free:
                # Frames kept for resending do not count against the frame_buffers that may be
                # filled ahead of the network (or put would run ahead of its credit).
                kept = sum(f.pooled for f in self.inflight)  # compact copies are not pool buffers
                if self.buffers < most and self.buffers - kept < s.config.frame_buffers:
                    self.buffers += 1
                    return new()
                if self.inflight:  # every buffer waits for an acknowledgement: ask for one now
                    self.sync_soon(self.inflight[-1].seq + self.inflight[-1].sent)
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Backpressure(
                        f"no credit from the learner for {s.config.put_timeout:.3g}s "
                        f"({len(self.queue)} frames waiting); the learner is not consuming fast enough"
                    )
                self.changed.wait(min(left, 0.5))
            return self.free.pop()

    def renegotiated(self, schema_id: int, max_steps: int) -> None:
        """A reconnect's new session accepted the schema again (loop thread, no frame sent)."""
        self.schema_id, self.max_frame_steps = schema_id, max_steps

    def kept(self) -> int:
        """Frames sent and kept until acknowledged (a racy count: a hint for asking an ack)."""
        return len(self.inflight)

    def drop_frames(self) -> None:
        """After close, before the arena is unmapped: forget every frame buffer (any thread)."""
        with self.changed:
            self.free.clear()
            self.inflight.clear()
            self.queue.clear()

    def give_back(self, fb: FrameBuffer) -> None:
        """Return an unused frame buffer to the pool (any thread) and wake a put waiting for one."""
        with self.changed:
            self.free.append(fb)
            self.changed.notify_all()

    def _finished(self, frame: FrameBuffer | BorrowedFrame) -> None:
        """A frame leaves the queue for good (changed lock held)."""
        self.outstanding -= 1
        if isinstance(frame, FrameBuffer):
            if frame.pooled:
                self.free.append(frame)
        elif frame.done is not None:
            frame.done.set()

    # --- credit ------------------------------------------------------------------------------------
    def add_credit(self, steps: int, acked: int) -> None:
        """The learner's Credit (loop thread), which acknowledges up to ``acked`` as well."""
        self.credit.add(steps)
        if acked > self.acked:
            self.acknowledged(acked)

    def take_all_credit(self, n: int) -> bool:
        """Take ``n`` steps of credit if all are available now (any thread)."""
        s = self._state
        with self.credit.cv:
            if self.credit.steps < n or s.error is not None or not s.connected or n > self.max_frame_steps:
                return False
            self.credit.steps -= n
            return True

    # --- sending -----------------------------------------------------------------------------------
    def claim_idle(self, frame: FrameBuffer | BorrowedFrame) -> bool:
        """Take ``send_lock`` and all of ``frame``'s credit if the I/O side is idle: no send
        under way, nothing queued before the frame. Returns whether it did (the caller then
        sends and calls :meth:`release_send`)."""
        if not self.send_lock.acquire(blocking=False):  # a send is under way: this frame follows
            return False
        # Plain reads: next_send_seq moves under the send lock, which we hold, and a frame
        # handed off meanwhile is an earlier one (next_send_seq stays below ours until it is
        # sent).
        if self.next_send_seq == frame.seq and not self.outstanding and self.take_all_credit(frame.n):
            return True
        self.send_lock.release()
        return False

    def claim_full(self, n: int) -> bool:
        """Take all ``n`` steps of credit and ``send_lock`` for a full frame if nothing handed
        to the I/O loop waits (the caller then sends and calls :meth:`release_send`)."""
        if self.idle() and self.take_all_credit(n):
            self.send_lock.acquire()
            return True
        return False

    def release_send(self) -> None:
        """The caller's thread finished the send it claimed."""
        self.send_lock.release()

    def idle(self) -> bool:
        """Nothing handed to the I/O loop waits to be sent (nor is being sent there)."""
        with self.changed:
            return self.outstanding == 0

    def hand_off(self, frame: FrameBuffer | BorrowedFrame) -> None:
        """Queue ``frame`` for the send loop (any thread): through the loop's FIFO ready queue,
        so frames handed off by any thread keep their order."""
        with self.changed:
            self.outstanding += 1
        self._io.soon(self.submit, frame)

    def submit(self, fb: FrameBuffer | BorrowedFrame) -> None:
        """Queue a handed-off frame (loop thread). Frames arrive here in seq order (they all come
        through the loop's FIFO ready queue); the sender checks that they leave that way."""
        s = self._state
        self.queue.append(fb)
        self.wake.set()
        if s.error is not None and isinstance(fb, BorrowedFrame) and fb.done is not None:
            fb.done.set()  # failed for good before it arrived: its caller raises the error

    def keep(self, frame: FrameBuffer) -> None:
        """``frame`` is about to be sent from the caller's thread and kept until acknowledged:
        if its send fails, it is resent after the reconnect."""
        with self.changed:
            self.inflight.append(frame)

    def send_part(self, frame: FrameBuffer | BorrowedFrame, k: int) -> None:
        """Send steps ``[sent, sent + k)`` of ``frame`` as one wire frame (send_lock held): the
        one place a frame's steps go to ``FrameSender.send``."""
        s = self._state
        sender = s.sender  # read once: close() on another thread may clear it meanwhile
        if sender is None:
            raise PeerLost("the data connection is closed")
        assert self.schema is not None
        step_bytes = self.schema.step_bytes  # cached by the schema
        header = pack_header(self.schema_id, k, s.actor_id or 0, s.incarnation, frame.seq + frame.sent,
                             frame.version, k * step_bytes, frame.put_time_us)  # fmt: skip
        sender.send(header, frame.payload(frame.sent, frame.sent + k))
        frame.sent += k
        self.next_send_seq = frame.seq + frame.sent
        self.sent_steps += k
        self.sent_frames += 1
        self.frame_sent_at = time.monotonic()  # a frame says we are alive: no heartbeat needed
        self.sent_bytes += k * step_bytes

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
            k = self.credit.take(min(frame.n - frame.sent, self.max_frame_steps))
            if k == 0:
                return False
            with self.send_lock:
                self.send_part_or_fail(frame, k)
        return True

    def rewind(self, seq: int) -> None:
        """A large put gave up (Backpressure) with its steps from ``seq`` on unsent: they were
        never put, and the next step is ``seq`` (its frame has finished: nothing is sending)."""
        self.next_send_seq = seq

    async def send_loop(self) -> None:
        s = self._state
        try:
            while True:
                while not self.queue:
                    if s.error is not None:
                        return
                    self.wake.clear()
                    await self.wake.wait()
                if s.error is not None:
                    return
                frame = self.queue[0]
                if frame.seq + frame.sent != self.next_send_seq:
                    raise ProtocolError(f"internal: frame seq {frame.seq} queued, {self.next_send_seq} due")
                while frame.sent < frame.n and not getattr(frame, "cancelled", False):
                    k = self.credit.take(min(frame.n - frame.sent, self.max_frame_steps))
                    if k == 0:
                        if s.error is not None:
                            return
                        self.credit.waits += 1
                        self.credit.event.clear()
                        if self.credit.steps <= 0:
                            await self.credit.event.wait()
                        continue
                    with self.send_lock:
                        self.send_part(frame, k)
                    if time.monotonic() - self._yielded_at > _YIELD_EVERY:
                        # Each send blocks this loop: let it read the control channel now and then,
                        # so a backlogged actor answers a Revoke in time, not once its whole credit
                        # is spent (the learner ends a session that keeps revoked credit).
                        await asyncio.sleep(0)
                        self._yielded_at = time.monotonic()
                self.queue.popleft()
                with self.changed:
                    if s.resend and isinstance(frame, FrameBuffer) and not getattr(frame, "cancelled", False):
                        self.outstanding -= 1
                        self.inflight.append(frame)  # kept until acknowledged
                    else:
                        self._finished(frame)
                    self.changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self._fail(map_plane_error(exc, "data connection broke"))

    # --- failing, closing, counting -------------------------------------------------------------------
    def fail_waiters(self) -> None:
        """The connection failed for good (loop thread): every waiting caller and the send loop
        wake and raise the error; a large put waiting in the queue is finished."""
        self._finish_borrowed()
        self.wake_callers()
        self.wake.set()
        self.credit.event.set()

    def closing(self) -> None:
        """The actor is closing (loop thread): callers waiting on a large put or for credit
        wake and raise Closed."""
        self._finish_borrowed()
        with self.credit.cv:
            self.credit.cv.notify_all()

    def _finish_borrowed(self) -> None:
        for frame in self.queue:
            if isinstance(frame, BorrowedFrame) and frame.done is not None:
                frame.done.set()  # the caller raises the error, or Closed

    def wake_callers(self) -> None:
        """Wake every caller waiting for a buffer, an acknowledgement or credit (any thread):
        each looks at the connection again."""
        with self.changed:
            self.changed.notify_all()
        with self.credit.cv:
            self.credit.cv.notify_all()

    def stats(self) -> dict[str, int]:
        """The outbox's counters, for ``Actor.stats``."""
        return {
            "steps_sent": self.sent_steps,
            "steps_acked": self.acked,
            "frames_sent": self.sent_frames,
            "bytes_sent": self.sent_bytes,
            "credit": self.credit.steps,
            "credit_waits": self.credit.waits,
            "steps_lost": self.steps_lost,
        }

    # --- acknowledgements and resending --------------------------------------------------------------
    def acknowledged(self, seq: int) -> None:
        """The learner holds every step below ``seq``: frames entirely below it are done."""
        with self.changed:
            self.acked = max(self.acked, seq)
            while self.inflight and self.inflight[0].seq + self.inflight[0].n <= self.acked:
                frame = self.inflight.popleft()
                if frame.pooled:
                    self.free.append(frame)
            self.changed.notify_all()

    def sync(self, seq: int) -> None:
        """Ask the learner to acknowledge once ``seq`` steps are buffered (loop thread)."""
        s = self._state
        # Only on a session that is up: while a reconnect is handshaking, a Sync would reach
        # the learner before the Hello and end the new connection (wait_acked asks again).
        if s.control is not None and s.connected and self.acked < seq:
            s.control.send(_wire.Sync(seq))

    def sync_soon(self, seq: int) -> None:
        """``sync(seq)`` on the loop thread, from any thread."""
        self._io.soon(self.sync, seq)

    def wait_acked(self, target: int, timeout: float, check: Callable[[], None]) -> None:
        """Until the learner holds every step below ``target`` (any thread; ``check`` raises
        if the actor closed or failed meanwhile)."""
        deadline = time.monotonic() + timeout
        self._soon(self.sync, target)
        with self.changed:
            while self.acked < target:
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLinkTimeout(f"flush: learner acknowledged {self.acked} of {target} steps within {timeout:.3g}s")
                if not self.changed.wait(min(left, 0.5)):
                    self._soon(self.sync, target)  # again: the first may have gone to a learner that died

    def _soon(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._state.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has stopped: check() reports why
            pass

    def requeue(self, resume: int) -> None:
        """Put every unacknowledged frame back in the queue, from where the learner stopped
        (``resume``; -1: a learner that never saw this stream gets everything unacknowledged)."""
        with self.changed:
            frames = [*self.inflight, *self.queue]
            self.outstanding += len(self.inflight)  # queued again
            self.inflight.clear()
            self.queue.clear()
            if resume >= 0 and resume > self.acked:
                self.acked = resume
            start = self.next_send_seq
            base = resume if resume >= 0 else self.acked  # a new learner: from what the old one lacked
            for fb in frames:
                fb.sent = min(fb.n, max(0, base - fb.seq))
                if fb.sent == fb.n:  # the learner has all of it
                    self._finished(fb)
                else:
                    self.queue.append(fb)
            if self.queue:
                start = self.queue[0].seq + self.queue[0].sent
            known = max(self.acked, resume)
            if start > known:
                self.steps_lost += start - known  # sent once, never acknowledged, not kept
            self.next_send_seq = start
            self.changed.notify_all()
        self.wake.set()
