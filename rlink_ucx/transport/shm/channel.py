"""The ``shm`` data plane: actor and learner on one host share a byte ring in memory.

The learner creates one ring per session: a sealed ``memfd`` (it can never shrink, so a
misbehaving actor cannot make the learner's reads fault), announced in ``Welcome`` as
``(pid, fd, nonce, size)``. The actor maps it through ``/proc/<pid>/fd/<fd>``, which only a
process of the same user in the same PID namespace may open, and checks the nonce to be sure
it mapped the right object. Whoever cannot map it says so in ``Attach`` and the session falls
back to the tcp plane over the same data connection.

The data connection carries small records only. The actor announces each frame (its header)
and where its payload is:

- at addresses in the actor's memory, for a large payload outside the arena, where the
  learner proved at attach time that it may read the actor's memory (``cma.py``): the
  learner copies it out with ``process_vm_readv`` and says so; the actor's ``send`` waits for
  that, so the caller's arrays are never read after ``put`` returns;
- in the actor's *arena*: a sealed memfd of its own holding its frame buffers, mapped by the
  learner when the data connection attaches (after checking the seals). The record lists the
  payload's extents and the learner copies straight out of the frame buffer: one copy in all
  after ``put``'s. Only while the actor keeps sent frames until they are acknowledged
  (``Config.resend_buffer_bytes`` > 0, the default), so it never refills one being read;
- or in the ring, a byte stream: the actor copies the payload in and sends how many bytes it
  has written in all; the learner copies them out and sends back how many it has consumed.
  Both counters are cumulative; one that goes backwards or claims more than the ring holds is
  a ``ProtocolError``, as are extents outside the arena. So is a direct read the actor's
  memory refuses.

Copies run in ``ctypes.memmove``, which releases the GIL, so the other threads keep running.
Each side sends its counter before it waits for the other's, so neither can wait on the other
forever; every wait is bounded by the socket timeout.
"""

from __future__ import annotations

import errno
import select
import socket
import threading
import time
from typing import Any

import msgspec

from ...errors import ProtocolError
from ...wire.frame import announced_payload
from ..base import FrameSink
from ..plane import decode_blob
from ..sockopts import close_socket
from ..tcp.stream import SocketReceiver, tune_socket
from . import cma
from .memory import ARENA_NAME, DATA_OFFSET, EXTENT, NONCE_BYTES, RING_NAME, Arena, ShmRing, available
from .records import (
    ARENA_FRAME,
    COUNTER,
    DIRECT_FRAME,
    FREED,
    READ,
    REPLY,
    RING_FRAME,
    WRITTEN,
    Records,
    Replies,
)

SMALL_FRAME = 64 * 1024  # an actor's frame up to this size is joined and copied into the ring at once

__all__ = ["ARENA_NAME", "DATA_OFFSET", "NONCE_BYTES", "RING_NAME", "Arena", "ShmReceiver", "ShmRing", "ShmSender",
           "available"]
# poll events that mean the actor shut its end (POLLRDHUP even with data still queued before it)
_PEER_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


class ReadyAnswer(msgspec.Struct, array_like=True, frozen=True):
    """The learner's Ready on this plane: it mapped the actor's arena (frames may point into
    it), and it read the actor's memory probe (large payloads may be sent by address)."""

    arena: bool
    direct: bool


