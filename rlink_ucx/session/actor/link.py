"""The actor's connection to the learner, living on its I/O loop.

Its parts, one concern each: :class:`Handshake` (``actor_connect``), :class:`ControlReader`
(``actor_control``), :class:`Reconnect` (``actor_reconnect``) and :class:`Outbox`
(``actor_outbox``). This module holds the state they share, in one place, and ``close``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

from ...config import Config
from ...errors import RLinkError
from ...transport.base import FrameSender
from ...transport.control import ControlConnection
from ...transport.frame_memory import FrameMemory
from ...wire import messages as _wire
from ...wire.codec import Schema
from .connect import Handshake
from .control import ControlReader
from .frames import BorrowedFrame, FrameBuffer
from .outbox import Outbox
from .reconnect import Reconnect

__all__ = ["ActorConnection"]


class ActorConnection(Handshake, ControlReader, Reconnect, Outbox):
    """Everything the actor does on its I/O loop. Errors land in :attr:`error` for the caller."""

    def __init__(self, host: str, port: int, *, token: bytes | None, transport: str, actor_id: int | None,
                 incarnation: int, config: Config, loop: asyncio.AbstractEventLoop,
                 insecure: bool = False):  # fmt: skip
        self.host, self.port = host, port
        self.token = token  # None: the learner's generated token, looked up at each attempt
        # The token the last handshake proved (None: a learner that does not authenticate): the
        # session's keys derive from it. Never looked up again: for an insecure learner on
        # loopback, a token file left on its port by a killed learner made every data
        # connection's proof wrong, and the actor retried until its connect_timeout.
        self.proved_token: bytes | None = None
        self.insecure = insecure  # accept a learner that does not authenticate
        self.transport_wanted = transport
        self.actor_id = actor_id
        self.incarnation = incarnation
        self.config = config
        self.loop = loop
        self.control: ControlConnection | None = None
        self.sender: FrameSender | None = None
        self.welcome: _wire.Welcome | None = None
        self.error: RLinkError | None = None
        self.schema: Schema | None = None
        self.schema_id = 0
        self.credit = 0  # guarded by credit_cv: the loop adds, senders take
        self.credit_cv = threading.Condition()
        self.send_lock = threading.Lock()  # one frame on the wire at a time, from any thread
        self.outstanding = 0  # frames handed to the loop and not yet sent (guarded by changed)
        self.next_send_seq = 0  # seq of the next step to go on the wire
        self.acked = 0  # learner holds every step with seq < acked
        self.sent_steps = 0
        self.sent_frames = 0
        self.sent_bytes = 0
        self.credit_waits = 0
        self.last_heard = time.monotonic()
        self.frame_sent_at = 0.0  # when the last frame went out (liveness, like a control message)
        self.queue: collections.deque[FrameBuffer | BorrowedFrame] = collections.deque()
        self.free: list[FrameBuffer] = []
        # Sent but not yet acknowledged, in seq order: kept for resending after a reconnect.
        self.inflight: collections.deque[FrameBuffer] = collections.deque()
        self.resend = config.resend_buffer_bytes > 0
        self.max_frame_steps = 1 << 62  # the learner's per-frame limit (from Accept)
        self.connected = False  # handshake done and data plane ready; False while reconnecting
        self.reconnecting = False
        self.subscription: Any = None  # the Subscribe message to repeat after a reconnect
        self.reconnects = 0
        self.buffers = 0  # frame buffers allocated (the actor allocates more while resending needs them)
        self.steps_lost = 0  # sent, unacknowledged and not kept for resending when a link broke
        self.changed = threading.Condition()  # signals free buffers, acks and errors to callers
        self._wake = asyncio.Event()
        self._credit_event = asyncio.Event()
        self._ready: asyncio.Future[str] = loop.create_future()
        self._proposal: asyncio.Future[_wire.Accept | _wire.Reject] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.closing = False
        self.latest_version = 0  # the newest model version the learner announced
        self.weights_listener: Any = None  # the Subscriber's deliver(), once subscribed
        self.memory = FrameMemory(config)  # frame buffers: the shm plane's arena, or a populated reserve
        self._attempt: tuple[Any, float | None] = (None, None)  # the connect attempt's timeout scope


    # --- closing -----------------------------------------------------------------------------------
    async def close(self) -> None:
        self.closing = True
        for frame in self.queue:  # callers waiting on a large put: they raise Closed
            if isinstance(frame, BorrowedFrame) and frame.done is not None:
                frame.done.set()
        with self.credit_cv:
            self.credit_cv.notify_all()
        if self.control is not None and self.error is None:
            self.control.send(_wire.Bye("actor closing"))
        for task in self._tasks:
            task.cancel()
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.control is not None:
            self.control.close()

