"""One actor's session on the learner: control messages, frame validation, credit, liveness."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...config import Config
from ...errors import PeerLost, ProtocolError, SchemaMismatch
from ...observe.ratelog import RateLimitedLog
from ...store.ring import StepRing
from ...transport.base import DataPlaneRetired
from ...transport.control import ControlConnection
from ...transport.loop import call_soon_any_thread
from ...transport.plane import get_plane
from ...transport.session_state import SessionState
from ...weights.membership import Membership
from ...weights.publisher import Publisher
from ...wire import keys as _keys
from ...wire import messages as _wire
from ...wire.codec import Schema
from ...wire.frame import FrameHeader
from .burst import land_burst
from .flow import SessionFlow
from .landing import Landing

if TYPE_CHECKING:
    from ...transport.base import FrameReceiver
    from ...transport.plane import Opening

log = logging.getLogger(__name__)


class Owner(Protocol):
    """What a session needs from the learner that owns it (a ``LearnerServer``): sessions
    call up through this, never through the server's class."""

    config: Config
    loop: asyncio.AbstractEventLoop
    publisher: Publisher
    token: bytes | None  # None when running insecure
    quiet_log: RateLimitedLog  # for lines a storm of sessions would multiply

    def negotiate_schema(self, schema: Schema) -> tuple[int, StepRing]: ...

    def grant_credits(self) -> None: ...

    def credit_low(self) -> None: ...

    def session_ended(self, session: LearnerSession, error: PeerLost | None) -> None: ...


@dataclass(slots=True)
class SessionStats:
    frames: int = 0
    steps: int = 0
    bytes: int = 0
    torn_frames: int = 0
    protocol_errors: int = 0
    duplicate_steps: int = 0  # resent after a reconnect but already delivered: dropped
    lost_steps: int = 0  # a resumed stream started past where it stopped (the actor kept no copy)
    credit_exhausted: int = 0  # frames that used the actor's last credit (its next put waits for a grant)