class ShmSender:
    """Actor side: announces each frame on the data connection. A payload in the actor's arena
    is announced with its extents (the learner copies it out from there); a large one elsewhere
    by its addresses, once the learner showed it may read them (:attr:`direct`); any other is
    copied into the learner's ring first."""

    name = "shm"
    any_thread = True  # like tcp: any thread may send, under the connection's send lock

    def __init__(self, sock: socket.socket, ring: ShmRing, timeout: float, arena: Arena | None = None):
        tune_socket(sock)
        sock.setblocking(True)
        self.sock = sock
        self.ring = ring
        self.arena = arena  # only while frame buffers are kept until acknowledged (see Arena)
        self.direct = False  # the learner read our probe (its Ready says so)
        self.timeout = timeout
        self.written = 0  # into the ring, in all
        self.sent_directly = 0  # payload bytes announced by address, in all
        self.arena_frames = 0
        self.direct_frames = 0
        self._lock = threading.Lock()  # close() unmaps only between sends
        self._closed = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._replies = Replies(sock)

    def on_ready(self, answer: bytes) -> None:
        ready = decode_blob(answer, ReadyAnswer, "shm ready answer") if answer else ReadyAnswer(False, False)
        if not ready.arena:
            self.arena = None  # the learner could not map it: frames go through the ring
        self.direct = ready.direct

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        with self._lock:
            if self._closed:
                raise ConnectionResetError("the shm data plane is closed")
            size = sum(len(v) for v in payload)
            # A copy the actor keeps for resending (plain bytes) is never in the arena: no need
            # to look up its address.
            arena = self.arena
            in_arena = arena is not None and not isinstance(payload[0].obj, bytes)
            extents = arena.region.extents(payload) if in_arena and arena is not None else None
            if extents is not None:
                self.sock.sendall(b"".join((ARENA_FRAME, header, COUNTER.pack(len(payload)), extents)))
                self.arena_frames += 1
            elif self.direct and size >= cma.MIN_BYTES:
                self._send_direct(header, payload)
            elif self._room_for(size):
                # Copied first, announced after, in one send: the learner lands the whole frame
                # in one call (``_land_from_ring``) instead of beginning it and coming back for
                # its bytes (256 actor threads can wait for their processes' GIL between the
                # header and the bytes). So a frame that does not fit yet waits for room before
                # it is announced; only one larger than half the ring streams through it.
                for buf in [b"".join(payload)] if size <= SMALL_FRAME else payload:
                    if len(buf):
                        self.ring.copy_in(self.written, buf)
                        self.written += len(buf)
                self.sock.sendall(b"".join((RING_FRAME, header, WRITTEN, COUNTER.pack(self.written))))
            else:
                self.sock.sendall(RING_FRAME + header)
                self._stream(payload)

    def _send_direct(self, header: bytes, payload: list[memoryview]) -> None:
        pieces = [v for v in payload if len(v)]
        where = b"".join(EXTENT.pack(cma.address(v), len(v)) for v in pieces)
        self.sock.sendall(b"".join((DIRECT_FRAME, header, COUNTER.pack(len(pieces)), where)))
        self.sent_directly += sum(len(v) for v in pieces)
        self.direct_frames += 1
        # The payload (often the caller's own arrays) must stay as it is until it was read.
        try:
            self._wait(lambda: self._replies.read_directly >= self.sent_directly, "read the frame from our memory")
        except BaseException:
            # Shut the connection before the caller gets control back: a learner still reading
            # sees it and drops the frame rather than deliver memory that changed under it.
            close_socket(self.sock)
            raise

    def _fits(self, size: int) -> bool:
        """Whether ``size`` bytes fit in the ring's free room. The learner's replies are read
        only when the room we know of is short (not after every frame: a slow actor's step
        would pay a system call, and an exception, for nothing)."""
        if size <= self.ring.size - (self.written - self._replies.freed):
            return True
        if self._replies.read():
            self._check_replies()
        return size <= self.ring.size - (self.written - self._replies.freed)

    def _room_for(self, size: int) -> bool:
        """Whether ``size`` bytes can be copied into the ring before the frame is announced:
        at once, or after waiting for room if the frame fits in half the ring (the learner
        holds back less than a quarter, so that much is always freed in the end). The doorbell
        (our unchanged count) asks it to free at once what it has copied out, rather than at
        its next quarter of the ring. False: the frame streams."""
        if self._fits(size):
            return True
        if size > self.ring.size // 2:
            return False
        self._doorbell()
        self._wait(lambda: size <= self.ring.size - (self.written - self._replies.freed), "free room in the shared ring")
        return True

    def _stream(self, payload: list[memoryview]) -> None:
        for buf in payload:
            while len(buf):
                free = self.ring.size - (self.written - self._replies.freed)
                if not free:
                    self._doorbell()
                    self._wait(lambda: self.written - self._replies.freed < self.ring.size,
                               "free room in the shared ring")  # fmt: skip
                    continue
                k = min(free, len(buf))
                self.ring.copy_in(self.written, buf[:k])
                self.written += k
                buf = buf[k:]
        self._doorbell()

    def _doorbell(self) -> None:
        self.sock.sendall(WRITTEN + COUNTER.pack(self.written))

    def _wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            if not self._poll.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError(f"the learner did not {what} for {self.timeout:.3g}s")
            self._replies.read()  # may be half a reply: the rest follows
            self._check_replies()

    def _check_replies(self) -> None:
        if self._replies.freed > self.written:
            raise ProtocolError(f"learner freed {self._replies.freed} bytes of the shared ring; {self.written} written")
        if self._replies.read_directly > self.sent_directly:
            raise ProtocolError(f"learner read {self._replies.read_directly} bytes directly; "
                                f"{self.sent_directly} announced")  # fmt: skip

    def close(self) -> None:
        close_socket(self.sock)  # wakes a send waiting for room: it fails and lets go of the lock
        with self._lock:
            if not self._closed:
                self._closed = True
                self.ring.close()


