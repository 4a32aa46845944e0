"""The actor's send policy: the one place that decides how a frame leaves the writer.

A frame leaves from the caller's thread at once, is handed to the I/O loop's send queue, or
waits in the writer for company (at most about ``Config.frame_linger``). :meth:`SendPolicy.route`
decides, for every frame the writer lets go (full, a partial one that got its first step, one
that must leave now, one that lingered, a large put's borrowed arrays); :meth:`SendPolicy.leave`
and :meth:`SendPolicy.leave_borrowed` carry the decision out; every step reaches the wire
through :meth:`Outbox.send_part`, from the caller's thread or from the send loop.
"""

from __future__ import annotations

import enum
import threading
import time

from ...errors import PeerLost, ProtocolError, RLinkError
from .frames import BorrowedFrame, FrameBuffer
from .outbox import Outbox
from .state import LinkState

__all__ = ["Left", "Route", "SendPolicy", "Why"]

# A partial frame up to this size leaves the writer as a copy (see FrameBuffer.compact), and its
# buffer stays the current frame; a larger one leaves in its own buffer.
_COMPACT_BYTES = 64 << 10
# Copies kept for resending are freed by the learner's acknowledgements, which come unasked
# only with credit (a slow actor may wait hours for that): ask for one every so many copies.
_ACK_EVERY = 256


class Why(enum.Enum):
    """Why the writer lets a frame go."""

    FULL = "full"  # a full frame buffer
    FIRST = "first"  # a partial frame just got its first steps: it leaves if the I/O side is idle
    NOW = "now"  # a partial frame that must leave now (flush, a new version, a large put after it)
    LINGERED = "lingered"  # a partial frame that waited about frame_linger (the linger tick)
    BORROWED = "borrowed"  # a large put, sent from the caller's arrays


class Route(enum.Enum):
    """How a frame leaves."""

    NOW = "now"  # from the caller's thread, at once
    LOOP = "loop"  # handed to the I/O loop's send queue
    LINGER = "linger"  # waits in the writer for company


class Left(enum.Enum):
    """What became of a frame buffer the writer let go."""

    WAITING = "waiting"  # nothing: it lingers, still the writer's current frame
    EMPTIED = "emptied"  # its steps left (sent, or a copy of them queued); the buffer is the writer's again, empty
    WHOLE = "whole"  # the buffer itself left (queued, or kept for resending)