class LearnerSession:
    """Implements the transport's FrameSink for one authenticated actor."""

    land_burst = staticmethod(land_burst)  # whole frames of many sessions at once (a pump's burst)

    def __init__(self, server: Owner, session_id: int, control: ControlConnection, hello: _wire.Hello,
                 actor_id: int, transport: str, reason: str, ticket: bytes):  # fmt: skip
        self.server = server
        self.id = session_id
        self.control = control
        self.hello = hello
        self.actor_id = actor_id
        self.incarnation = hello.incarnation
        self.transport = transport
        self.transport_reason = reason
        self.whole_fields = get_plane(transport).whole_fields  # the receiver wants one buffer per field
        self.ticket = ticket
        # The session's key, from the token and the ticket: it proves the data connection and
        # keys the weights path. The ticket alone goes in clear in the Welcome.
        self.key = _keys.session_key(server.token, ticket, session_id)
        self.receiver: FrameReceiver | None = None
        self.opening: Opening | None = None  # what its plane holds until the session attaches
        self.schema_id: int | None = None
        self.ring: StepRing | None = None
        self.flow = SessionFlow()  # credit, revoke and flush accounting
        self.next_seq: int | None = 0  # None until the first frame of a stream resumed elsewhere
        self.resumed = False  # set by the server: next_seq is where an earlier session of this stream stopped
        self.last_heard = time.monotonic()
        self.state = SessionState.OPEN
        self.error: str | None = None
        self.stats = SessionStats()
        self._land = Landing()  # the frame in progress and its scratch buffer
        self.weights = Membership()  # its place in the weights fan-out: the publisher's to write
        # begin/end run on the UCX progress thread for the ucx plane, grant on the I/O loop.
        self.lock = threading.Lock()  # burst.py holds many sessions' at once, across a block's checks and counts

    # --- control ----------------------------------------------------------------------------
    async def serve(self) -> None:
        max_bytes = self.server.config.max_control_bytes
        while True:
            msg = await self.control.recv(max_bytes)
            self.last_heard = time.monotonic()
            if isinstance(msg, _wire.Heartbeat):
                continue
            if isinstance(msg, _wire.Sync):
                self.flow.ack_wanted = msg.seq
                self._after_frame()
            elif isinstance(msg, _wire.Propose):
                self._on_propose(msg)
            elif isinstance(msg, _wire.Returned):
                self._on_returned(msg.steps)
            elif isinstance(msg, _wire.Got):
                self.server.publisher.on_got(self, msg.version, msg.where)
            elif isinstance(msg, _wire.Subscribe):
                self.server.publisher.on_subscribe(self, msg)
            elif isinstance(msg, _wire.RelayAt):
                self.server.publisher.on_relay_at(self, msg)
            elif isinstance(msg, _wire.Relayed):
                self.server.publisher.on_relayed(self, msg)
            elif isinstance(msg, _wire.BroadcastJoined):
                self.server.publisher.on_broadcast_joined(self, msg)
            elif isinstance(msg, _wire.Bye):
                self.close("actor said goodbye: " + msg.reason[:200], lost=False)
                return
            else:
                raise ProtocolError(f"unexpected {type(msg).__name__} on an open session")

    def _on_propose(self, msg: _wire.Propose) -> None:
        schema = Schema.from_wire(msg.fields, max_fields=self.server.config.max_fields)
        try:
            schema_id, ring = self.server.negotiate_schema(schema)
        except SchemaMismatch as exc:
            self.control.send(_wire.Reject(str(exc)))
            return
        self.schema_id, self.ring = schema_id, ring
        cast_to = None if ring.schema == schema else ring.schema.to_wire()  # the actor puts as the learner's
        self.control.send(_wire.Accept(schema_id, ring.max_frame_steps, cast_to))
        self.server.grant_credits()

    def _on_returned(self, steps: int) -> None:
        flow = self.flow
        with self.lock:
            if not 0 <= steps <= flow.credit:
                raise ProtocolError(f"actor returned {steps} steps of credit but holds {flow.credit}")
            flow.credit -= steps
        flow.revoking = False
        flow.owes()  # settled, unless frames it sent before reading the Revoke are still on their way
        if self.ring is not None and steps:
            self.ring.revoke(steps)
        self.server.grant_credits()

    def idle(self, now: float) -> bool:
        """No frame for ``flow.IDLE_SECONDS``: its credit is better spent on actors still sending."""
        return self.flow.idle(now)

    def revoke_credit(self, keep: int) -> None:
        """Ask the actor to give back its credit beyond ``keep`` steps: more actors connected
        since it was granted, or it went idle, and others need the ring space."""
        flow = self.flow
        if flow.revoking or flow.owes() or self.state is not SessionState.OPEN or flow.credit <= keep:
            return  # one unmet Revoke at a time: its deadline runs (an honest actor has nothing more to return)
        flow.revoking = True
        flow.owed_since, flow.owed_keep = time.monotonic(), keep
        self.control.send(_wire.Revoke(flow.credit - keep))

    def revoke_deadline(self) -> float:
        """How long a session may owe revoked credit: ``heartbeat_timeout`` (within which a live
        peer's control reader answers) plus ``frame_timeout`` (the frame it may be sending
        meanwhile, which the learner bounds by that anyway). An honest actor answers a Revoke
        as soon as its I/O loop reads it, and the learner grants it nothing until it answers."""
        return self.server.config.heartbeat_timeout + self.server.config.frame_timeout

    def _check_revoke(self, now: float, late: float) -> bool:
        """End the session if it has owed revoked credit for longer than ``revoke_deadline``
        (heartbeat tick; ``late``: the learner's own pause, not the actor's fault). Returns
        whether it was ended."""
        flow = self.flow
        if not flow.owes():
            return False
        assert flow.owed_since is not None
        flow.owed_since = min(now, flow.owed_since + late)
        deadline = self.revoke_deadline()
        if now - flow.owed_since <= deadline:
            return False
        answer = "no Returned" if flow.revoking else "Returned, but the frames it owed did not come"
        reason = (f"kept revoked credit past {deadline:.3g}s (heartbeat_timeout + frame_timeout): holds "
                  f"{flow.credit} steps, was asked to keep {flow.owed_keep} ({answer})")  # fmt: skip
        self.stats.protocol_errors += 1
        self.control.send(_wire.Error("protocol", reason))
        self.close(f"protocol error: {reason}", lost=True)  # logged; its credit goes back to the ring
        return True

    def heartbeat(self, now: float, late: float = 0.0) -> None:
        """Called periodically on the loop: keep the peer alive and detect a silent one.
        ``late``: how late this call came (the learner itself was paused; not the actor's fault)."""
        timeout = self.server.config.heartbeat_timeout
        self.last_heard = min(now, self.last_heard + late)
        if now - self.last_heard > timeout:
            self.close(f"no message from actor {self.actor_id} for {timeout:.3g}s", lost=True)
            return
        started = self.receiver.frame_started if self.receiver is not None else None
        if started is not None and now - started > self.server.config.frame_timeout:
            self.close(f"a frame from actor {self.actor_id} stalled mid-transfer", lost=True)
            return
        if self._check_revoke(now, late):
            return
        if now - self.control.last_send >= self.server.config.heartbeat_interval:  # only after silence
            self.control.send(_wire.Heartbeat())

    @property
    def low_on_credit(self) -> bool:
        """At or below the low-water mark: the only state in which grant_credits gives more."""
        return self.flow.low

    def grant(self, steps: int, low_water: int) -> None:
        flow = self.flow
        with self.lock:
            flow.credit += steps
            flow.low_water = low_water
        flow.owed_since = None  # never while a Revoke is outstanding: this is its entitlement now
        self.control.send(_wire.Credit(steps, self.next_seq or 0))

    # --- FrameSink ------------------------------------------------------------------------------
    def begin(self, header: bytes) -> list[memoryview]:
        with self.lock:
            return self._begin(header)

    def _admit(self, header: bytes | memoryview) -> tuple[FrameHeader, StepRing, bool]:
        """Validate a frame header against the session (lock held). Returns it, the ring, and
        whether the frame is new: False for one resent after a reconnect whose steps were
        delivered already (its payload is read and dropped)."""
        if self.state is not SessionState.OPEN:
            raise ProtocolError("session is closed")
        h = FrameHeader.unpack(header)
        ring = self.ring
        if self.schema_id is None or ring is None or h.schema_id != self.schema_id:
            raise ProtocolError(f"frame names schema id {h.schema_id}, which this session did not negotiate")
        if h.actor_id != self.actor_id or h.incarnation != self.incarnation:
            raise ProtocolError(
                f"frame claims actor {h.actor_id}/{h.incarnation}; session is {self.actor_id}/{self.incarnation}"
            )
        if not 0 < h.n_steps <= ring.max_frame_steps:
            raise ProtocolError(f"frame of {h.n_steps} steps; limit {ring.max_frame_steps}")
        if h.seq + h.n_steps >= 1 << 63:  # seqs are int64 in a batch (Batch.seq)
            raise ProtocolError(f"frame seq {h.seq} + {h.n_steps} steps is beyond 2**63")
        if h.payload_bytes != h.n_steps * ring.schema.step_bytes:  # cached by the schema
            raise ProtocolError(f"payload {h.payload_bytes} bytes does not match {h.n_steps} steps of the schema")
        flow = self.flow
        if h.n_steps > flow.credit:
            raise ProtocolError(f"frame of {h.n_steps} steps exceeds the {flow.credit} steps of credit granted")
        resumed, self.resumed = self.resumed, False
        if self.next_seq is None:  # a stream this learner never saw starts wherever it is
            self.next_seq = h.seq
        elif resumed and h.seq > self.next_seq:
            # Resuming after a reconnect, past where the last session stopped: steps the actor
            # could not keep for resending (counted, never silent).
            self.stats.lost_steps += h.seq - self.next_seq
            self.next_seq = h.seq
        if h.seq + h.n_steps <= self.next_seq:  # resent, but already delivered: drop it
            flow.credit -= h.n_steps
            ring.revoke(h.n_steps)
            return h, ring, False
        if h.seq != self.next_seq:
            raise ProtocolError(f"frame seq {h.seq}, expected {self.next_seq}")
        return h, ring, True

    def _spend(self, n_steps: int) -> None:
        """A new frame took its place in the ring: it used ``n_steps`` of credit (lock held)."""
        flow = self.flow
        flow.credit -= n_steps
        self.stats.credit_exhausted += not flow.credit

    def _begin(self, header: bytes) -> list[memoryview]:
        h, ring, new = self._admit(header)
        if not new:
            self._land.frame = (h, None)
            return self._land.scratch(h.payload_bytes, h.n_steps, ring)
        seg = ring.reserve(h.n_steps, self.actor_id, h.seq, h.version, h.put_time_us * 1e-6)
        self._spend(h.n_steps)
        self._land.frame = (h, seg)
        views = ring.field_views(seg)
        if self.whole_fields and any(len(v) > 1 for v in views):
            # A frame that wraps or crosses a chunk lands in a scratch buffer and is scattered
            # into the ring on commit.
            return self._land.staged(views, h.payload_bytes)
        return [v for field_views in views for v in field_views]

    def end_threadsafe(self) -> None:
        """The frame is complete (any thread): commit now; wake the I/O loop only when a flush
        waits for it or credit runs low, so a stream of frames costs no loop round trips."""
        self._commit()
        self._after_commit()

    def land(self, header: bytes | memoryview, payload: memoryview | list[memoryview]) -> None:
        """A whole frame whose payload is already in hand (any thread; ``begin``, the copy and
        ``end_threadsafe`` in one step, under one hold of the session's lock and one of the
        ring's): what a pump does with the small frames a read brought in."""
        with self.lock:
            h, ring, new = self._admit(header)
            if not new:
                self.stats.duplicate_steps += h.n_steps
                return
            ring.land(h.n_steps, self.actor_id, h.seq, h.version, h.put_time_us * 1e-6, payload)
            self._spend(h.n_steps)
            self._count_frame(h)
        self._after_commit()

    def admit_landing(self, header: memoryview, payload_bytes: int) -> tuple[FrameHeader, StepRing] | None:
        """Check a whole frame's header and the ``payload_bytes`` that came with it for
        ``burst.land_burst`` (any thread), and count it as landed now: it lands in the ring
        next, in the same pass (before any later frame of this session, so ``next_seq`` moves
        on here). None for a duplicate (counted, dropped)."""
        with self.lock:
            h, ring, new = self._admit(header)
            if payload_bytes != h.payload_bytes:  # checked before it is counted: the ring would refuse it
                raise ProtocolError(f"a frame announcing {h.payload_bytes} bytes of payload came with {payload_bytes}")
            if not new:
                self.stats.duplicate_steps += h.n_steps
                return None
            self._spend(h.n_steps)
            self._count_frame(h)
            return h, ring

    def lane(self) -> tuple[int, int, int, int, int, StepRing] | None:
        """What this session's next frame must carry to land in a block (``burst.py``; the
        session's ``lock`` held): its schema id, seq, at most this credit, its actor id and
        incarnation, and its ring. None while only :meth:`admit_landing`'s checks may take a
        frame (the session closed, a resumed stream's first frame)."""
        if self.state is not SessionState.OPEN or self.resumed or self.next_seq is None:
            return None
        if self.schema_id is None or self.ring is None:
            return None
        return self.schema_id, self.next_seq, self.flow.credit, self.actor_id, self.incarnation, self.ring

    def count_landed(self, n_steps: int, payload_bytes: int, now: float) -> bool:
        """A frame that matched :meth:`lane` is in the ring (the ``lock`` held). True when
        :meth:`after_landing` has something to do (a flush waits for it, or credit is low)."""
        self._spend(n_steps)
        self._counted(n_steps, payload_bytes, now)
        flow = self.flow
        return (self.next_seq or 0) >= flow.ack_wanted or flow.credit <= flow.low_water

    def after_landing(self) -> None:
        """This session's frames of a burst are in the ring (``burst.land_burst``)."""
        self._after_commit()

    def _after_commit(self) -> None:
        # Credit can only be topped up where the ring has room; otherwise the consumer's next
        # release triggers the grant.
        if (self.next_seq or 0) >= self.flow.ack_wanted:
            call_soon_any_thread(self.server.loop, self._after_frame)
        elif self.low_on_credit:
            self.server.credit_low()

    def _commit(self) -> None:
        with self.lock:
            land = self._land
            assert land.frame is not None and self.ring is not None
            h, seg = land.frame
            land.frame = None
            if seg is None:
                self.stats.duplicate_steps += h.n_steps
                return
            if self.state is not SessionState.OPEN:  # replaced by a reconnect meanwhile: its resume point is fixed
                land.scatter = None
                self.ring.abandon(seg)
                return
            if land.scatter is not None:
                land.scatter_into_ring()
            self.ring.commit(seg)
            self._count_frame(h)

    def _count_frame(self, h: FrameHeader) -> None:
        """A new frame's steps are in the ring (lock held)."""
        self._counted(h.n_steps, h.payload_bytes, time.monotonic())

    def _counted(self, n_steps: int, payload_bytes: int, now: float) -> None:
        self.flow.last_frame = self.last_heard = now
        self.next_seq = (self.next_seq or 0) + n_steps
        stats = self.stats
        stats.frames += 1
        stats.steps += n_steps
        stats.bytes += payload_bytes

    def _after_frame(self) -> None:
        if self.state is not SessionState.OPEN:
            return
        if self.next_seq is not None and self.next_seq >= self.flow.ack_wanted:
            self.flow.ack_wanted = 1 << 62
            self.control.send(_wire.Ack(self.next_seq))
        self.server.grant_credits()

    def abandon(self) -> None:
        """The receiver guarantees nothing more is written: a frame in progress is torn."""
        with self.lock:
            frame = self._land.drop()
        if frame is not None and frame[1] is not None and self.ring is not None:
            self.ring.abandon(frame[1])
            self.stats.torn_frames += 1

    def fail_threadsafe(self, exc: BaseException) -> None:
        call_soon_any_thread(self.server.loop, self.fail, exc)

    def fail(self, exc: BaseException) -> None:
        if self.state is not SessionState.OPEN:  # e.g. a frame already on its way when the session ended: not a fault
            log.debug("actor %s session %s, already ended: %s", self.actor_id, self.id, exc)
            return
        if isinstance(exc, EOFError):
            # A clean close between frames; the control channel (Bye or EOF) decides whether
            # this was a goodbye or a crash.
            log.debug("actor %s closed its data plane", self.actor_id)
            return
        if isinstance(exc, DataPlaneRetired):
            self.close(str(exc), lost=False, moved=True)
            return
        if isinstance(exc, ProtocolError):
            self.stats.protocol_errors += 1
            self.server.quiet_log.log(logging.WARNING, "protocol", "actor %s: protocol error on the data plane: %s",
                                      self.actor_id, exc, logger=log)  # fmt: skip
            self.control.send(_wire.Error("protocol", str(exc)[:500]))
            self.close(f"protocol error: {exc}", lost=True)
        else:
            self.close(f"data connection lost: {exc}", lost=True)

    # --- lifecycle --------------------------------------------------------------------------------
    def close(self, reason: str, *, lost: bool, moved: bool = False) -> None:
        """End the session: ``lost`` (a fault, reported as PeerLost), ``moved`` (the actor was
        asked to reconnect elsewhere), or else closed (a goodbye, or the learner closing)."""
        if self.state is not SessionState.OPEN:
            return
        with self.lock:  # after this, no frame commits: next_seq is where a reconnect resumes
            self.state = SessionState.LOST if lost else SessionState.MOVED if moved else SessionState.CLOSED
            credit, self.flow.credit = self.flow.credit, 0
        self.error = reason if lost else None
        if self.ring is not None and credit:
            self.ring.revoke(credit)
        if self.receiver is not None:
            self.receiver.close()  # the receiver calls abandon() once nothing more can land
        opening, self.opening = self.opening, None
        if opening is not None:
            opening.close()  # never attached
        self.control.close()
        self.server.quiet_log.log(logging.WARNING if lost else logging.INFO, "lost" if lost else "ended",
                                  "actor %s session %s ended: %s", self.actor_id, self.id, reason, logger=log)  # fmt: skip
        self.server.session_ended(self, PeerLost(reason) if lost else None)
