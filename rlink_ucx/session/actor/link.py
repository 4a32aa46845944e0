"""The actor's connection to the learner, living on its I/O loop: its parts, composed.

Each part owns the fields only it writes and is handed the shared :class:`~.state.LinkState`
(the session itself) and the parts it calls:
:class:`~.attach.PlaneAttach` (the data plane and the frame buffers' memory),
:class:`~.outbox.Outbox` (frame pool, credit, send queue), :class:`~.heartbeat.Heartbeat`,
:class:`~.control.ControlReader`, :class:`~.connect.Connector` (one connection attempt, schema
proposals) and :class:`~.reconnect.Reconnect` (retries, and what a failure becomes). A failure
in any of them reaches the reconnect part through :meth:`ActorConnection.fail`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...config import Config
from ...errors import RLinkError
from ...transport.base import FrameSender
from ...transport.control import ControlConnection
from ...transport.loop import IOThread
from ...wire import messages as _wire
from ...wire.codec import Schema
from .attach import PlaneAttach
from .connect import Connector, open_channel
from .control import ControlReader
from .frames import FrameBuffer
from .heartbeat import Heartbeat
from .outbox import Outbox
from .reconnect import Reconnect
from .state import LinkState

__all__ = ["ActorConnection", "FrameBuffer"]


class ActorConnection:
    """Everything the actor does on its I/O loop. Errors land in :attr:`error` for the caller.

    Its attributes are what :class:`~rlink_ucx.weights.subscriber.Link` names (the weights
    subscriber's view), read from the shared state.
    """

    def __init__(self, host: str, port: int, *, token: bytes | None, transport: str, actor_id: int | None,
                 incarnation: int, config: Config, io: IOThread, insecure: bool = False):  # fmt: skip
        self.state = s = LinkState(host, port, transport, incarnation, config, io.loop, actor_id)
        self.attach = PlaneAttach(s, functools.partial(open_channel, s))
        self.outbox = Outbox(s, io, self.data_plane_broke)
        self.heartbeat = Heartbeat(s, self.outbox, self.fail)
        self.reader = ControlReader(s, self.outbox, self.heartbeat, self.attach, self.fail)
        self.connector = Connector(s, self.attach, self.reader, self.heartbeat, self.outbox, token=token,
                                   insecure=insecure)  # fmt: skip
        self.reconnect = Reconnect(s, self.connector, self.outbox)

    def fail(self, exc: RLinkError) -> None:
        """The connection broke (loop thread): a reconnect, or the final error."""
        self.reconnect.fail(exc)

    def data_plane_broke(self, exc: RLinkError) -> None:
        """The data plane broke (loop thread): as :meth:`fail`, but a goodbye the learner sent
        on the control connection first is still read (a learner closing ends both)."""
        self.reconnect.fail(exc, bye_may_follow=True)

    async def open_session(self) -> None:
        """The first connection, retried until ``Config.connect_timeout``."""
        await self.reconnect.open_session()

    # --- the subscriber's Link -----------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.state.host

    @property
    def port(self) -> int:
        return self.state.port

    @property
    def actor_id(self) -> int | None:
        return self.state.actor_id

    @property
    def latest_version(self) -> int:
        return self.state.latest_version

    @property
    def error(self) -> RLinkError | None:
        return self.state.error

    @property
    def welcome(self) -> _wire.Welcome | None:
        return self.state.welcome

    @property
    def control(self) -> ControlConnection | None:
        return self.state.control

    @property
    def weights_listener(self) -> Callable[[Any], None] | None:
        return self.state.weights_listener

    @weights_listener.setter
    def weights_listener(self, listener: Callable[[Any], None] | None) -> None:
        self.state.weights_listener = listener

    @property
    def subscription(self) -> Any:
        return self.state.subscription

    @subscription.setter
    def subscription(self, msg: Any) -> None:
        self.state.subscription = msg

    def weights_key(self) -> bytes:
        return self.state.weights_key()

    # --- for the Actor ---------------------------------------------------------------------------
    @property
    def schema(self) -> Schema | None:
        return self.outbox.schema

    @property
    def sender(self) -> FrameSender | None:
        return self.state.sender

    def stats(self) -> dict[str, Any]:
        """The connection's counters (``Actor.stats`` adds its own)."""
        s = self.state
        counters = self.outbox.stats()
        lost = counters.pop("steps_lost")
        return {
            **counters,
            "reconnects": self.reconnect.count,
            "steps_lost": lost,
            "connected": s.connected,
            "error": repr(s.error) if s.error else None,
            "learner_address": f"{s.host}:{s.port}",  # the rank serving it, in a job of many learners
            "learner_rank": s.rank,
        }

    # --- closing -----------------------------------------------------------------------------------
    async def close(self) -> None:
        s = self.state
        s.closing = True
        self.outbox.closing()  # callers waiting on a large put or for credit: they raise Closed
        if s.control is not None and s.error is None:
            s.control.send(_wire.Bye("actor closing"))
        for task in s.tasks:
            task.cancel()
        if s.sender is not None:
            s.sender.close()
            s.sender = None
        if s.control is not None:
            s.control.close()

    def release(self) -> None:
        """After close (any thread): wake every caller still waiting, then drop the frame
        buffers and unmap the arena."""
        self.outbox.wake_callers()
        self.attach.release_arena(self.outbox.drop_frames)
