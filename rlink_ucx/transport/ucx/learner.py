"""The ``ucx`` data plane, on ucxx's low-level (synchronous) API.

ucxx's asyncio API costs about ten times more per message than the low-level API driven by one
dedicated progress thread, which beats a raw socket (docs/transports.md, "Why the low-level
ucxx API"). So:

- the learner owns one UCX worker driven by :class:`UcxLearnerPlane`'s thread. It reads each
  frame header off the worker's queue of unexpected messages, where the sweeper finds it
  (so an actor between frames has no receive posted and costs the thread nothing per round; a
  header receive posted per actor would be checked every round, for every actor),
  and once the header is validated copies the small fields that came with it into the ring;
  each other field's message, once on the queue and as long as the field, is received into
  the ring (a rendezvous message straight from the actor's memory). A worker keeps the shared memory of every actor process it
  talked to, dead or not, so after ``Config.ucx_recycle_after`` ended sessions (and at least
  twice as many as are live) the thread starts a fresh worker and moves the live actors to it
  (they reconnect once);
- each actor owns a worker with one endpoint to the learner's worker address (exchanged over
  the authenticated control channel) and sends the frame header followed by its small fields
  as one message (``setup.inline_fields``), then each other field as a message of its own
  (``actor.py``).

Each session has two tags (headers, payloads) of 64 secret bits each, derived from its
key (``setup.session_tags``), so a process that did not authenticate cannot
address a session's buffers; what it sends anyway is thrown away (``unexpected.py``)
rather than kept by UCX for a receive that never comes. UCX's TCP transport listens only on
the interfaces of the control channel (``probe.net_devices``). Endpoint error handling
is off: it would restrict UCX to TCP and lose same-host shared memory (sysv/cma, several times
a raw socket; docs/benchmarks.md); a dead peer is detected by the control channel instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import PeerLost, ProtocolError
from ...wire.frame import FRAME_HEADER_BYTES
from ..base import DataPlaneRetired
from . import probe as ucx_probe
from .actor import UcxActorPlane
from .generation import Generation, recycle_due
from .setup import (
    HEADER_KIND,
    HEADER_MESSAGE_BYTES,
    PAYLOAD_KIND,
    SPINS_BEFORE_YIELD,
    UcxUnavailable,
    inline_fields,
    load_ucxx,
    make_worker,
    session_tags,
    ucx_options,
)
from .unexpected import DISCARD, KEEP, TAKEN

if TYPE_CHECKING:
    from ...config import Config
    from ..base import FrameSink

log = logging.getLogger(__name__)

__all__ = ["HEADER_KIND", "PAYLOAD_KIND", "SPINS_BEFORE_YIELD", "UcxActorPlane", "UcxLearnerPlane", "UcxUnavailable",
           "load_ucxx", "make_worker", "recycle_due", "session_tags", "ucx_options"]  # fmt: skip
_RECYCLED = "the learner started a fresh UCX worker; reconnect to it"
_UNANNOUNCED_GRACE = 1.0  # seconds a payload message may wait for its header's receive to complete


class _Receive:
    """One actor's receive state, touched only by the progress thread."""

    def __init__(self, sink: FrameSink, actor_id: int, tags: tuple[int, int], generation: Generation):
        self.sink = sink
        self.actor_id = actor_id
        self.tags = tags  # indexed by kind: HEADER_KIND, PAYLOAD_KIND
        self.generation = generation  # the worker whose address the actor was sent
        # Payload receives are posted through an endpoint of their own (to our own worker):
        # matching is still by tag alone, but closing the endpoint cancels exactly this
        # session's receives. (Its headers are taken off the unexpected queue, whole.)
        self.endpoint: Any = None
        self.header = bytearray(FRAME_HEADER_BYTES)  # the frame's header message, small fields included
        self.awaiting_header = False  # between frames: the next header is read when it comes
        self.requests: list[tuple[Any, Any, int]] = []  # (request, Array, kind) in flight
        self.views: list[memoryview] = []  # the frame's fields whose message has not come yet
        self.payload_left = 0  # the frame's payload messages not yet received whole
        self.unannounced_since: float | None = None  # payload of ours seen while awaiting a header
        self.dead = False
        self.frame_started: float | None = None


class UcxReceiver:
    """What the session sees (FrameReceiver): liveness of the current frame, and close."""

    name = "ucx"

    def __init__(self, plane: UcxLearnerPlane, state: _Receive):
        self._plane = plane
        self._state = state

    @property
    def frame_started(self) -> float | None:
        return self._state.frame_started

    def start(self) -> None:
        self._plane.call(lambda: self._plane._await_header(self._state))

    def close(self) -> None:
        self._plane.call(lambda: self._plane._drop(self._state))


