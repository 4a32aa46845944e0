"""The ``ucx`` plane's actor side: one endpoint to the learner's worker (its address comes over
the authenticated control channel) on the UCX worker its I/O loop shares with the loop's other
actors of the same learner worker; per frame, one message of the header and the small fields
(``setup.inline_fields``), then one per other field, sent with the session's two tags, one
frame at a time (docs/transports.md, "Why one frame in flight"). The learner's side is ``learner.py``.

The worker is shared because making one is the dearest part of connecting: a UCX context and
worker cost ~6 ms of CPU (~50 ms of wall time in a storm of 256 actors on 2 cores), an endpoint
on an existing worker ~0.2 ms, and the actors of a process share one I/O loop, which the making
blocks. With a worker per actor, 64 actors released together in one process spent 3 s of that
loop's time making workers, while those already connected waited behind it to negotiate their
schema and send their first step (docs/benchmarks.md, "The ucx plane's start-up storm").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ...errors import PeerLost, ProtocolError
from . import probe as ucx_probe
from .setup import (
    HEADER_KIND,
    PAYLOAD_KIND,
    SPINS_BEFORE_YIELD,
    inline_fields,
    load_ucxx,
    make_worker,
    session_tags,
    ucx_options,
)
from .unexpected import DISCARD, Sweeper

if TYPE_CHECKING:
    from ...config import Config
    from ...wire.messages import Welcome

__all__ = ["UcxActorPlane"]


class _LoopWorker:
    """The UCX context and worker through which the ucx planes of one I/O loop send to one
    learner worker (with the same UCX options), made on that loop's thread, the only one that
    touches it (single-thread mode). Per learner worker, not per loop: a UCX worker keeps the
    shared memory of every peer it talked to, so one outliving the learner's recycled workers
    would gather their mappings; this one goes with the last actor that used it."""

    def __init__(self, key: tuple[Any, ...], u: Any, context: Any, worker: Any):
        self.key = key
        self.u, self.context, self.worker = u, context, worker
        self.users = 0  # planes holding it; the last one to close releases it


_workers: dict[tuple[Any, ...], _LoopWorker] = {}
_workers_lock = threading.Lock()  # the dict is per process; each entry belongs to one loop's thread


def _take_worker(loop: asyncio.AbstractEventLoop, peer: bytes, config: Config, loopback: bool,
                 devices: list[str] | None) -> _LoopWorker:  # fmt: skip
    """The worker of ``loop`` for the learner worker at address ``peer`` and these UCX options,
    made now if there is none; pair with :func:`_give_back`. Called on ``loop``'s thread."""
    key = (loop, os.getpid(), peer, tuple(sorted(ucx_options(config, loopback, devices).items())))
    with _workers_lock:
        shared = _workers.get(key)
    if shared is None:
        shared = _LoopWorker(key, *make_worker(config, loopback, devices))
        with _workers_lock:
            _workers[key] = shared
    shared.users += 1
    return shared


def _give_back(shared: _LoopWorker) -> None:
    """One plane is done with ``shared``: the last one releases the worker now (its TCP listener
    and shared memory go with it), not whenever the objects happen to be collected."""
    shared.users -= 1
    if shared.users > 0:
        return
    with _workers_lock:
        if _workers.get(shared.key) is shared:
            del _workers[shared.key]
    shared.u = shared.context = shared.worker = None