class SendPolicy:
    """Decides and carries out how the writer's frames leave (called under the writer's lock).

    Like Nagle's algorithm with its unacknowledged segment, a frame sent less than
    ``frame_linger`` ago counts as in flight: a step that comes meanwhile waits for company, so
    a busy actor fills its frames, while a slow actor's step is on the wire when ``put``
    returns (on a plane any thread may send on, tcp and shm) or in the I/O thread's hands
    (ucx), with no timer either way.

    Args:
        state: the connection's shared state (read: the sender, connected).
        outbox: takes credit and the send lock, sends from the caller's thread, or queues for
            the send loop.
    """

    def __init__(self, state: LinkState, outbox: Outbox):
        self._state = state
        self._outbox = outbox
        self._linger = state.config.frame_linger
        self._last_sent = 0.0  # when a frame last left the writer
        self._closed = False

    def close(self) -> None:
        """The actor is closing: a partial frame no longer leaves early (from the caller's
        thread, or handed to the I/O thread as soon as it starts)."""
        self._closed = True

    def direct(self) -> bool:
        """May the caller's thread send itself? Only on a plane that allows any thread (tcp,
        shm); asked per frame, because a reconnect may land on another plane."""
        return bool(getattr(self._state.sender, "any_thread", False))

    def route(self, frame: FrameBuffer | BorrowedFrame, why: Why, now: float) -> Route:
        """The send policy. :attr:`Route.NOW` for a frame buffer means the caller holds
        ``send_lock`` and all the frame's credit; for a borrowed frame, that nothing is queued
        before it (it takes credit part by part as it leaves)."""
        if why is Why.LINGERED:
            # Through the loop's ready queue, like every other hand-off: an earlier full frame
            # handed off by the caller's thread may still be waiting there, and frames must
            # reach the wire in seq order. (Sent from there, not under the writer's lock: a
            # busy actor's puts do not wait for it.)
            return Route.LOOP
        if why is Why.FIRST and now - self._last_sent < self._linger:
            return Route.LINGER  # the last frame is still in flight: wait for company
        direct = self.direct()
        if why is Why.BORROWED:
            return Route.NOW if direct and self._outbox.idle() else Route.LOOP
        if why is Why.FULL:
            if direct and self._outbox.claim_full(frame.n):
                return Route.NOW
            return Route.LOOP
        if self._closed:
            return Route.LINGER if why is Why.FIRST else Route.LOOP
        if direct:
            if self._outbox.claim_idle(frame):
                return Route.NOW
        elif why is Why.FIRST and self._state.connected and self._outbox.credit.at_hand(frame.n) and self._outbox.idle():
            # A plane only the I/O thread sends on (ucx): hand the frame over now, while that
            # thread has nothing queued and no send under way. Without credit for it the frame
            # would only wait in the queue: better fill it meanwhile.
            return Route.LOOP
        return Route.LINGER if why is Why.FIRST else Route.LOOP

    def leave(self, fb: FrameBuffer, why: Why, next_seq: int) -> Left:
        """Let the writer's frame buffer ``fb`` go as :meth:`route` decides (writer's lock held;
        ``next_seq``: the seq of the writer's next step, for a buffer emptied here)."""
        now = time.monotonic()
        route = self.route(fb, why, now)
        if route is Route.LINGER:
            return Left.WAITING
        self._last_sent = now
        if route is Route.LOOP:
            if why is Why.FULL or why is Why.NOW:
                self._outbox.hand_off(fb)
                return Left.WHOLE
            frame, left = self._detach(fb, next_seq)
            self._outbox.hand_off(frame)
            return left
        try:
            return self._send_now(fb, why, next_seq)
        finally:
            self._outbox.release_send()

    def _send_now(self, fb: FrameBuffer, why: Why, next_seq: int) -> Left:
        """Send ``fb`` from the caller's thread (send_lock and its credit held). Unless it must
        be kept for resending, the buffer, emptied, takes the next steps (cache-warm)."""
        outbox = self._outbox
        keep = self._state.resend
        if why is Why.FULL:
            if keep:
                outbox.keep(fb)
            outbox.send_part_or_fail(fb, fb.n)  # raises where the frame is lost
            if keep:
                return Left.WHOLE
            fb.reset(next_seq, fb.version)
            return Left.EMPTIED
        frame, left = self._detach(fb, next_seq) if keep else (fb, Left.EMPTIED)
        if keep:
            outbox.keep(frame)
        try:
            outbox.send_part_or_fail(frame, frame.n)
        except RLinkError:
            # Not kept for resending: the reconnect (or the final error, raised by the next
            # call) is under way, and the learner counts the steps lost when it resumes.
            pass
        if not keep:
            fb.reset(next_seq, fb.version)
        return left

    def _detach(self, fb: FrameBuffer, next_seq: int) -> tuple[FrameBuffer, Left]:
        """The partial frame ``fb`` leaves: as a right-sized copy while small (``fb`` is emptied
        for the next steps), else whole."""
        schema = self._outbox.schema
        assert schema is not None
        if fb.n * schema.step_bytes <= _COMPACT_BYTES:
            frame = fb.compact(schema)
            fb.reset(next_seq, fb.version)
            if self._state.resend and self._outbox.kept() % _ACK_EVERY == _ACK_EVERY - 1:
                self._outbox.sync_soon(next_seq)
            return frame, Left.EMPTIED
        return fb, Left.WHOLE

    def wait_credit_for_borrowed(self, deadline: float) -> None:
        """Before a large put takes the writer's lock: where the caller's thread may send it,
        wait (outside the lock, so close() is never held up by a put) until some credit is at
        hand."""
        if self.direct():
            self._outbox.credit.wait(deadline)

    def leave_borrowed(self, frame: BorrowedFrame) -> bool:
        """Send the large put ``frame`` as :meth:`route` decides (writer's lock held): True once
        all of it is on the wire; False when (the rest of) it went to the I/O thread's queue,
        which sets ``frame.done`` when it finished."""
        now = time.monotonic()
        self._last_sent = now
        if self.route(frame, Why.BORROWED, now) is Route.NOW:
            try:
                if self._outbox.send_direct(frame):
                    return True
            except (PeerLost, ProtocolError):
                # The connection broke mid-put. The caller's arrays stay ours until it returns,
                # so the frame goes to the I/O thread, which resends it from where the learner
                # stopped once it has reconnected (or fails it for good).
                if self._state.error is not None or self._state.config.reconnect_timeout <= 0:
                    raise
        frame.done = threading.Event()
        self._outbox.hand_off(frame)
        return False
