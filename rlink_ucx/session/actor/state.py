"""The state the parts of one actor connection share, declared in one place.

Each part (``connect``, ``attach``, ``control``, ``heartbeat``, ``reconnect``, ``outbox``, and
the writer's ``policy``) is handed this object and the other parts it calls; what only one
part uses stays in that part. The comment above each group says which thread writes it and
which lock guards it.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...config import Config
from ...errors import PeerLost, Rejected, RLinkError
from ...transport.base import FrameSender
from ...transport.control import ControlConnection
from ...wire import keys as _keys
from ...wire import messages as _wire
from ...wire.codec import Schema
from .frames import BorrowedFrame, FrameBuffer

__all__ = ["LinkState", "Rejected"]


@dataclass(eq=False)
class LinkState:
    """One actor's connection to its learner: what more than one of its parts reads or writes."""

    # The learner this actor talks to now: the address it was given (rank 0 of a job of many
    # learners), or the rank that rank 0 sent it to (loop thread; see ``home``).
    host: str
    port: int
    # Fixed at construction.
    token: bytes | None  # None: the learner's generated token, looked up at each attempt
    insecure: bool  # accept a learner that does not authenticate
    transport_wanted: str
    incarnation: int
    config: Config
    loop: asyncio.AbstractEventLoop
    actor_id: int | None  # the given id; the learner's Welcome sets the assigned one (loop thread)

    # The address the actor was given, where every placement starts (set from host and port).
    home: tuple[str, int] = ("", 0)
    rank: int = 0  # the learner rank serving this actor (0 unless a job of many learners sent it on)

    # The session: written on the loop thread only; other threads read these references whole.
    # The token the last handshake proved (None: a learner that does not authenticate): the
    # session's keys derive from it, and it is never looked up again while the session lives,
    # so a token file left on the port by another learner cannot make a data proof wrong.
    proved_token: bytes | None = None
    token_for_ranks: bytes | None = None  # the generated token rank 0 took: the other ranks' too
    control: ControlConnection | None = None
    sender: FrameSender | None = None  # the data plane; any thread sends on it under send_lock
    welcome: _wire.Welcome | None = None
    error: RLinkError | None = None  # set once the connection failed for good
    connected: bool = False  # handshake done and data plane ready; False while reconnecting
    reconnecting: bool = False
    closing: bool = False
    reconnects: int = 0
    latest_version: int = 0  # the newest model version the learner announced
    last_heard: float = field(default_factory=time.monotonic)  # when the learner's last message came
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    ready: asyncio.Future[str] = field(init=False)  # the learner's Ready for the current attempt
    proposal: asyncio.Future[_wire.Accept | _wire.Reject] | None = None  # a schema proposal's answer

    # The weights subscription: set by the Subscriber (outside the loop), read on the loop.
    subscription: Any = None  # the Subscribe message to repeat after a reconnect
    weights_listener: Callable[[Any], None] | None = None  # the Subscriber's deliver(), once subscribed

    # The schema: set once by the writer's negotiation (before any frame), again by a
    # reconnect's renegotiation on the loop thread (while no frame is sent).
    schema: Schema | None = None
    schema_id: int = 0
    max_frame_steps: int = 1 << 62  # the learner's per-frame limit (from Accept)

    # Credit, guarded by credit_cv: the loop adds it, senders on any thread take it.
    credit: int = 0
    credit_waits: int = 0  # a statistic: the send loop counts its waits without the lock
    credit_cv: threading.Condition = field(default_factory=threading.Condition)

    # Frames, guarded by changed, which also signals free buffers, acknowledgements and errors
    # to callers. ``queue`` is the I/O loop's (it appends and pops there; the reconnect's
    # requeue and the release at close rebuild it under changed).
    outstanding: int = 0  # frames handed to the loop and not yet sent
    acked: int = 0  # the learner holds every step with seq < acked
    queue: collections.deque[FrameBuffer | BorrowedFrame] = field(default_factory=collections.deque)
    free: list[FrameBuffer] = field(default_factory=list)
    inflight: collections.deque[FrameBuffer] = field(default_factory=collections.deque)  # sent, kept for resending
    buffers: int = 0  # frame buffers allocated (more while resending needs them)
    steps_lost: int = 0  # sent, unacknowledged and not kept for resending when a link broke
    changed: threading.Condition = field(default_factory=threading.Condition)

    # What goes on the wire, guarded by send_lock (one frame on the wire at a time, any thread).
    next_send_seq: int = 0  # seq of the next step to go on the wire
    sent_steps: int = 0
    sent_frames: int = 0
    sent_bytes: int = 0
    frame_sent_at: float = 0.0  # when the last frame went out: it says we are alive, as a control message does
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    # Loop-thread signals to the send loop.
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a frame was queued, or an error
    credit_event: asyncio.Event = field(default_factory=asyncio.Event)  # credit came, or an error

    _weights_key: tuple[bytes, bytes] | None = None  # (the session's ticket, its weights key)

    def __post_init__(self) -> None:
        self.ready = self.loop.create_future()
        self.home = (self.host, self.port)

    def go_home(self) -> None:
        """Talk to the address the actor was given again (its rank did not answer): rank 0
        places it anew."""
        self.host, self.port = self.home
        self.rank = 0

    @property
    def resend(self) -> bool:
        """Whether sent frames are kept until acknowledged, for resending after a reconnect."""
        return self.config.resend_buffer_bytes > 0

    def weights_key(self) -> bytes:
        """This session's weights key (``wire.keys.session_key``), from the token; for a learner
        that does not authenticate, from the ticket alone (which protects nothing)."""
        welcome = self.welcome
        if welcome is None:
            raise PeerLost("no session with the learner")
        cached = self._weights_key
        if cached is not None and cached[0] == welcome.ticket:  # a restarted learner reuses session ids
            return cached[1]
        key = _keys.session_key(self.proved_token, welcome.ticket, welcome.session)
        self._weights_key = (welcome.ticket, key)
        return key
