"""The actor's network side, living on its I/O loop: handshake, control reader, frame sender."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import socket
import threading
import time
from typing import Any

import msgspec

from .._memory import Reserve
from .._version import __version__
from ..config import Config
from ..errors import (
    AuthError,
    Backpressure,
    Closed,
    ConnectError,
    PeerLost,
    ProtocolError,
    RLinkError,
    SchemaMismatch,
    Superseded,
)
from ..transport import cma, hostname, shm, ucx_available
from ..transport.address import is_loopback
from ..transport.base import FrameSender
from ..transport.control import ControlConnection
from ..transport.loop import ticks
from ..transport.tcp import TcpSender
from ..wire import auth as _auth
from ..wire import messages as _wire
from ..wire.codec import Schema
from ..wire.frame import FrameHeader

log = logging.getLogger(__name__)


class FrameBuffer:
    """A reusable frame of up to ``capacity`` steps: one flat byte array per field, carved
    from ``memory`` (a uint8 array, e.g. from the shm plane's arena) when given."""

    def __init__(self, schema: Schema, capacity: int, memory: Any = None):
        import numpy as np

        from ..wire.codec import DTYPES

        self.capacity = capacity
        if memory is None:
            self.flat = [np.empty(capacity * f.step_bytes, dtype=np.uint8) for f in schema.fields]
        else:
            bounds = np.cumsum([0] + [capacity * f.step_bytes for f in schema.fields]).tolist()
            self.flat = [memory[a:b] for a, b in zip(bounds, bounds[1:])]
        self.typed = [
            flat.view(DTYPES[f.dtype]).reshape((capacity, *f.shape)) for f, flat in zip(schema.fields, self.flat)
        ]
        self._sizes = [f.step_bytes for f in schema.fields]
        self.n = 0
        self.seq = 0
        self.version = 0
        self.sent = 0
        self.started = 0.0

    def reset(self, seq: int, version: int) -> None:
        self.n, self.seq, self.version, self.sent = 0, seq, version, 0
        self.started = time.monotonic()

    def payload(self, start: int, stop: int) -> list[memoryview]:
        return [memoryview(flat)[start * sb : stop * sb] for flat, sb in zip(self.flat, self._sizes)]


class BorrowedFrame:
    """Steps sent straight from the caller's arrays (large puts): no copy into a frame buffer.

    The caller waits on :attr:`done` before returning, so the arrays are never read after
    ``put`` returns; ``cancelled`` asks the sender to stop at the next sub-frame boundary.
    """

    def __init__(self, arrays: list[Any], n: int, seq: int, version: int):
        self.flat = [memoryview(a).cast("B") for a in arrays]
        self._sizes = [len(f) // n for f in self.flat]
        self.n, self.seq, self.version, self.sent = n, seq, version, 0
        self.done: threading.Event | None = None  # made when handed to the I/O thread
        self.cancelled = False

    def payload(self, start: int, stop: int) -> list[memoryview]:
        return [flat[start * sb : stop * sb] for flat, sb in zip(self.flat, self._sizes)]


class ActorConnection:
    """Everything the actor does on its I/O loop. Errors land in :attr:`error` for the caller."""

    def __init__(self, host: str, port: int, *, token: bytes | None, transport: str, actor_id: int | None,
                 incarnation: int, config: Config, loop: asyncio.AbstractEventLoop):  # fmt: skip
        self.host, self.port = host, port
        self.token = token
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
        self.arena: shm.Arena | None = None  # shm plane: frame buffers the learner can read directly
        self._frame_reserve: Reserve | None = None  # the other planes: frame buffers in populated memory
        self._probe: cma.Probe | None = None  # shm: lets the learner prove it may read our memory

    # --- connecting -------------------------------------------------------------------------------
    async def _open(self) -> tuple[ControlConnection, _wire.Challenge]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                await self.loop.sock_connect(sock, (self.host, self.port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise ConnectError(f"cannot reach learner at {self.host}:{self.port}: {exc or 'timed out'}") from exc
        conn = ControlConnection(sock, self.loop, f"{self.host}:{self.port}")
        challenge = await conn.recv(self.config.max_preauth_bytes)
        if not isinstance(challenge, _wire.Challenge):
            raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
        if challenge.proto != _wire.PROTOCOL_VERSION:
            raise ProtocolError(f"learner speaks protocol {challenge.proto}, actor {_wire.PROTOCOL_VERSION}")
        return conn, challenge

    async def connect(self, timeout: float | None = None) -> None:
        """Open the control channel, authenticate, attach the data plane; ``timeout`` bounds it
        all (default: ``connect_timeout + handshake_timeout``)."""
        if timeout is None:
            timeout = self.config.connect_timeout + self.config.handshake_timeout
        try:
            async with asyncio.timeout(timeout):
                await self._connect()
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise ConnectError(f"handshake with {self.host}:{self.port} timed out") from exc
        except Superseded:
            raise
        except PeerLost as exc:
            raise ConnectError(f"learner at {self.host}:{self.port} closed the connection during setup: {exc}") from exc

    async def _connect(self) -> None:
        conn, challenge = await self._open()
        self.control = conn
        if challenge.auth and self.token is None:
            raise AuthError("the learner requires a token; pass token=... or set RLINK_TOKEN")
        if self.token is not None and not challenge.auth:
            raise AuthError("this actor has a token but the learner cannot prove it knows it (learner has no token)")
        nonce = _auth.new_nonce()
        mac = _auth.actor_proof(self.token, challenge.nonce, nonce) if self.token else b""
        conn.send(_wire.Login(_wire.PROTOCOL_VERSION, nonce, mac))
        if self.token is not None:
            proof = await self._expect(conn, _wire.Proof)
            _auth.verify(_auth.learner_proof(self.token, challenge.nonce, nonce), proof.mac, "learner")
        conn.send(_wire.Hello(self.actor_id, self.incarnation, __version__, self.transport_wanted, ucx_available(),
                              _cuda_visible(), hostname(), os.getpid(), shm.available()))  # fmt: skip
        welcome = await self._expect(conn, _wire.Welcome)
        self.welcome = welcome
        self.latest_version = welcome.version
        self.actor_id = welcome.actor_id
        self._tasks.append(self.loop.create_task(self._read_control()))
        if welcome.transport in ("tcp", "shm"):
            await self._attach_tcp(welcome)
        else:
            from ..transport.ucx import UcxActorPlane

            self.sender = await UcxActorPlane.connect(self.loop, welcome, self.incarnation, self.config,
                                                      loopback=is_loopback(self.host), control=conn.sock)  # fmt: skip
        await self._ready
        if self.schema is not None:  # a reconnect: the new session needs the schema again
            await self._renegotiate()
        self._requeue(welcome.resume_seq)
        self._tasks.append(self.loop.create_task(self._heartbeat()))
        self._tasks.append(self.loop.create_task(self._send_loop()))
        self.connected = True

    async def _expect(self, conn: ControlConnection, kind: type) -> Any:
        msg = await conn.recv(self.config.max_control_bytes)
        if isinstance(msg, _wire.Error):
            kind = {"auth": AuthError, "superseded": Superseded}.get(msg.kind, ConnectError)
            raise kind(f"learner refused: {msg.text}")
        if not isinstance(msg, kind):
            raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
        return msg

    async def _attach_tcp(self, welcome: _wire.Welcome) -> None:
        """Open the data connection: the tcp plane, or the doorbell of the shm plane."""
        ring = self._map_shm_ring(welcome) if welcome.transport == "shm" else None
        if ring is not None and self.arena is None and self.resend:
            self.arena = self._new_arena()
        arena = self.arena.describe() if ring is not None and self.arena is not None else None
        if ring is not None and self._probe is None and self.config.shm_direct_read and cma.available():
            self._probe = cma.Probe()  # lives as long as the connection: the learner reads it at each attach
        probe = self._probe.describe() if ring is not None and self._probe is not None else None
        data, challenge = await self._open()
        data.send(_wire.Attach(_wire.PROTOCOL_VERSION, welcome.session,
                               _auth.data_proof(welcome.ticket, challenge.nonce, welcome.session),
                               ring is not None, arena, probe))  # fmt: skip
        # A send that makes no progress for a heartbeat timeout means a frozen or vanished
        # learner; the blocking send holds the I/O thread, so the heartbeat could not tell.
        timeout = min(self.config.frame_timeout, self.config.heartbeat_timeout)
        if ring is not None:
            # The arena goes with the Attach; the learner's Ready says whether it mapped it.
            self.sender = shm.ShmSender(data.sock, ring, timeout, self.arena)
        else:
            self.sender = TcpSender(data.sock, self.loop, timeout, self.config.tcp_congestion)

    def _frame_memory_bytes(self) -> int:
        """Room for every frame buffer the actor may hold: those kept for resending, those
        being filled, and a few spare (beyond it, frame buffers are plain memory, and on the
        shm plane their frames go through the ring)."""
        c = self.config
        return c.resend_buffer_bytes + (c.frame_buffers + 4) * c.frame_bytes

    def _new_arena(self) -> shm.Arena | None:
        try:
            return shm.Arena(self._frame_memory_bytes())
        except OSError as exc:
            log.info("no shared frame buffers (%s): frames go through the ring", exc)
            return None

    def release_arena(self) -> None:
        """After close: drop the frame buffers and unmap the arena (any thread)."""
        if self._frame_reserve is not None:
            self._frame_reserve.close()
        arena, self.arena = self.arena, None
        if arena is not None:
            with self.changed:
                self.free.clear()
                self.inflight.clear()
                self.queue.clear()
            self._tasks.clear()  # a stopped task's frame may still hold the frame it was sending
            arena.close()

    def frame_memory(self, nbytes: int) -> Any:
        """Memory for a new frame buffer: from the arena, else from a populated reserve, while
        they have room; else None (plain memory)."""
        if self.arena is not None:
            return self.arena.block(nbytes)
        if self._frame_reserve is None:
            self._frame_reserve = Reserve(self._frame_memory_bytes(), "frames")
        return self._frame_reserve.take(nbytes)

    def _map_shm_ring(self, welcome: _wire.Welcome) -> shm.ShmRing | None:
        """Map the learner's ring; None (tcp on the data connection instead) where it cannot be
        reached from here, e.g. another PID namespace or user, unless shm was requested."""
        try:
            pid, fd, nonce, size = welcome.shm or [0, 0, b"", 0]
            return shm.ShmRing.open(int(pid), int(fd), bytes(nonce), int(size))
        except (OSError, ValueError, TypeError) as exc:
            if self.transport_wanted == "shm":
                raise ConnectError(f"shm requested but the learner's ring cannot be mapped here: {exc}") from exc
            reason = f"auto: the learner's shared-memory ring cannot be mapped here ({exc}); tcp instead"
            log.info(reason)
            self.welcome = msgspec.structs.replace(welcome, transport="tcp", reason=reason)
            return None

    # --- control messages ----------------------------------------------------------------------
    async def _read_control(self) -> None:
        assert self.control is not None
        try:
            while True:
                msg = await self.control.recv(self.config.max_control_bytes)
                self.last_heard = time.monotonic()
                if isinstance(msg, _wire.Credit):
                    with self.credit_cv:
                        self.credit += msg.steps
                        self.credit_cv.notify_all()
                    self._credit_event.set()
                    if msg.acked > self.acked:
                        self._acknowledged(msg.acked)
                elif isinstance(msg, _wire.Ack):
                    self._acknowledged(msg.next_seq)
                elif isinstance(msg, _wire.Revoke):
                    with self.credit_cv:
                        give = max(0, min(self.credit, msg.steps))
                        self.credit -= give
                    self.control.send(_wire.Returned(give))
                elif isinstance(msg, _wire.Heartbeat):
                    pass
                elif isinstance(msg, (_wire.Version, _wire.Publish, _wire.Group, _wire.Sealed)):
                    self._on_weights(msg)
                elif isinstance(msg, _wire.Ready):
                    if isinstance(self.sender, shm.ShmSender):
                        if not msg.arena:
                            self.sender.arena = None  # the learner could not map it: use the ring
                        self.sender.direct = msg.cma
                    if not self._ready.done():
                        self._ready.set_result(msg.transport)
                elif isinstance(msg, (_wire.Accept, _wire.Reject)):
                    if self._proposal is not None and not self._proposal.done():
                        self._proposal.set_result(msg)
                elif isinstance(msg, _wire.Error):
                    kind = AuthError if msg.kind == "auth" else ProtocolError
                    raise kind(f"learner reported: {msg.text}")
                elif isinstance(msg, _wire.Bye):
                    raise PeerLost(f"learner closed the session: {msg.reason}")
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from the learner")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self.fail(exc if isinstance(exc, RLinkError) else PeerLost(f"control connection broke: {exc}"))

    def _acknowledged(self, seq: int) -> None:
        """The learner holds every step below ``seq``: frames entirely below it are done."""
        with self.changed:
            self.acked = max(self.acked, seq)
            while self.inflight and self.inflight[0].seq + self.inflight[0].n <= self.acked:
                self.free.append(self.inflight.popleft())
            self.changed.notify_all()

    def _on_weights(self, msg: _wire.Version | _wire.Publish | _wire.Group | _wire.Sealed) -> None:
        if isinstance(msg, _wire.Version):
            self.latest_version = max(self.latest_version, msg.version)
        elif isinstance(msg, _wire.Publish):
            self.latest_version = max(self.latest_version, msg.manifest.version)
        if self.weights_listener is not None:
            self.weights_listener(msg)
        elif not isinstance(msg, _wire.Version):
            raise ProtocolError(f"{type(msg).__name__} for an actor that did not subscribe to weights")

    async def _heartbeat(self) -> None:
        assert self.control is not None
        async for late in ticks(self.config.heartbeat_interval):
            self.last_heard = min(time.monotonic(), self.last_heard + late)  # our own pause is not the learner's
            if time.monotonic() - self.last_heard > self.config.heartbeat_timeout:
                self.fail(PeerLost(f"no message from the learner for {self.config.heartbeat_timeout:.3g}s"))
                return
            self.control.send(_wire.Heartbeat())

    def fail(self, exc: RLinkError) -> None:
        """The connection broke (any task on the loop): reconnect if it was up and the error
        is one a reconnect can cure, else record ``exc`` for every caller."""
        if self.closing or self.error is not None:
            return
        if self.reconnecting:  # a reconnect attempt failed: let it notice at once
            for fut in (self._ready, self._proposal):
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # retrieved here: the attempt sees it through await
            return
        if self.connected and self.config.reconnect_timeout > 0 and not isinstance(exc, (AuthError, SchemaMismatch)):
            self.connected = False
            self.reconnecting = True
            log.warning("actor %s: %s; reconnecting", self.actor_id, exc)
            self._tasks.append(self.loop.create_task(self._reconnect(exc)))
            return
        self._fail_for_good(exc)

    def _fail_for_good(self, exc: RLinkError) -> None:
        self.connected = False
        self.error = exc
        log.warning("actor %s: %s", self.actor_id, exc)
        for frame in self.queue:
            if isinstance(frame, BorrowedFrame) and frame.done is not None:
                frame.done.set()  # the caller raises self.error
        for fut in (self._ready, self._proposal):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        with self.changed:
            self.changed.notify_all()
        with self.credit_cv:
            self.credit_cv.notify_all()
        self._wake.set()
        self._credit_event.set()

    # --- reconnecting ----------------------------------------------------------------------------
    async def _reconnect(self, cause: RLinkError) -> None:
        """Retry the learner with backoff and jitter until ``reconnect_timeout``; then resume
        the stream where the learner says it stopped (resending what it lacks)."""
        self._teardown()
        deadline = time.monotonic() + self.config.reconnect_timeout
        delay, last = 0.05, cause
        # An attempt made while the link is still down can be swallowed whole (a blackholed
        # route, a cut that TCP does not see), and would then hold the actor for the full
        # connect + handshake timeouts after the link is back. A healthy learner answers within
        # a heartbeat interval, so each attempt gets twice that (at least 1 s), doubling after
        # each failure up to the full timeouts: a slow learner is still reached.
        full = self.config.connect_timeout + self.config.handshake_timeout
        attempt_timeout = min(full, max(1.0, 2 * self.config.heartbeat_interval))
        while not self.closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(left, delay * (0.5 + random.random())))
            delay = min(2 * delay, 2.0)
            try:
                await self.connect(attempt_timeout)
            except (AuthError, SchemaMismatch, Superseded) as exc:
                last = exc
                break
            except (RLinkError, OSError) as exc:
                last = exc if isinstance(exc, RLinkError) else PeerLost(str(exc))
                attempt_timeout = min(full, 2 * attempt_timeout)
                self._teardown()
                continue
            self.reconnects += 1
            self.reconnecting = False
            log.info("actor %s reconnected (resuming at seq %d)", self.actor_id, self.next_send_seq)
            if self.subscription is not None and self.control is not None:
                self.control.send(self.subscription)
            with self.changed:
                self.changed.notify_all()
            with self.credit_cv:
                self.credit_cv.notify_all()
            return
        self.reconnecting = False
        if not self.closing:
            if isinstance(last, (AuthError, SchemaMismatch, Superseded)):
                self._fail_for_good(last)
            else:
                self._fail_for_good(PeerLost(f"learner unreachable for {self.config.reconnect_timeout:.3g}s: {last}"))

    def _teardown(self) -> None:
        """Drop the broken connection (not the frames: they are resent)."""
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = [t for t in self._tasks if t is current]
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.control is not None:
            self.control.close()
            self.control = None
        with self.credit_cv:
            self.credit = 0
        self._ready = self.loop.create_future()
        if self._proposal is not None and not self._proposal.done():
            self._proposal.set_exception(_ConnectionReplaced())  # propose() asks the new connection
            self._proposal.exception()  # retrieved: a proposal nobody awaits any more stays quiet
        self._proposal = None

    async def _renegotiate(self) -> None:
        assert self.schema is not None
        reply = await self._propose_once(self.schema)
        if isinstance(reply, _wire.Reject):
            raise SchemaMismatch(f"after reconnecting, the learner rejected the schema: {reply.reason}")
        self.schema_id, self.max_frame_steps = reply.schema_id, reply.max_steps

    def _requeue(self, resume: int) -> None:
        """Put every unacknowledged frame back in the queue, from where the learner stopped
        (``resume``; -1: a learner that never saw this stream gets everything unacknowledged)."""
        with self.changed:
            frames = [*self.inflight, *self.queue]
            self.outstanding += len(self.inflight)  # queued again
            self.inflight.clear()
            self.queue.clear()
            if resume >= 0 and resume > self.acked:
                self.acked = resume
            start = self.next_send_seq
            base = resume if resume >= 0 else self.acked  # a new learner: from what the old one lacked
            for fb in frames:
                fb.sent = min(fb.n, max(0, base - fb.seq))
                if fb.sent == fb.n:  # the learner has all of it
                    self._finished(fb)
                else:
                    self.queue.append(fb)
            if self.queue:
                start = self.queue[0].seq + self.queue[0].sent
            known = max(self.acked, resume)
            if start > known:
                self.steps_lost += start - known  # sent once, never acknowledged, not kept
            self.next_send_seq = start
            self.changed.notify_all()
        self._wake.set()

    def give_back(self, fb: FrameBuffer) -> None:
        """Return an unused frame buffer to the pool (any thread) and wake a put waiting for one."""
        with self.changed:
            self.free.append(fb)
            self.changed.notify_all()

    def _finished(self, frame: FrameBuffer | BorrowedFrame) -> None:
        """A frame leaves the queue for good (changed lock held)."""
        self.outstanding -= 1
        if isinstance(frame, FrameBuffer):
            self.free.append(frame)
        elif frame.done is not None:
            frame.done.set()

    async def propose(self, schema: Schema) -> _wire.Accept | _wire.Reject:
        """Propose the first schema. If the connection is replaced before the answer comes, the
        proposal is made again on the new one (the caller's timeout bounds the whole wait)."""
        while True:
            while not self.connected and self.error is None:  # a reconnect is under way
                await asyncio.sleep(0.02)
            if self.error is not None:
                raise self.error
            try:
                return await self._propose_once(schema)
            except _ConnectionReplaced:
                continue

    async def _propose_once(self, schema: Schema) -> _wire.Accept | _wire.Reject:
        assert self.control is not None
        self._proposal = self.loop.create_future()
        self.control.send(_wire.Propose(schema.to_wire()))
        return await self._proposal

    def sync(self, seq: int) -> None:
        """Ask the learner to acknowledge once ``seq`` steps are buffered (loop thread)."""
        if self.control is not None and self.acked < seq:
            self.control.send(_wire.Sync(seq))

    # --- sending frames ------------------------------------------------------------------------
    def submit(self, fb: FrameBuffer | BorrowedFrame) -> None:
        """Queue a filled frame (loop thread). Frames arrive here in seq order (they all come
        through the loop's FIFO ready queue); the sender checks that they leave that way."""
        self.queue.append(fb)
        self._wake.set()
        if self.error is not None and isinstance(fb, BorrowedFrame) and fb.done is not None:
            fb.done.set()  # failed for good before it arrived: its caller raises the error

    def _send_part(self, frame: FrameBuffer | BorrowedFrame, k: int) -> None:
        """Send steps ``[sent, sent + k)`` of ``frame`` as one wire frame (send_lock held)."""
        sender = self.sender  # read once: close() on another thread may clear it meanwhile
        if sender is None:
            raise PeerLost("the data connection is closed")
        assert self.schema is not None
        step_bytes = self.schema.step_bytes
        header = FrameHeader(self.schema_id, k, self.actor_id or 0, self.incarnation, frame.seq + frame.sent,
                             frame.version, k * step_bytes).pack()  # fmt: skip
        sender.send(header, frame.payload(frame.sent, frame.sent + k))
        frame.sent += k
        self.next_send_seq = frame.seq + frame.sent
        self.sent_steps += k
        self.sent_frames += 1
        self.sent_bytes += k * step_bytes

    def take_all_credit(self, n: int) -> bool:
        """Take ``n`` steps of credit if all are available now (any thread)."""
        with self.credit_cv:
            if self.credit < n or self.error is not None or not self.connected or n > self.max_frame_steps:
                return False
            self.credit -= n
            return True

    def send_part_or_fail(self, frame: FrameBuffer | BorrowedFrame, k: int) -> bool:
        """``_send_part`` from a caller's thread. A failure starts a reconnect; it is raised as
        PeerLost only for a frame that is not kept for resending (a large put then hands its
        frame to the I/O thread, which resends it after the reconnect). Returns whether it was
        sent."""
        try:
            self._send_part(frame, k)
            return True
        except Exception as exc:  # noqa: BLE001 - translated and recorded for later calls too
            err = exc if isinstance(exc, RLinkError) else PeerLost(f"data connection broke: {exc}")
            self.loop.call_soon_threadsafe(self.fail, err)
            if self.resend and isinstance(frame, FrameBuffer):
                return False
            raise err from exc

    def _take_credit(self, want: int) -> int:
        with self.credit_cv:
            k = min(want, self.credit)
            self.credit -= k
            return k

    async def _send_loop(self) -> None:
        try:
            while True:
                while not self.queue:
                    if self.error is not None:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                if self.error is not None:
                    return
                frame = self.queue[0]
                if frame.seq + frame.sent != self.next_send_seq:
                    raise ProtocolError(f"internal: frame seq {frame.seq} queued, {self.next_send_seq} due")
                while frame.sent < frame.n and not getattr(frame, "cancelled", False):
                    k = self._take_credit(min(frame.n - frame.sent, self.max_frame_steps))
                    if k == 0:
                        if self.error is not None:
                            return
                        self.credit_waits += 1
                        self._credit_event.clear()
                        if self.credit <= 0:
                            await self._credit_event.wait()
                        continue
                    with self.send_lock:
                        self._send_part(frame, k)
                self.queue.popleft()
                with self.changed:
                    if self.resend and isinstance(frame, FrameBuffer) and not getattr(frame, "cancelled", False):
                        self.outstanding -= 1
                        self.inflight.append(frame)  # kept until acknowledged
                    else:
                        self._finished(frame)
                    self.changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self.fail(exc if isinstance(exc, RLinkError) else PeerLost(f"data connection broke: {exc}"))

    def send_direct(self, frame: BorrowedFrame, deadline: float) -> None:
        """Send ``frame`` from the calling thread (nothing else is queued): no thread hand-off.

        Raises Backpressure when no credit arrives before ``deadline``.
        """
        while frame.sent < frame.n:
            with self.credit_cv:
                while self.credit <= 0 or not self.connected:
                    if self.error is not None:
                        raise self.error
                    if self.closing:
                        raise Closed("the actor is closed")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Backpressure(
                            f"no credit from the learner before the put timeout; {frame.sent} of {frame.n} steps sent"
                        )
                    self.credit_waits += 1
                    self.credit_cv.wait(min(left, 0.5))
                k = min(frame.n - frame.sent, self.credit, self.max_frame_steps)
                self.credit -= k
            with self.send_lock:
                self.send_part_or_fail(frame, k)

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


class _ConnectionReplaced(Exception):
    """The connection a proposal went out on was torn down before the answer came."""


def _cuda_visible() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


__all__ = ["ActorConnection", "BorrowedFrame", "FrameBuffer"]