class UcxActorPlane:
    """The actor's side: one endpoint to the learner, on the worker its loop shares (``_LoopWorker``);
    sends in frame order."""

    name = "ucx"
    # UCX workers run in single-thread mode: only the thread that made the worker (the actor's
    # I/O loop) may touch it, so callers must not send from their own threads.
    any_thread = False

    def __init__(self, shared: _LoopWorker, endpoint: Any, tags: tuple[int, int], loop: asyncio.AbstractEventLoop,
                 config: Config, control: socket.socket | None = None):  # fmt: skip
        _, self.Array = load_ucxx()
        u = shared.u
        self.u, self._shared, self.worker, self.endpoint = u, shared, shared.worker, endpoint
        self.tags = tuple(u.UCXXTag(t) for t in tags)  # indexed by kind
        # We never receive: whatever arrives at our worker is a stranger's, thrown away.
        self._sweeper = Sweeper(u, self.Array)
        self.loop = loop
        self.config = config
        # A session the learner ended (dropped, or moved to a fresh worker) never completes our
        # pending send, and the EOF on the control channel is read by the loop this send
        # blocks. So the send watches the control socket for the learner's FIN itself.
        self._control_poll: select.poll | None = None
        if control is not None:
            self._control_poll = select.poll()
            self._control_poll.register(control, select.POLLRDHUP)

    @classmethod
    async def connect(cls, loop: asyncio.AbstractEventLoop, welcome: Welcome, session_key: bytes, incarnation: int,
                      config: Config, loopback: bool = False, control: socket.socket | None = None) -> UcxActorPlane:  # fmt: skip
        if not welcome.answer:
            raise ProtocolError("learner chose ucx but sent no worker address")
        devices = None
        if not loopback and control is not None:  # the interface our control channel left by
            devices = await loop.run_in_executor(None, ucx_probe.net_devices, control.getsockname()[0])
        if "ucxx._lib.arr" not in sys.modules:  # the first ucx actor here: import ucxx (~0.5 s) off the loop
            await loop.run_in_executor(None, load_ucxx)
        shared = _take_worker(loop, bytes(welcome.answer), config, loopback, devices)
        u = shared.u
        try:
            address = u.UCXAddress.create_from_buffer(welcome.answer)
            endpoint = u.UCXEndpoint.create_from_worker_address(shared.worker, address, False)
            return cls(shared, endpoint, session_tags(session_key), loop, config, control)
        except u.UCXError as exc:  # the worker it names is gone (recycled, or its learner restarted)
            _give_back(shared)
            raise PeerLost(f"the learner's ucx worker is unreachable ({type(exc).__name__}: {exc})") from exc
        except BaseException:
            _give_back(shared)
            raise

    def on_ready(self, answer: bytes) -> None:
        """Nothing to learn from the learner's Ready on this plane."""

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        tag_header, tag_payload = self.tags[HEADER_KIND], self.tags[PAYLOAD_KIND]
        inline = inline_fields(len(view) for view in payload)
        message = bytearray(header)  # UCX needs a writable, contiguous buffer
        for view, ride in zip(payload, inline):
            if ride:  # small fields ride along (setup.inline_fields)
                message += view
        keep = [self.Array(message)]
        requests = [self.endpoint.tag_send(keep[0], tag_header)]
        for view, ride in zip(payload, inline):
            if len(view) and not ride:
                keep.append(self.Array(view))
                requests.append(self.endpoint.tag_send(keep[-1], tag_payload))
        deadline = time.monotonic() + self.config.frame_timeout
        spins = 0
        # Progress on the sending thread until every buffer is handed over (the worker is only
        # touched under the connection's send lock).
        while not all(r.completed for r in requests):
            self.worker.progress()
            spins += 1
            if spins > SPINS_BEFORE_YIELD:  # a long send yields too: cheap when no one else waits
                os.sched_yield()
            if spins % 256 == 0:
                if time.monotonic() > deadline:
                    raise PeerLost(f"ucx send did not complete within {self.config.frame_timeout}s")
                if self._control_poll is not None and self._control_poll.poll(0):
                    raise PeerLost("the learner ended the session while a frame was being sent")
        for request in requests:
            request.check_error()
        self._sweeper.sweep(self.worker, lambda tag, length: DISCARD)

    def close(self) -> None:
        if self.endpoint is None:
            return
        with contextlib.suppress(Exception):  # best effort at shutdown
            self.endpoint.close_blocking(10**9, 1)  # bounded (ns): never hang on a dead peer
        self.endpoint = self.worker = None
        _give_back(self._shared)
