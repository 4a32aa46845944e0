"""The state the parts of one actor connection truly share, declared in one place.

Each part (``connect``, ``attach``, ``control``, ``heartbeat``, ``reconnect``, ``outbox``, and
the writer's ``policy``) owns the fields only it writes and answers the others through its
methods (the outbox owns the frames, the credit and the send counters; the heartbeat, when the
learner was last heard; the reconnect part, its retry state; the connector, the tokens). What
stays here is the session itself, which several parts read and the loop thread writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...config import Config
from ...errors import PeerLost, Rejected, RLinkError
from ...transport.base import FrameSender
from ...transport.control import ControlConnection
from ...wire import keys as _keys
from ...wire import messages as _wire

__all__ = ["LinkState", "Rejected"]


@dataclass(eq=False)
class LinkState:
    """One actor's connection to its learner: what more than one of its parts reads or writes.

    No lock guards it: every field is written on the I/O loop's thread only (the weights
    subscription excepted, see below), and other threads read each reference whole.
    """

    # The learner this actor talks to now: the address it was given (rank 0 of a job of many
    # learners), or the rank that rank 0 sent it to (loop thread; see ``home``).
    host: str
    port: int
    # Fixed at construction.
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
    control: ControlConnection | None = None
    sender: FrameSender | None = None  # the data plane; any thread sends on it under the outbox's send_lock
    welcome: _wire.Welcome | None = None
    error: RLinkError | None = None  # set once the connection failed for good
    connected: bool = False  # handshake done and data plane ready; False while reconnecting
    closing: bool = False
    latest_version: int = 0  # the newest model version the learner announced
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    ready: asyncio.Future[str] = field(init=False)  # the learner's Ready for the current attempt
    proposal: asyncio.Future[_wire.Accept | _wire.Reject] | None = None  # a schema proposal's answer

    # The weights subscription: set by the Subscriber (outside the loop), read on the loop.
    subscription: Any = None  # the Subscribe message to repeat after a reconnect
    weights_listener: Callable[[Any], None] | None = None  # the Subscriber's deliver(), once subscribed

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
