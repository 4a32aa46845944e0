"""Attaching an actor's data connection to its session on the learner: the tcp plane, or the
shm plane's doorbell with the actor's arena mapped and its memory probed for direct reads.
Both read from the actor's process, so its pid must first be shown by the kernel to hold the
actor's end of this data connection (``transport/peer.py``): Hello's pid alone is a claim."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import AuthError, ProtocolError
from ...transport import cma, peer, shm
from ...transport.control import ControlConnection
from ...transport.tcp import TcpReceiver
from ...wire import auth as _auth
from ...wire import messages as _wire
from .session import LearnerSession

log = logging.getLogger(__name__)


def attach_data_connection(sessions: dict[int, LearnerSession], conn: ControlConnection, msg: _wire.Attach,
                           nonce: bytes, congestion: str) -> LearnerSession:
    """Hand ``conn`` to the session its Attach names (proven with the session's key) as
    the receiver of its frames; returns that session."""
    session = sessions.get(msg.session)
    if session is None or session.state != "open":
        raise AuthError("data connection for an unknown session")
    _auth.verify(_auth.data_proof(session.key, nonce, msg.session), msg.mac, "data connection")
    if session.transport not in ("tcp", "shm") or session.receiver is not None:
        raise ProtocolError("session already has its data plane")
    conn.handed_off = True
    ring, session.shm_ring = session.shm_ring, None
    arena, direct = None, False
    if ring is not None and msg.shm:
        ring.release_fd()  # the actor mapped it before attaching
        actor = _proven_actor(session, conn) if msg.arena is not None or msg.cma is not None else None
        arena = _map_arena(session, msg.arena) if actor is not None else None
        if arena is not None:
            session.transport_reason += "; frames read in place from the actor's shared frame buffers"
        direct = actor is not None and _probe_memory(session, msg.cma)
        if direct:
            session.transport_reason += "; large payloads read straight from the actor's memory"
        elif actor is not None:
            actor.close()
        session.receiver = shm.ShmReceiver(conn.sock, ring, session, name=f"rlink-shm-recv-{session.actor_id}",
                                           arena=arena, actor_pid=actor if direct else None)
    else:
        if ring is not None:
            ring.close()
            session.transport = "tcp"
            session.transport_reason = "auto: the actor could not map the shared-memory ring; tcp instead"
            log.info("actor %s: %s", session.actor_id, session.transport_reason)
        session.receiver = TcpReceiver(conn.sock, session, name=f"rlink-tcp-recv-{session.actor_id}",
                                       congestion=congestion)
    session.receiver.start()
    session.control.send(_wire.AttachProof(session.server.publisher.attach_proof(session, session.transport)))
    session.control.send(_wire.Ready(session.transport, arena is not None, direct))
    return session


def _proven_actor(session: LearnerSession, conn: ControlConnection) -> cma.Process | None:
    """The actor's process, where the kernel shows the pid its Hello named holding the actor's
    end of this data connection; None (everything comes through the ring) where it does not."""
    pid = session.hello.pid
    try:
        process = cma.Process(pid)  # first: a pid reused after the check shows as exited
    except (OSError, OverflowError, ValueError) as exc:
        log.info("actor %s: no handle on its process %s (%s); its frames come through the ring",
                 session.actor_id, pid, exc)  # fmt: skip
        return None
    if not peer.holds_peer_socket(conn.sock, pid) or process.exited():
        process.close()
        log.warning("actor %s: process %s does not hold the actor's end of its data connection; its memory "
                    "is not read, its frames come through the ring", session.actor_id, pid)  # fmt: skip
        return None
    return process


def _map_arena(session: LearnerSession, where: Any) -> shm.ShmRing | None:
    """Map the actor's frame buffers (checked like the actor checks our ring: an rlink
    memfd, sealed, the announced size and nonce); None: its frames come through the ring."""
    if where is None:
        return None
    try:
        pid, fd, nonce, size = where
        # Checked by type before use: bytes(n) of a hostile int n would allocate n bytes.
        if type(pid) is not int or type(fd) is not int or type(size) is not int or type(nonce) is not bytes:
            raise ValueError("malformed arena")
        if pid != session.hello.pid:
            raise OSError(f"the arena is announced in process {pid}, the actor is {session.hello.pid}")
        return shm.ShmRing.open(pid, fd, nonce, size, shm.ARENA_NAME)
    except (OSError, ValueError, TypeError, OverflowError) as exc:
        log.info("actor %s: its frame buffers cannot be mapped (%s); its frames come through the ring",
                 session.actor_id, exc)  # fmt: skip
        return None


def _probe_memory(session: LearnerSession, where: Any) -> bool:
    """Whether the kernel lets us read the actor's memory (its probe holds the nonce it
    announced): then its large payloads come by address (transport/cma.py)."""
    if where is None:
        return False
    try:
        cma.verify(session.hello.pid, where)
        return True
    except (OSError, ValueError, TypeError, OverflowError) as exc:
        log.info("actor %s: its memory cannot be read directly (%s); large payloads come through the ring",
                 session.actor_id, exc)  # fmt: skip
        return False

