"""The data-plane interface: what every transport backend provides.

A backend moves *frames*: a fixed-size header plus a list of payload buffers. It knows nothing
about RL, schemas or versions. On the learner, the receiver asks a :class:`FrameSink` where
each frame's payload goes, so the bytes land in their final place with no extra copy.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import PeerLost


class DataPlaneRetired(PeerLost):
    """The learner retired the data plane a session used (not a fault): the actor reconnects to
    the new one. The session ends as ``"moved"``, not ``"lost"``."""


class FrameSink(Protocol):
    """Learner-side consumer of one peer's frames (implemented by the session).

    A sink may also offer ``land(header, payload)``: a whole frame whose payload is already
    in memory, validated, copied and completed in one call (the session does; a receiver
    that reads small frames into a buffer of its own uses it when present).
    """

    def begin(self, header: bytes) -> list[memoryview]:
        """(Any thread.) Validate a frame header; return the buffers its payload is written into, in order.

        Raises ``ProtocolError`` for a header that must not be accepted.
        """

    def end_threadsafe(self) -> None:
        """The payload of the frame from the last ``begin`` is complete (any thread)."""

    def abandon(self) -> None:
        """Nothing more will be written into the current frame's buffers: it is torn."""

    def fail_threadsafe(self, exc: BaseException) -> None:
        """The data connection broke or misbehaved; any frame in progress is torn.

        ``EOFError`` means the peer closed the data plane cleanly between two frames.
        """


class FrameSender(Protocol):
    """Actor side: sends frames in order."""

    name: str
    any_thread: bool  # may send() run on a caller's thread, or only on the I/O loop?

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        """Send one frame (blocking, bounded by ``frame_timeout``); returns when every buffer
        may be reused. Callers serialize sends with the connection's send lock."""

    def on_ready(self, answer: bytes) -> None:
        """The learner's Ready: its plane's ``answer`` at the attach (opaque bytes the plane
        decodes; on shm, whether the learner mapped the actor's frame buffers and may read its
        memory directly). Planes with nothing to learn ignore it."""

    def close(self) -> None: ...


class FrameReceiver(Protocol):
    """Learner side: receives one peer's frames into the buffers its sink provides."""

    name: str

    @property
    def frame_started(self) -> float | None:
        """Monotonic time the current frame began, None between frames."""

    def start(self) -> None: ...

    def close(self) -> None: ...
