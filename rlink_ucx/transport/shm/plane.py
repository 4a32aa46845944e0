"""The ``shm`` plane behind the plane interface (``transport/plane.py``): the ring, the sender and
the receiver are in ``channel.py`` and ``memory.py``.

The learner makes one ring per session when it opens it and announces it in the Welcome; the
actor maps it and attaches its data connection, the ring's doorbell. Whichever side cannot
(another PID namespace or user) falls back to the tcp plane over that same connection, unless
shm was asked for by name. At the attach the learner maps the actor's arena and probes its
memory for direct reads, both only from a process the kernel shows to hold the actor's end of
this data connection (``peer.py``): the Hello's pid alone is a claim.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec

from ...errors import ProtocolError, Rejected
from ...wire import messages as _wire
from ..plane import ActorSide, Attached, Opening, Plane, SessionSide, Situation, decode_blob, encode_blob
from ..tcp.plane import TcpOpening, TcpPlane, open_data_connection, send_timeout, tcp_receiver
from ..tcp.stream import TcpSender
from . import cma, peer
from .channel import ARENA_NAME, ReadyAnswer, ShmReceiver, ShmRing, ShmSender, available

if TYPE_CHECKING:
    from ..base import FrameReceiver
    from ..control import ControlConnection

log = logging.getLogger(__name__)


class RingAnswer(msgspec.Struct, array_like=True, frozen=True):
    """The Welcome's answer on this plane: the learner's ring, a memfd in process ``pid``."""

    pid: int
    fd: int
    nonce: bytes
    size: int


class AttachDetail(msgspec.Struct, array_like=True, frozen=True):
    """The actor's Attach detail on this plane: whether it mapped the ring (else: tcp on the
    data connection), its frame buffers [pid, memfd number, nonce, bytes] and its memory
    probe [address, nonce] (``cma.py``), each checked where it is used."""

    mapped: bool
    arena: list[Any] | None = None
    cma: list[Any] | None = None


class ShmPlane(Plane):
    """Actor and learner on one host share a byte ring in memory."""

    name = "shm"
    preference = 1

    @classmethod
    def available(cls) -> bool:
        return available()

    @classmethod
    def offered(cls, wanted: str) -> bool:
        return available() and wanted in ("auto", cls.name)

    @classmethod
    def refusal(cls, s: Situation) -> str | None:
        if not s.same_host:
            return "shm requested but the actor runs on another host"
        if cls.name not in s.both:
            return "shm requested but this platform cannot share a memfd ring (Linux only)"
        return None

    @classmethod
    def auto(cls, s: Situation) -> tuple[bool, str]:
        # Same host: one copy into and one out of a shared ring, no system call per byte. It
        # beats TCP at every size and UCX's own shared memory up to ~1 MiB steps
        # (docs/benchmarks.md); only CUDA transports are worth UCX here (UcxPlane.auto).
        if s.same_host and cls.name in s.both:
            return True, "auto: same host, shared-memory ring"
        return False, ""

    # --- the actor's side ----------------------------------------------------------------------
    @classmethod
    async def connect(cls, side: ActorSide) -> Attached:
        ring, welcome = cls._map_ring(side)
        if ring is None:  # tcp on the data connection instead
            data = await open_data_connection(side)
            sender = TcpSender(data.sock, side.loop, send_timeout(side), side.config.tcp_congestion)
            return Attached(sender, welcome)
        arena = side.memory.shared()
        probe = side.memory.cma_probe()
        detail = AttachDetail(True, arena.describe() if arena is not None else None,
                              probe.describe() if probe is not None else None)  # fmt: skip
        data = await open_data_connection(side, encode_blob(detail))
        # The arena goes with the Attach; the learner's Ready says whether it mapped it.
        return Attached(ShmSender(data.sock, ring, send_timeout(side), arena), welcome)

    @classmethod
    def _map_ring(cls, side: ActorSide) -> tuple[ShmRing | None, _wire.Welcome]:
        """Map the learner's ring; None (tcp on the data connection instead) where it cannot be
        reached from here, e.g. another PID namespace or user, unless shm was requested."""
        welcome = side.welcome
        try:
            ring = decode_blob(welcome.answer, RingAnswer, "shm ring answer")
            return ShmRing.open(ring.pid, ring.fd, ring.nonce, ring.size), welcome
        except (OSError, ValueError, TypeError, ProtocolError) as exc:
            if side.wanted == cls.name:
                raise Rejected(f"shm requested but the learner's ring cannot be mapped here: {exc}") from exc
            reason = f"auto: the learner's shared-memory ring cannot be mapped here ({exc}); tcp instead"
            log.info(reason)
            return None, msgspec.structs.replace(welcome, transport=TcpPlane.name, reason=reason)

    # --- the learner's side --------------------------------------------------------------------
    def open(self, reason: str) -> Opening:
        try:
            ring, nonce = ShmRing.create(self.context.config.shm_ring_bytes)
        except OSError as exc:
            if reason == "requested":
                raise Rejected(f"shm requested but the learner cannot create its ring: {exc}") from exc
            why = f"auto: the shared-memory ring could not be created ({exc})"
            return TcpOpening(TcpPlane, why, congestion=self.context.config.tcp_congestion)
        assert ring.fd is not None
        answer = encode_blob(RingAnswer(os.getpid(), ring.fd, nonce, ring.size))
        return ShmOpening(ShmPlane, reason, answer=answer, congestion=self.context.config.tcp_congestion, ring=ring)


class ShmOpening(Opening):
    """An shm session's ring, from its Welcome until its data connection attaches."""

    def __init__(self, plane: type[Plane], reason: str, *, ring: ShmRing, answer: bytes = b"",
                 congestion: str = "auto"):  # fmt: skip
        super().__init__(plane, reason, answer=answer, congestion=congestion)
        self.ring: ShmRing | None = ring

    def close(self) -> None:
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()

    def attach(self, session: SessionSide, conn: ControlConnection | None,
               msg: _wire.Attach | None) -> tuple[FrameReceiver, _wire.Ready]:  # fmt: skip
        assert conn is not None and msg is not None
        try:  # a malformed detail ends the attach, the ring with it
            detail = decode_blob(msg.detail, AttachDetail, "shm attach detail") if msg.detail else AttachDetail(False)
        except ProtocolError:
            self.close()
            raise
        ring, self.ring = self.ring, None
        if ring is None or not detail.mapped:
            if ring is not None:
                ring.close()
            session.transport = TcpPlane.name
            session.transport_reason = "auto: the actor could not map the shared-memory ring; tcp instead"
            log.info("actor %s: %s", session.actor_id, session.transport_reason)
            return tcp_receiver(session, conn, self.congestion), _wire.Ready(session.transport)
        ring.release_fd()  # the actor mapped it before attaching
        actor = _proven_actor(session, conn) if detail.arena is not None or detail.cma is not None else None
        arena = _map_arena(session, detail.arena) if actor is not None else None
        if arena is not None:
            session.transport_reason += "; frames read in place from the actor's shared frame buffers"
        direct = actor is not None and _probe_memory(session, detail.cma)
        if direct:
            session.transport_reason += "; large payloads read straight from the actor's memory"
        elif actor is not None:
            actor.close()
        receiver = ShmReceiver(conn.sock, ring, session, name=f"rlink-shm-recv-{session.actor_id}",
                               arena=arena, actor_pid=actor if direct else None)  # fmt: skip
        receiver.start()
        return receiver, _wire.Ready(session.transport, encode_blob(ReadyAnswer(arena is not None, direct)))


def _proven_actor(session: SessionSide, conn: ControlConnection) -> cma.Process | None:
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


def _map_arena(session: SessionSide, where: Any) -> ShmRing | None:
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
        return ShmRing.open(pid, fd, nonce, size, ARENA_NAME)
    except (OSError, ValueError, TypeError, OverflowError) as exc:
        log.info("actor %s: its frame buffers cannot be mapped (%s); its frames come through the ring",
                 session.actor_id, exc)  # fmt: skip
        return None


def _probe_memory(session: SessionSide, where: Any) -> bool:
    """Whether the kernel lets us read the actor's memory (its probe holds the nonce it
    announced): then its large payloads come by address (``cma.py``)."""
    if where is None:
        return False
    try:
        cma.verify(session.hello.pid, where)
        return True
    except (OSError, ValueError, TypeError, OverflowError) as exc:
        log.info("actor %s: its memory cannot be read directly (%s); large payloads come through the ring",
                 session.actor_id, exc)  # fmt: skip
        return False
