"""The ``tcp`` plane behind the plane interface (``transport/plane.py``): the sender and the
receiver are in ``stream.py``. Every learner offers it and every actor can use it: it is what ``auto`` falls
back to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...wire import auth as _auth
from ...wire import messages as _wire
from ..plane import ActorSide, Attached, Opening, Plane, SessionSide, Situation
from .stream import TcpReceiver, TcpSender

if TYPE_CHECKING:
    from ..base import FrameReceiver
    from ..control import ControlConnection


def send_timeout(side: ActorSide) -> float:
    """How long a data connection's send may make no progress: that long means a frozen or
    vanished learner (the blocking send holds the I/O thread, so the heartbeat could not tell)."""
    return min(side.config.frame_timeout, side.config.heartbeat_timeout)


async def open_data_connection(side: ActorSide, detail: bytes = b"") -> ControlConnection:
    """Open the actor's data connection and send its Attach on it: the proof, and the plane's
    own attach ``detail`` (opaque bytes the plane's learner side decodes)."""
    data, challenge = await side.open_data()
    proof = _auth.data_proof(side.session_key, challenge.nonce, side.welcome.session)
    data.send(_wire.Attach(_wire.PROTOCOL_VERSION, side.welcome.session, proof, detail))
    return data


def tcp_receiver(session: SessionSide, conn: ControlConnection, congestion: str) -> FrameReceiver:
    receiver = TcpReceiver(conn.sock, session, name=f"rlink-tcp-recv-{session.actor_id}", congestion=congestion)
    receiver.start()
    return receiver


class TcpOpening(Opening):
    def attach(self, session: SessionSide, conn: ControlConnection | None,
               msg: _wire.Attach | None) -> tuple[FrameReceiver, _wire.Ready]:  # fmt: skip
        assert conn is not None
        return tcp_receiver(session, conn, self.congestion), _wire.Ready(session.transport)


class TcpPlane(Plane):
    """A second TCP connection per actor, scatter-gather I/O."""

    name = "tcp"
    preference = 2
    every_actor = True

    @classmethod
    def auto(cls, s: Situation) -> tuple[bool, str]:
        return True, ""

    @classmethod
    async def connect(cls, side: ActorSide) -> Attached:
        data = await open_data_connection(side)
        sender = TcpSender(data.sock, side.loop, send_timeout(side), side.config.tcp_congestion)
        return Attached(sender, side.welcome)

    def open(self, reason: str) -> Opening:
        return TcpOpening(type(self), reason, congestion=self.context.config.tcp_congestion)
