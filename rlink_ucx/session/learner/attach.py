"""Attaching an actor's data connection to its session on the learner: the session's plane
(``transport/plane.py``) takes the connection as the receiver of the session's frames."""

from __future__ import annotations

from ...errors import AuthError, ProtocolError
from ...transport.control import ControlConnection
from ...transport.session_state import SessionState
from ...wire import auth as _auth
from ...wire import messages as _wire
from .session import LearnerSession


def attach_data_connection(sessions: dict[int, LearnerSession], conn: ControlConnection, msg: _wire.Attach,
                           nonce: bytes) -> LearnerSession:
    """Hand ``conn`` to the session its Attach names (proven with the session's key) as
    the receiver of its frames; returns that session."""
    session = sessions.get(msg.session)
    if session is None or session.state is not SessionState.OPEN:
        raise AuthError("data connection for an unknown session")
    _auth.verify(_auth.data_proof(session.key, nonce, msg.session), msg.mac, "data connection")
    opening = session.opening
    if opening is None or not opening.plane.data_connection or session.receiver is not None:
        raise ProtocolError("session already has its data plane")
    conn.handed_off = True
    session.opening = None
    session.receiver, ready = opening.attach(session, conn, msg)
    session.control.send(_wire.AttachProof(session.server.publisher.attach_proof(session, session.transport)))
    session.control.send(ready)
    return session