class UcxLearnerPlane:
    """The learner's UCX worker and the one thread that drives it."""

    # Seconds without a completion before the thread sleeps in epoll. Counted in time, not
    # in rounds: a count of rounds, each yielding the core, can outlast the gaps between the
    # frames of many slow actors, and the thread would then spin a whole core for little work.
    _IDLE_SECONDS = 0.001

    def __init__(self, loop: asyncio.AbstractEventLoop, config: Config, loopback: bool = False,
                 host: str | None = None):  # fmt: skip
        """``host``: the control channel's bind address; UCX listens on its interfaces only."""
        self.u, self.Array = load_ucxx()
        self.loop = loop
        self.config = config
        self.loopback = loopback
        self.devices = None if loopback or host is None else ucx_probe.net_devices(host)
        # Every live session's tags -> (receive, kind), for telling its messages from strangers'.
        self._by_tag: dict[int, tuple[_Receive, int]] = {}
        self.current: Generation
        self._retiring: list[Generation] = []  # older workers, until their sessions are gone
        self.recycled = 0
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._receives: list[_Receive] = []
        self._busy: dict[_Receive, None] = {}  # sessions with receives in flight, in order
        self._stuck: list[_Receive] = []  # receives UCX would not give back (kept alive)
        self._stop = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        # UCX workers run in single-thread mode: the thread that drives the worker must be the
        # one that creates it (touching it from another thread hung transfers now and then).
        self._thread = threading.Thread(target=self._run, name="rlink-learner-ucx", daemon=True)
        self._thread.start()
        if not self._started.wait(config.connect_timeout):
            raise PeerLost(f"the learner's UCX worker did not start within {config.connect_timeout}s")
        if isinstance(self._start_error, UcxUnavailable):
            raise self._start_error
        if self._start_error is not None:
            raise UcxUnavailable(f"the learner's UCX worker did not start: {self._start_error}") from self._start_error

    # --- called from the loop thread ----------------------------------------------------------
    def attach(self, sink: FrameSink, actor_id: int, session_key: bytes, generation: Generation) -> UcxReceiver:
        """Receive one actor's frames into ``sink`` on ``generation``, the worker whose address
        the actor was sent (read from ``current`` when its session was opened); the tags come
        from the session's key. Returns the started receiver."""
        state = _Receive(sink, actor_id, session_tags(session_key), generation)
        for kind, tag in enumerate(state.tags):  # before its first message can arrive
            self._by_tag[tag] = (state, kind)
        receiver = UcxReceiver(self, state)
        receiver.start()
        return receiver

    @property
    def discarded(self) -> int:
        """Messages thrown away by the current worker: no live session asked for them."""
        sweeper = self.current.sweeper
        return sweeper.discarded if sweeper is not None else 0

    def call(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)

    async def close(self) -> None:
        self._stop = True
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, self.config.close_timeout)

    # --- the progress thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.current = Generation(self.config, self.loopback, self.devices)
        except BaseException as exc:  # noqa: BLE001 - reported by __init__ in the caller's thread
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException:  # a dead progress thread would stall every ucx actor: say so loudly
            log.critical("the learner's UCX progress thread died", exc_info=True)
            for state in list(self._receives):
                state.sink.fail_threadsafe(PeerLost("the learner's UCX progress thread died"))
            raise

    def _loop(self) -> None:
        idle, idle_since = 0, 0.0
        while not self._stop:
            try:
                while True:
                    self._calls.get_nowait()()
            except queue.Empty:
                pass
            self.current.worker.progress()
            for generation in self._retiring:
                generation.worker.progress()
            moved = self._poll()
            for generation in (self.current, *self._retiring):
                moved = self._sweep(generation) > 0 or moved
            if moved:
                idle = 0
            else:
                idle += 1
                if idle == 1:
                    idle_since = time.monotonic()
                elif idle > SPINS_BEFORE_YIELD:
                    os.sched_yield()  # busy-poll politely: actors on this host need the core too
                    if time.monotonic() - idle_since > self._IDLE_SECONDS and not self._retiring:
                        # Nothing moved for a while: sleep in epoll until UCX has an event (or
                        # 2 ms pass, so queued calls are still picked up promptly).
                        self.current.worker.progress_worker_event(2)
            if self._retiring:
                self._release_retired()
        self._shutdown()

    def _poll(self) -> bool:
        moved = False
        for state in list(self._busy):
            moved = self._advance(state) or moved
        return moved

    def _advance(self, state: _Receive) -> bool:
        """Receive ``state``'s payload messages that came, and handle its receives that
        completed, in order (a header's may take the payload's, which may complete at once).
        Returns whether anything moved."""
        moved = self._take_payloads(state)
        while state.requests and state.requests[0][0].completed:
            request, _, kind = state.requests.pop(0)
            moved = True
            try:
                request.check_error()
            except Exception as exc:  # noqa: BLE001 - a cancelled or failed receive
                self._failed(state, exc)
                break
            if kind == HEADER_KIND:
                self._on_header(state)
            else:
                state.payload_left -= 1
                if state.payload_left == 0:
                    self._on_frame(state)
        if not state.requests and not state.views:
            self._busy.pop(state, None)
        return moved

    def _take_payloads(self, state: _Receive) -> bool:
        """Receive each of ``state``'s payload messages that has come, straight into its field,
        once its length is the field's: UCX would fill a longer receive with a shorter message
        and call it complete, leaving the rest of the field as it was."""
        if not state.views:
            return False
        taken, tag = False, self.u.UCXXTag(state.tags[PAYLOAD_KIND])
        while state.views and not state.dead:
            found = state.generation.worker.tag_probe(tag, self.u.UCXXTagMaskFull)
            if not found.matched:
                break
            self._take_payload(state, found.length)
            taken = True
        return taken

    def _take_payload(self, state: _Receive, length: int) -> None:
        """Receive ``state``'s oldest payload message (``length`` bytes, on the worker's queue)
        into its next field, or end the session if the lengths differ."""
        view = state.views.pop(0)
        if length != len(view):
            self._failed(state, ProtocolError(f"a payload message of {length} bytes for a field of {len(view)}"))
            return
        self._recv(state, view, PAYLOAD_KIND)  # matches that oldest message at once

    def _sweep(self, generation: Generation) -> int:
        """Read the frame headers waiting on ``generation``'s worker, and throw away the
        messages that no live session of it asked for; a session's next message waits its
        turn. After ``_poll``: every receive that completed has been followed by the next one,
        so nothing still waiting is misjudged. Returns how many messages left the queue."""

        def triage(tag: int, length: int) -> int:
            state, kind = self._by_tag.get(tag, (None, HEADER_KIND))
            if state is None or state.dead or state.generation is not generation:
                return DISCARD
            if kind == HEADER_KIND:
                if not state.awaiting_header:
                    return KEEP  # its next frame's header, read once this frame is done
                if not FRAME_HEADER_BYTES <= length <= HEADER_MESSAGE_BYTES:
                    self._failed(state, ProtocolError(f"a frame header message of {length} bytes"))
                    return DISCARD
                self._take_header(generation, state, tag, length)
                return TAKEN
            if state.views:
                self._take_payload(state, length)
                return DISCARD if state.dead else TAKEN
            if state.payload_left:
                return KEEP
            # Payload while it waits for a header: more than its last header announced, unless
            # that header's receive has not been seen complete yet (given a moment).
            now = time.monotonic()
            if state.unannounced_since is None or now - state.unannounced_since < _UNANNOUNCED_GRACE:
                state.unannounced_since = state.unannounced_since or now
                return KEEP
            self._failed(state, ProtocolError("the actor sent payload that no frame header announced"))
            return DISCARD

        sweeper = generation.sweeper
        if sweeper is None:  # released: its sessions are gone
            return 0
        before = sweeper.discarded
        n = sweeper.sweep(generation.worker, triage)
        if sweeper.discarded and before == 0:
            log.warning("discarding UCX messages no session asked for (a peer that did not authenticate, "
                        "or one whose session ended)")  # fmt: skip
        return n

    def _take_header(self, generation: Generation, state: _Receive, tag: int, length: int) -> None:
        """Receive ``state``'s next frame header message, the oldest message with ``tag`` on the
        worker (``length`` bytes, eager, there whole), and handle its frame as far as it has come."""
        taken = generation.worker.tag_probe(self.u.UCXXTag(tag), self.u.UCXXTagMaskFull, True)
        if not taken.matched:  # pragma: no cover - only this thread takes messages off the queue
            self._failed(state, ProtocolError("internal: a probed frame header is gone"))
            return
        if len(state.header) != length:
            state.header = bytearray(length)
        array = self.Array(state.header)
        request = generation.worker.tag_recv_with_handle(array, taken)
        state.awaiting_header = False
        state.requests.append((request, array, HEADER_KIND))
        self._busy[state] = None
        self._advance(state)

    def _recv(self, state: _Receive, buffer: Any, kind: int) -> None:
        array = self.Array(buffer)
        request = state.endpoint.tag_recv(array, self.u.UCXXTag(state.tags[kind]))
        state.requests.append((request, array, kind))
        self._busy[state] = None

    def _await_header(self, state: _Receive) -> None:
        if state.dead:
            return
        if state.endpoint is None:
            generation = state.generation
            if generation is not self.current:  # opened just as its worker was retired
                self._failed(state, DataPlaneRetired(_RECYCLED))
                return
            own = self.u.UCXAddress.create_from_buffer(generation.address)
            state.endpoint = self.u.UCXEndpoint.create_from_worker_address(generation.worker, own, False)
            self._receives.append(state)
        state.awaiting_header = True  # no receive: _sweep takes it off the queue when it comes

    def _on_header(self, state: _Receive) -> None:
        state.frame_started = time.monotonic()
        state.unannounced_since = None
        try:
            views = [v for v in state.sink.begin(bytes(state.header[:FRAME_HEADER_BYTES])) if len(v)]
            views = self._unpack_inline(state.header, views)
        except ProtocolError as exc:
            self._failed(state, exc)
            return
        if not views:
            self._on_frame(state)
            return
        state.payload_left = len(views)
        state.views = views  # each received once its message is there, and its length checked
        self._busy[state] = None
        self._take_payloads(state)

    @staticmethod
    def _unpack_inline(message: bytearray, views: list[memoryview]) -> list[memoryview]:
        """Copy the small fields that came after the header in ``message`` into their
        ``views``; returns the views still to receive, one message each."""
        offset, rest, data = FRAME_HEADER_BYTES, [], memoryview(message)
        for view, ride in zip(views, inline_fields(len(view) for view in views)):
            if not ride:
                rest.append(view)
                continue
            end = offset + len(view)
            if end > len(message):
                break
            view[:] = data[offset:end]
            offset = end
        else:
            if offset == len(message):
                return rest
        raise ProtocolError(f"a frame header message of {len(message)} bytes does not match its small fields")

    def _on_frame(self, state: _Receive) -> None:
        state.frame_started = None
        state.sink.end_threadsafe()
        self._await_header(state)

    def _failed(self, state: _Receive, exc: BaseException) -> None:
        first = not state.dead
        self._drop(state)
        if first:
            err = exc if isinstance(exc, (ProtocolError, DataPlaneRetired)) else PeerLost(f"ucx receive failed: {exc!r}")
            state.sink.fail_threadsafe(err)

    def _drop(self, state: _Receive) -> None:
        """The session ended: withdraw its receives so UCX never writes into reused memory."""
        state.dead = True
        for tag in state.tags:  # from now on its messages are nobody's: thrown away
            if self._by_tag.get(tag, (None,))[0] is state:
                del self._by_tag[tag]
        if state not in self._receives:
            return
        if state.endpoint is not None:
            try:
                state.endpoint.close_blocking(10**8, 1)  # cancels this endpoint's receives
            except Exception:  # best effort; we still wait for the requests below
                log.debug("closing a session's ucx endpoint failed", exc_info=True)
            deadline = time.monotonic() + self.config.frame_timeout
            while any(not r.completed for r, _, _ in state.requests):
                state.generation.worker.progress()
                if time.monotonic() > deadline:
                    # Keep the buffers referenced (never freed under UCX) and the segment reserved.
                    log.error("ucx receives of actor %s did not cancel; its frame stays reserved",
                              state.actor_id)
                    self._receives.remove(state)
                    self._busy.pop(state, None)
                    self._stuck.append(state)
                    return
        self._forget(state)

    def _forget(self, state: _Receive) -> None:
        self._busy.pop(state, None)
        state.requests.clear()
        state.views = []
        state.endpoint = None
        if state in self._receives:
            self._receives.remove(state)
        state.sink.abandon()
        state.generation.ended += 1
        if state.generation is self.current and self._recycle_due():
            self._recycle()

    def _recycle_due(self) -> bool:
        live = sum(1 for s in self._receives if s.generation is self.current)
        return not self._stop and recycle_due(self.current.ended, live, self.config.ucx_recycle_after)

    def _recycle(self) -> None:
        """Start a new worker for new sessions and move the live ones to it: their sessions
        end here, and their actors reconnect (resending what was not acknowledged)."""
        try:
            fresh = Generation(self.config, self.loopback, self.devices)
        except Exception:  # keep serving on the old worker; try again later
            log.warning("could not start a fresh UCX worker; keeping the current one", exc_info=True)
            self.current.ended = 0
            return
        old, self.current = self.current, fresh
        self._retiring.append(old)
        self.recycled += 1
        moving = [s for s in self._receives if s.generation is old]
        log.info("recycling the learner's UCX worker after %d ended sessions; %d live ucx actors reconnect",
                 old.ended, len(moving))
        for state in moving:
            self._failed(state, DataPlaneRetired(_RECYCLED))

    def _release_retired(self) -> None:
        in_use = {id(s.generation) for s in (*self._receives, *self._stuck)}
        for generation in [g for g in self._retiring if id(g) not in in_use]:
            self._retiring.remove(generation)
            generation.release()

    def _shutdown(self) -> None:
        for state in list(self._receives):
            self._drop(state)
        if not self._stuck:
            # Release the workers here, on the thread that made them, rather than whenever the
            # Learner object is collected: their TCP listeners and shared memory go with them.
            for generation in (self.current, *self._retiring):
                generation.release()
            self._retiring.clear()
