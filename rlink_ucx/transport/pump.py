"""A few threads read every data connection of the process (tcp and shm).

Threads that each read one connection pass the GIL and the cores around several times per
frame (docs/benchmarks.md, "Figures behind the code's choices"). A pump polls every registered
connection and lets each receiver handle what has arrived without waiting for more
(``pump_step``): an shm receiver whole frames at a time (a frame's bytes are in the shared
ring, the actor's arena or its memory before it is announced; only a frame larger than half
the ring streams, and the pump copies its bytes as they come, never waiting for them), a tcp
receiver whatever bytes came, keeping a frame that came in pieces where it stopped. A stalled frame is closed by the
session's heartbeat check, which ends such a wait or the partial frame.

A pump takes at most :data:`PER_PUMP` connections (a receiver may ask for another limit);
more actors get more pumps. Every socket call releases the GIL, and a single pump for hundreds
of actors once got it back only after the learner's I/O loop had had its turn (up to the 5 ms
switch interval): with 1,024 actors a burst of 550 frames took 0.7 s. With frames landed a pass
at a time that is gone, and several pumps cost more than one: each wakes for the frame or two
of its own connections, and every read hands the GIL to another pump that woke (1,024 tcp
actors of small frames: 30-35 us of the pumps' CPU a frame over 64 or 8 pumps, 17-19 over one;
docs/benchmarks.md, "#51"). So small-frame tcp connections share one pump, and a connection
moves to a pump of its own (``wants_own_pump``, ``_hand_over``) once it streams large frames,
whose kernel copies then run on every core at once.

A pass of a pump reads every ready connection before it lands anything: a tcp receiver defers
the whole small frames a read brought (``defer``; their bytes stay in the pump's arena) and the
pump lands them all at the end of the pass, through the sessions' ``land_burst`` (one hold of
the ring's lock for the burst, not one per frame).

A receiver's socket is closed by the pump only once it has stopped polling it (a number closed
elsewhere could come back as another connection's while the pump still watches it): the
receiver's ``close`` shuts the socket down, which wakes the pump.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Any

from .sockopts import close_socket

__all__ = ["PER_PUMP", "Pump", "pump"]

log = logging.getLogger(__name__)

PER_PUMP = 16  # connections one pump reads at most
ARENA_BYTES = 256 * 1024  # a pump's reads of one pass; a burst that fills it lands early

_IN = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR


class Pump:
    """One thread, its poll set, and the receivers waiting to join it."""

    def __init__(self) -> None:
        self.connections = 0  # receivers added and not yet ended (under _start_lock)
        self._poll = select.epoll()  # poll() walks every socket on each call: 1,024 actors cost a core
        self._by_fd: dict[int, Any] = {}  # socket number -> its receiver (a SocketReceiver)
        self._lock = threading.Lock()
        self._joining: list[Any] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, select.EPOLLIN)
        self._arena: memoryview | None = None  # allocated by the first read that wants it
        self._arena_size = 0
        self._arena_at = 0  # bytes of the arena the deferred frames of this pass may point into
        self._burst: list[tuple[Any, memoryview, memoryview]] = []  # (receiver, header, payload)
        self.thread = threading.Thread(target=self._serve, name="rlink-pump", daemon=True)
        self.thread.start()

    def add(self, receiver: Any) -> None:
        """Read ``receiver``'s connection from now on (any thread)."""
        with self._lock:
            self._joining.append(receiver)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _serve(self) -> None:
        try:
            while not self._retired():
                try:
                    self._read_pass(self._poll.poll())
                    if self._burst:
                        self._land_pass()
                except Exception:  # a bug here must not end every actor's reading
                    log.exception("pump: unexpected error; going on")
        finally:
            self._poll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _retired(self) -> bool:
        """Once its last connection ended, a pump leaves the pool and its thread ends (a closed
        learner leaves no thread behind); the next connection gets a new one."""
        with _start_lock:
            if self.connections:
                return False
            if self in _pumps:
                _pumps.remove(self)
            return True

    def _join(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            joining, self._joining = self._joining, []
        for receiver in joining:  # each on its own: one that fails must not strand the others
            fd = receiver.sock.fileno()
            if fd < 0:  # closed before it could join
                self._end(receiver)
                continue
            stale = self._by_fd.get(fd)
            if stale is not None:  # its socket was closed elsewhere and the number reused
                self._drop(fd, stale, ConnectionResetError("the data connection was closed"))
            try:
                self._poll.register(fd, _IN)
            except OSError as exc:
                self._drop(fd, receiver, exc)
                continue
            self._by_fd[fd] = receiver

    def _read_pass(self, events: list[tuple[int, int]]) -> None:
        """Let each ready receiver read what came (one loop for the pass: with a thousand
        connections ready, every call saved here is a thousand calls)."""
        by_fd = self._by_fd
        for fd, _ in events:
            receiver = by_fd.get(fd)
            if receiver is None:
                if fd == self._wake_r:
                    self._join()
                continue
            try:
                receiver.pump_step()
            except Exception as exc:  # noqa: BLE001 - reported to the receiver's session
                self._drop(fd, receiver, exc)
                continue
            if receiver.wants_own_pump:
                self._hand_over(fd, receiver)

    def _hand_over(self, fd: int, receiver: Any) -> None:
        """Move ``receiver`` to a pump of its own (or the least busy other one, once
        ``receiver.own_pump_spread`` pumps run), between two of its reads."""
        receiver.wants_own_pump = False
        if self._burst:
            self._land_pass()  # its frames deferred this pass land before another pump reads it
            if self._by_fd.get(fd) is not receiver:
                return  # one of them was refused: it was dropped
        target = pump(receiver.own_pump_spread, exclude=self)
        self._by_fd.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except OSError:
            pass
        with _start_lock:
            self.connections -= 1
        receiver.pump = target
        target.add(receiver)

    # --- a pass's burst of whole frames (the pump's thread only) --------------------------------
    def room(self, size: int) -> memoryview:
        """Where the next read of up to ``size`` bytes goes: the free part of the arena (the
        burst so far lands first when less than that is left)."""
        at = self._arena_at
        if self._arena_size - at < size:
            if self._arena is None:
                self._arena = memoryview(bytearray(max(ARENA_BYTES, size)))
                self._arena_size = len(self._arena)
            else:
                self._land_pass()
            at = self._arena_at
        assert self._arena is not None
        return self._arena[at : at + size]

    def used(self, n: int) -> None:
        """The last read put ``n`` bytes at the front of ``room``: keep them until the burst lands."""
        self._arena_at += n

    def defer(self, receiver: Any, header: memoryview, payload: memoryview) -> None:
        """A whole frame read into the arena, landed with the rest of the pass's."""
        self._burst.append((receiver, header, payload))

    @property
    def deferred(self) -> bool:
        return bool(self._burst)

    def _land_pass(self) -> None:
        """Land the burst and start the arena over (between two receivers' reads)."""
        self.land_burst()
        self._arena_at = 0

    def land_burst(self, current: Any = None) -> Exception | None:
        """Land the deferred frames, grouped by the sinks' ``land_burst``; stop reading each
        receiver whose session refused one. ``current``: the receiver whose ``pump_step`` is
        running, which is not dropped here: its error is returned for it to raise. The arena
        is kept (``current`` may still be parsing from it)."""
        burst, self._burst = self._burst, []
        refused: list[tuple[Any, Exception]] = []
        lands = {receiver.land_burst for receiver, _, _ in burst}  # one kind of sink, in practice
        for land in lands:
            refused += land([(r.sink, header, payload) for r, header, payload in burst if r.land_burst is land])
        if not refused:
            return None
        receiver_of = {id(r.sink): r for r, _, _ in burst}
        mine = None
        for sink, exc in refused:
            receiver = receiver_of[id(sink)]
            fd = receiver.sock.fileno()
            if receiver is current:
                mine = exc
            elif self._by_fd.get(fd) is receiver:  # not dropped already (its end is counted once)
                self._drop(fd, receiver, exc)
        return mine

    def _drop(self, fd: int, receiver: Any, exc: Exception) -> None:
        """Stop reading ``receiver`` (which stopped on ``exc``) and close its socket."""
        if self._by_fd.get(fd) is receiver:  # not a later receiver that got the same number
            del self._by_fd[fd]
            try:
                self._poll.unregister(fd)
            except OSError:  # closed elsewhere: the kernel dropped it from the set already
                pass
        try:
            receiver._failed(exc)
        finally:
            try:
                self._end(receiver)
            finally:
                close_socket(receiver.sock)

    def _end(self, receiver: Any) -> None:
        try:
            receiver._ended()
        finally:
            with _start_lock:
                self.connections -= 1


_pumps: list[Pump] = []
_start_lock = threading.Lock()


def pump(spread: int = 1, per_pump: int = PER_PUMP, exclude: Pump | None = None) -> Pump:
    """A pump with room for one more connection (counted as taken): the least busy one with
    fewer than ``per_pump``, or a new one while fewer than ``spread`` run (or all are full).
    ``exclude``: a pump not to choose (the one a connection leaves).

    ``spread`` is the plane's: a tcp pump does the kernel's copy of every byte it reads, so a
    few connections streaming large frames each get a pump of their own and copy on every
    core at once (one pump for 4 Atari actors took 7.1 GB/s down to 5.2-5.5, docs/benchmarks.md);
    past ``spread`` connections share pumps, up to :data:`PER_PUMP` each.
    """
    with _start_lock:
        room = (p for p in _pumps if p.connections < per_pump and p is not exclude)
        chosen = min(room, key=lambda p: p.connections, default=None)
        if chosen is None or (len(_pumps) < spread and chosen.connections):
            chosen = Pump()
            _pumps.append(chosen)
        chosen.connections += 1
        return chosen


def _forget_pumps() -> None:
    global _pumps, _start_lock
    _pumps = []  # a forked child has no pump threads: it starts its own when it needs them
    _start_lock = threading.Lock()  # a thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pumps)