class ShmReceiver(SocketReceiver):
    """Learner side: copies frames out of the ring, or out of the actor's arena or memory, into
    the sink's views, on a pump's thread (``SocketReceiver``)."""

    name = "shm"

    def __init__(self, sock: socket.socket, ring: ShmRing, sink: FrameSink, name: str = "rlink-shm-recv",
                 arena: ShmRing | None = None, actor_pid: int | cma.Process | None = None):  # fmt: skip
        super().__init__(sock, sink, name)
        self.ring = ring
        self.arena = arena
        # Set once we proved we may read the actor's memory (its pid checked with the kernel).
        self.actor = cma.Process(actor_pid) if isinstance(actor_pid, int) else actor_pid
        self._read_directly = 0
        self._written = 0  # what the actor announced
        self._consumed = 0  # copied out
        self._released = 0  # what we told the actor
        self._records = Records(sock)
        self._streaming: list[memoryview] = []  # a pumped frame's views still to fill, as its bytes come

    def _copy_ready(self, views: list[memoryview]) -> list[memoryview]:
        """Copy what the actor has written into the front of ``views``; the views still to fill."""
        while views and self._written > self._consumed:
            k = min(self._written - self._consumed, len(views[0]))
            self.ring.copy_out(self._consumed, views[0][:k])
            self._consumed += k
            views = [views[0][k:], *views[1:]] if k < len(views[0]) else views[1:]
            # Freed room is announced every half ring (and before waiting): each reply is a
            # system call here and a wake-up of the actor, a large share of the shm pump's
            # time if sent more often (docs/benchmarks.md).
            if self._consumed - self._released >= self.ring.size // 2:
                self._release()
        return views

    def _stream(self) -> None:
        """A pumped frame streaming through the ring: copy what came, never wait for the rest
        (the pump reads other actors meanwhile; the next byte count resumes it)."""
        self._streaming = self._copy_ready(self._streaming)
        if not self._streaming:
            self._frame_done()
        elif self._consumed != self._released:
            self._release()  # the actor may be waiting for room

    def _release(self) -> None:
        self._released = self._consumed
        self._reply(FREED, self._consumed)

    def _reply(self, kind: bytes, value: int) -> None:
        """Tell the actor a counter. An actor that has closed its end needs it no more: the
        next read sees the EOF and decides whether that was a clean close or mid-frame (a
        write failing first used to turn a clean close into a lost actor)."""
        try:
            self.sock.sendall(REPLY.pack(kind, value))
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _note_written(self, body: bytes) -> None:
        (written,) = COUNTER.unpack(body)
        if not self._written <= written <= self._consumed + self.ring.size:
            raise ProtocolError(f"actor announced {written} bytes in the shared ring; {self._consumed} consumed, "
                                f"ring of {self.ring.size}")  # fmt: skip
        self._written = written

    def _copy_from_arena(self, extents: list[tuple[int, int]], views: list[memoryview]) -> None:
        arena = self._checked_arena(extents)
        if sum(n for _, n in extents) != sum(len(v) for v in views):
            raise ProtocolError("a frame's extents do not add up to its payload")
        arena.copy_extents(extents, views)

    def _checked_arena(self, extents: list[tuple[int, int]]) -> ShmRing:
        """The actor's arena, once ``extents`` are known to lie in it."""
        if self.arena is None:
            raise ProtocolError("a frame in an arena this actor did not announce")
        size = self.arena.size
        if any(not (0 <= at <= size and 0 <= n <= size - at) for at, n in extents):
            raise ProtocolError("a frame's extents leave the actor's arena")
        return self.arena

    def _land_from_ring(self, header: bytes) -> bool:
        """Land a frame already in the ring (its byte count is the next record) that does not
        wrap, straight from the ring; False: it goes the usual way (begin, copy, end)."""
        size = announced_payload(header)  # the session checks it against the header's steps
        if self._written - self._consumed < size and self._records.buffered():
            self._note_written(self._records.next()[1])
        at = self._consumed % self.ring.size
        if self._written - self._consumed < size or at + size > self.ring.size:
            return False
        self._land_views(header, self.ring.views([(at, size)]))
        self._consumed += size
        if self._consumed - self._released >= self.ring.size // 2:  # as _copy_ready does
            self._release()
        return True

    def _land_from_arena(self, header: bytes, extents: list[tuple[int, int]]) -> None:
        """Land a frame in the actor's arena (its frame buffer: one extent per field)."""
        self._land_views(header, self._checked_arena(extents).views(extents))

    def _land_views(self, header: bytes, views: list[memoryview]) -> None:
        assert self._land is not None
        try:
            self._land(memoryview(header), views)
        finally:  # a view kept (by a refusal's traceback) would keep the mapping from closing
            for view in views:
                view.release()

    def _copy_directly(self, extents: list[tuple[int, int]], views: list[memoryview]) -> None:
        if self.actor is None:
            raise ProtocolError("a frame by address from an actor whose memory we did not probe")
        total = sum(n for _, n in extents)
        if total != sum(len(v) for v in views):
            raise ProtocolError("a frame's pieces do not add up to its payload")
        try:
            self.actor.read(extents, views)  # void (ESRCH) if the process exited meanwhile
        except OSError as exc:
            # An actor killed mid-frame loses its memory before its sockets close: give them a
            # moment to close before calling it a bad address.
            if exc.errno == errno.ESRCH or self._peer_closed(within=0.2):
                raise ConnectionResetError("the actor exited mid-frame") from None
            raise ProtocolError(f"the actor's frame could not be read from its memory: {exc}") from None
        # An actor gives up waiting for a read (its timeout) by shutting the connection before
        # its caller gets control back and may change the memory: a shutdown seen now means
        # the read may have raced with that, so the frame is dropped, never yielded torn.
        if self._peer_closed(within=0):
            raise ConnectionResetError("the actor gave up waiting for this frame to be read")
        self._read_directly += total
        self._reply(READ, self._read_directly)

    def _peer_closed(self, within: float) -> bool:
        """Whether the actor shut its end of the data connection (waiting up to ``within``
        seconds), even with records still unread before the shutdown."""
        poll = select.poll()
        poll.register(self.sock, _PEER_GONE)
        return any(events & _PEER_GONE for _, events in poll.poll(within * 1000))

    def pump_step(self) -> None:
        """Handle the records that have arrived, without waiting for more (the pump's thread)."""
        if self._records.fill():
            while self._records.complete():
                self._handle(*self._records.next())

    def _handle(self, kind: bytes, body: bytes, extents: list[tuple[int, int]]) -> None:
        if kind == WRITTEN:
            self._note_written(body)
            if self._streaming:
                self._stream()
            elif self._consumed != self._released:
                self._release()  # between frames a doorbell means: the actor waits for room
            return
        if self._streaming:
            raise ProtocolError("a new frame was announced before the last one's payload was written")
        if kind == ARENA_FRAME and self._land is not None:
            self._land_from_arena(body, extents)
            return
        if kind == RING_FRAME and self._land is not None and self._land_from_ring(body):
            return
        self.frame_started = time.monotonic()
        payload = [v for v in self.sink.begin(body) if len(v)]
        try:
            if kind == ARENA_FRAME:
                self._copy_from_arena(extents, payload)
            elif kind == DIRECT_FRAME:
                self._copy_directly(extents, payload)
            else:
                self._streaming = payload
                return self._stream()
        except EOFError:
            raise ConnectionResetError("actor closed the data connection mid-frame") from None
        self._frame_done()

    def _frame_done(self) -> None:
        self.frame_started = None
        self.sink.end_threadsafe()

    def _finished(self) -> None:
        self.ring.close()  # the pump's thread was the only one copying out of them
        if self.arena is not None:
            self.arena.close()
        if self.actor is not None:
            self.actor.close()
