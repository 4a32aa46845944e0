"""Actor side, the outbox: frames leave in seq order, each within the credit the learner
granted, from the I/O loop or (with nothing queued) straight from the caller's thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ...errors import Closed, PeerLost, ProtocolError
from ...errors import TimeoutError as RLinkTimeout
from ...transport.plane import map_plane_error
from ...wire.frame import FRAME_HEADER, FRAME_MAGIC
from ...wire.messages import PROTOCOL_VERSION
from .frames import BorrowedFrame, FrameBuffer

# Seconds of back-to-back sending after which the send loop lets the I/O loop run (read control
# messages). Not after every frame: that cost the ucx plane 30% with 4 Atari actors.
_YIELD_EVERY = 0.01


def pack_header(schema_id: int, n_steps: int, actor_id: int, incarnation: int, seq: int, version: int,
                payload_bytes: int, put_time_us: int) -> bytes:  # fmt: skip
    """``wire.frame.FrameHeader(...).pack()`` (flags 0) without building the frozen dataclass
    first: a slow actor sends a frame per step, and on a machine whose caches went cold while
    it slept every object costs. ``tests/unit/test_actor_io.py`` checks they agree."""
    return FRAME_HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, 0, schema_id, n_steps, actor_id, incarnation, seq,
                             version, payload_bytes, put_time_us)  # fmt: skip


class Outbox:
    """Part of :class:`ActorConnection`: the send queue, credit taking, and sending a frame's
    steps as wire frames. Frames sent and kept for resending wait in ``inflight``."""

    _yielded_at = 0.0  # when the send loop last let the I/O loop run other tasks

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

    def submit(self, fb: FrameBuffer | BorrowedFrame) -> None:
        """Queue a filled frame (loop thread). Frames arrive here in seq order (they all come
        through the loop's FIFO ready queue); the sender checks that they leave that way."""
        self.queue.append(fb)
        self._wake.set()
        if self.error is not None and isinstance(fb, BorrowedFrame) and fb.done is not None:
            fb.done.set()  # failed for good before it arrived: its caller raises the error

    def _send_part(self, frame: FrameBuffer | BorrowedFrame, k: int) -> None:
        """Send steps ``[sent, sent + k)`` of ``frame`` as one wire frame (send_lock held)."""
        sender = self.sender  # read once: close() on another thread may clear it meanwhile
        if sender is None:
            raise PeerLost("the data connection is closed")
        assert self.schema is not None
        step_bytes = self.schema.step_bytes
        header = pack_header(self.schema_id, k, self.actor_id or 0, self.incarnation, frame.seq + frame.sent,
                             frame.version, k * step_bytes, frame.put_time_us)  # fmt: skip
        sender.send(header, frame.payload(frame.sent, frame.sent + k))
        frame.sent += k
        self.next_send_seq = frame.seq + frame.sent
        self.sent_steps += k
        self.sent_frames += 1
        self.frame_sent_at = time.monotonic()  # a frame says we are alive: no heartbeat needed
        self.sent_bytes += k * step_bytes

    def take_all_credit(self, n: int) -> bool:
        """Take ``n`` steps of credit if all are available now (any thread)."""
        with self.credit_cv:
            if self.credit < n or self.error is not None or not self.connected or n > self.max_frame_steps:
                return False
            self.credit -= n
            return True

    def send_part_or_fail(self, frame: FrameBuffer | BorrowedFrame, k: int) -> bool:
        """``_send_part`` from a caller's thread. A failure starts a reconnect; it is raised as
        PeerLost only for a frame that is not kept for resending (a large put then hands its
        frame to the I/O thread, which resends it after the reconnect). Returns whether it was
        sent."""
        try:
            self._send_part(frame, k)
            return True
        except Exception as exc:  # noqa: BLE001 - translated and recorded for later calls too
            err = map_plane_error(exc, "data connection broke")
            self.loop.call_soon_threadsafe(self.fail, err)
            if self.resend and isinstance(frame, FrameBuffer):
                return False
            raise err from exc

    def _take_credit(self, want: int) -> int:
        with self.credit_cv:
            k = min(want, self.credit)
            self.credit -= k
            return k

    async def _send_loop(self) -> None:
        try:
            while True:
                while not self.queue:
                    if self.error is not None:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                if self.error is not None:
                    return
                frame = self.queue[0]
                if frame.seq + frame.sent != self.next_send_seq:
                    raise ProtocolError(f"internal: frame seq {frame.seq} queued, {self.next_send_seq} due")
                while frame.sent < frame.n and not getattr(frame, "cancelled", False):
                    k = self._take_credit(min(frame.n - frame.sent, self.max_frame_steps))
                    if k == 0:
                        if self.error is not None:
                            return
                        self.credit_waits += 1
                        self._credit_event.clear()
                        if self.credit <= 0:
                            await self._credit_event.wait()
                        continue
                    with self.send_lock:
                        self._send_part(frame, k)
                    if time.monotonic() - self._yielded_at > _YIELD_EVERY:
                        # Each send blocks this loop: let it read the control channel now and then,
                        # so a backlogged actor answers a Revoke in time, not once its whole credit
                        # is spent (the learner ends a session that keeps revoked credit).
                        await asyncio.sleep(0)
                        self._yielded_at = time.monotonic()
                self.queue.popleft()
                with self.changed:
                    if self.resend and isinstance(frame, FrameBuffer) and not getattr(frame, "cancelled", False):
                        self.outstanding -= 1
                        self.inflight.append(frame)  # kept until acknowledged
                    else:
                        self._finished(frame)
                    self.changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self.fail(map_plane_error(exc, "data connection broke"))

    def wait_credit(self, deadline: float) -> None:
        """Until some credit is at hand (not taken: another thread may take it first), or
        ``deadline`` passed (then the caller's frame waits in the I/O thread's queue, which
        reports Backpressure). Raises the actor's error, or Closed."""
        with self.credit_cv:
            while self.credit <= 0 or not self.connected:
                if self.error is not None:
                    raise self.error
                if self.closing:
                    raise Closed("the actor is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.credit_waits += 1
                self.credit_cv.wait(min(left, 0.5))

    def send_direct(self, frame: BorrowedFrame) -> bool:
        """Send as much of ``frame`` as the credit at hand allows, from the calling thread (no
        hand-off; nothing else may be queued). Never waits for credit: True once all of it
        left, False when the rest must go through the I/O thread's queue."""
        while frame.sent < frame.n:
            if self.error is not None or not self.connected:
                return False
            k = self._take_credit(min(frame.n - frame.sent, self.max_frame_steps))
            if k == 0:
                return False
            with self.send_lock:
                self.send_part_or_fail(frame, k)
        return True

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
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has stopped: check() reports why
            pass
